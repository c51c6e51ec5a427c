"""GRPO end to end on two GPUs: the toy task of tests/e2e/test_train_grpo.py (tiny random Llama, reward = a digit
in the completion, 8 completions per prompt), 20 steps per variant:

  A  CPU trainer + CPU server (the reference), weight sync over ZeroMQ;
  B  1 CUDA trainer rank on GPU0 + CUDA server on GPU1, --weight-sync-transport nccl. Afterwards, with B's server
     still up, a fresh CUDA server on GPU1 loads B's final checkpoint (fp32; the server rounds it to bf16) and both
     answer the same 4 greedy prompts: tokens and logprobs must be bit-identical, which proves that the weights
     NCCL delivered equal the trainer's bf16 weights;
  C  2 CUDA trainer ranks (GPU0, GPU1; ZeRO-3 collectives over NCCL) + CUDA server on GPU0,
     --weight-sync-transport auto: one NCCL communicator cannot hold GPU0 twice, so it should fall back to ZeroMQ.

Pass rules: every run finishes all steps; its mean reward over the last 5 steps beats the first 5; B's last-5 mean
>= A's - 0.15; B's start line says "weight sync over NCCL"; C's says "ZeRO collectives over NCCL". Also reported:
max |loss_B - loss_A| over the first 5 steps (the rollouts differ, bf16 vs fp32 sampling, so it is reported, not
judged) and whether C fell back to ZeroMQ. Exits 1 when a variant fails.

    python3 scripts/gpu-grpo-check.py --build build-gpu.carry [--variants A,B,C] [--steps 20]

--dry-run-cpu runs the same orchestration with every process on the CPU backend (transport zmq, C as 2 CPU ranks):
it checks this script (launch, metrics, checkpoint, the equality check) on a machine without GPUs.
"""
import argparse
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "e2e"))
import server_fixtures  # noqa: E402


def use_devlib(build):
    """Puts the carried folder's bundled libraries (scripts/gpu-build.sh packs them as devlib.tar.xz) on the
    library path of the tandem processes this script starts; unpacks them first when needed."""
    lib = build / "devlib"
    if not lib.is_dir() and (build / "devlib.tar.xz").exists():
        try:
            with tarfile.open(build / "devlib.tar.xz") as tar:
                tar.extractall(build, filter="data")
        except OSError as e:  # a read-only folder: scripts/gpu-check.sh unpacks elsewhere and sets the path
            print(f"cannot unpack {build / 'devlib.tar.xz'}: {e}", file=sys.stderr)
    if lib.is_dir():
        os.environ["LD_LIBRARY_PATH"] = f"{lib}:{os.environ.get('LD_LIBRARY_PATH', '')}"
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast can take a shared host's GPUs down
    # Bit-identical tokens from two server processes need the same GEMM algorithms in both: autotuning picks them by
    # timing, which can differ from process to process.
    os.environ.setdefault("TANDEM_GEMM_AUTOTUNE", "0")

# Token-id prompts (vocab 300, ids 0-2 are special), each shorter than one 16-token KV block so that no prefix
# cached during training can be reused by one server and not the other.
PROBES = [[5, 17, 33, 4], [100, 7, 250, 9, 12], [42], [3, 3, 200, 150, 60, 61, 80, 90]]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_args(device, gpu, select):
    """(extra tandem-serve args, env) placing a server on `gpu` (None: CPU)."""
    if gpu is None:
        return ["--device", device], {}
    if select == "cvd":
        return ["--device", "cuda"], {"CUDA_VISIBLE_DEVICES": str(gpu)}
    return ["--device", f"cuda:{gpu}"], {}


def train(build, model_dir, data, out_dir, control, world, device, transport, steps, timeout):
    """Runs `world` trainer ranks (LOCAL_RANK = rank picks the GPU); returns (codes, logs, metrics rows)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [str(build / "bin" / "tandem-train"), "--model", str(model_dir), "--train-file", str(data),
            "--output-dir", str(out_dir / "run"), "--rollout-servers", control, "--rewards", "regex_format",
            "--format-regex", "[0-9]", "--format-regex-mode", "search", "--num-generations", "8",
            "--per-device-train-batch-size", "8", "--gradient-accumulation-steps", "1",
            "--max-completion-length", "12", "--max-prompt-length", "64", "--learning-rate", "2e-2",
            "--max-steps", str(steps), "--logging-steps", "1", "--save-steps", "0", "--zero-stage", "3",
            "--loss-type", "grpo", "--seed", "3", "--init-timeout", "60", "--comm-timeout", "30",
            "--rollout-timeout", "60", "--device", device, "--weight-sync-transport", transport]
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        log = open(out_dir / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.time() + timeout
    codes = []
    for p, log in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.time())))
        except subprocess.TimeoutExpired:
            codes.append(f"timeout {timeout} s")
    for p, log in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait()
        log.close()
    logs = [(out_dir / f"rank{r}.log").read_text(errors="replace") for r in range(world)]
    path = out_dir / "run" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return codes, logs, rows


def probe(url):
    """Greedy continuations of PROBES, one request at a time: [(token_ids, token_logprobs, top_logprobs)]."""
    out = []
    for p in PROBES:
        status, body, _ = server_fixtures.http_json("POST", url + "/v1/completions", {
            "prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "logprobs": 2,
            "return_token_ids": True}, timeout=120)
        if status != 200:
            raise AssertionError(f"{url}/v1/completions answered {status}: {body}")
        c = body["choices"][0]
        out.append((c["token_ids"], c["logprobs"]["token_logprobs"], c["logprobs"]["top_logprobs"]))
    return out


def compare_probes(synced, loaded):
    """'' when bit-identical, else what differs first."""
    for i, (a, b) in enumerate(zip(synced, loaded)):
        if a[0] != b[0]:
            return f"prompt {i}: tokens {a[0]} (synced) vs {b[0]} (checkpoint)"
        for t, (x, y) in enumerate(zip(a[1], b[1])):
            if x != y:
                return f"prompt {i} token {t}: logprob {x!r} (synced) vs {y!r} (checkpoint), diff {x - y:.3g}"
        if a[2] != b[2]:
            return f"prompt {i}: top_logprobs differ: {a[2]} vs {b[2]}"
    return ""


def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


DESC = {("A", False): "cpu trainer + cpu server, zmq",
        ("B", False): "1 cuda rank GPU0 + cuda server GPU1, transport nccl",
        ("C", False): "2 cuda ranks GPU0+GPU1 (NCCL ZeRO-3) + cuda server GPU0, auto",
        ("B", True): "cpu trainer + cpu server, zmq (dry run)",
        ("C", True): "2 cpu ranks + cpu server, auto (dry run)"}
DESC[("A", True)] = DESC[("A", False)]


class Result:
    def __init__(self, name, desc):
        self.name, self.desc = name, desc
        self.rows, self.ok, self.notes, self.log = [], False, [], ""

    def summary(self):
        r = [x["reward"] for x in self.rows]
        return mean(r[:5]), mean(r[-5:])


def finish_run(res, steps, codes, logs, rows, want_start):
    res.rows = rows
    res.log = "\n".join(f"--- rank {i} log (tail)\n{log[-3000:]}" for i, log in enumerate(logs))
    if any(c != 0 for c in codes):
        res.notes.append(f"trainer exit codes {codes}")
        return False
    if len(rows) != steps:
        res.notes.append(f"{len(rows)} metrics rows, want {steps}")
        return False
    if want_start not in logs[0]:
        res.notes.append(f"start line lacks {want_start!r}")
        return False
    first, last = res.summary()
    if not last > first:
        res.notes.append(f"reward did not rise ({first:.3f} -> {last:.3f})")
        return False
    return True


def variant_a(ctx):
    res = Result("A", DESC[("A", ctx.dry)])
    control = f"tcp://127.0.0.1:{free_port()}"
    with server_fixtures.TandemServer(ctx.model, "--control", control, "--device", "cpu", start_timeout=120):
        codes, logs, rows = train(ctx.build, ctx.model, ctx.data, ctx.work / "A", control, 1, "cpu", "zmq",
                                  ctx.steps, ctx.timeout)
    res.ok = finish_run(res, ctx.steps, codes, logs, rows, "weight sync over ZeroMQ")
    return res


def variant_b(ctx, ref):
    dry = ctx.dry
    res = Result("B", DESC[("B", dry)])
    control = f"tcp://127.0.0.1:{free_port()}"
    sargs, senv = server_args("cpu", None if dry else 1, ctx.select)
    with server_fixtures.TandemServer(ctx.model, "--control", control, *sargs, env=senv, start_timeout=300) as srv:
        codes, logs, rows = train(ctx.build, ctx.model, ctx.data, ctx.work / "B", control, 1,
                                  "cpu" if dry else "cuda", "zmq" if dry else "nccl", ctx.steps, ctx.timeout)
        res.ok = finish_run(res, ctx.steps, codes, logs, rows,
                            "weight sync over ZeroMQ" if dry else "weight sync over NCCL")
        if ref is not None and ref.ok and res.ok:
            d = max(abs(a["loss"] - b["loss"]) for a, b in zip(ref.rows[:5], rows[:5]))
            # On policy (one iteration) the grpo loss is -mean(advantage x IS weight) with zero-mean group
            # advantages, ~0 by construction: the entropy of step 1 (same initial weights, own rollouts) says more.
            res.notes.append(f"max |loss_B - loss_A| steps 1-5 = {d:.3g}; entropy step 1: "
                             f"A {ref.rows[0]['entropy']:.4f}, B {rows[0]['entropy']:.4f}")
            if not res.summary()[1] >= ref.summary()[1] - 0.15:
                res.ok = False
                res.notes.append(f"last-5 reward {res.summary()[1]:.3f} < A's {ref.summary()[1]:.3f} - 0.15")
        if not res.ok:
            res.log += f"\n--- server log (tail)\n{srv.log_text()[-3000:]}"
            return res
        if rows[-1].get("policy_version") != ctx.steps:
            res.ok = False
            res.notes.append(f"last policy_version {rows[-1].get('policy_version')}, want {ctx.steps}")
            return res
        ckpt = ctx.work / "B" / "run" / f"checkpoint-{ctx.steps}"
        if not (ckpt / "config.json").exists():
            res.ok = False
            res.notes.append(f"no final checkpoint at {ckpt}")
            return res
        try:
            synced = probe(srv.url)
            with server_fixtures.TandemServer(ckpt, *sargs, env=senv, start_timeout=300) as fresh:
                loaded = probe(fresh.url)
        except AssertionError as e:
            res.ok = False
            res.notes.append(f"probe failed: {str(e)[:300]}")
            return res
    diff = compare_probes(synced, loaded)
    if diff:
        res.ok = False
        res.notes.append(f"synced server != checkpoint server: {diff}")
    else:
        res.notes.append(f"synced server == server from {ckpt.name}: {len(PROBES)} prompts x 16 tokens, "
                         "tokens and logprobs bit-identical")
    return res


def variant_c(ctx):
    dry = ctx.dry
    res = Result("C", DESC[("C", dry)])
    control = f"tcp://127.0.0.1:{free_port()}"
    sargs, senv = server_args("cpu", None if dry else 0, ctx.select)
    with server_fixtures.TandemServer(ctx.model, "--control", control, "--weight-sync-timeout", "30", *sargs,
                                      env=senv, start_timeout=300) as srv:
        codes, logs, rows = train(ctx.build, ctx.model, ctx.data, ctx.work / "C", control, 2,
                                  "cpu" if dry else "cuda", "auto", ctx.steps, ctx.timeout)
        res.ok = finish_run(res, ctx.steps, codes, logs, rows,
                            "ZeRO collectives over ZeroMQ" if dry else "ZeRO collectives over NCCL")
        if not res.ok:
            res.log += f"\n--- server log (tail)\n{srv.log_text()[-3000:]}"
    fell_back = "using transport zmq from now on" in (logs[0] if logs else "")
    started = "NCCL" if "weight sync over NCCL" in (logs[0] if logs else "") else "ZeroMQ"
    res.notes.append(f"weight sync started as {started}; "
                     + ("fell back to zmq" if fell_back else "did not fall back"))
    if not dry and not fell_back:
        res.notes.append("UNEXPECTED: NCCL with the server on a trainer rank's GPU should not work")
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build-gpu.carry")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--variants", default="A,B,C")
    ap.add_argument("--timeout", type=int, default=180, help="seconds per training run")
    ap.add_argument("--server-gpu", choices=["cvd", "index"], default="cvd",
                    help="place a server on GPU g by CUDA_VISIBLE_DEVICES=g (cvd) or by --device cuda:g (index)")
    ap.add_argument("--dry-run-cpu", action="store_true", help="every process on the CPU backend (no GPU needed)")
    args = ap.parse_args()
    build = pathlib.Path(args.build).resolve()
    use_devlib(build)
    server_fixtures.BUILD = build
    want = set(args.variants.upper().split(","))
    results = []
    t_start = time.time()
    with tempfile.TemporaryDirectory() as d:
        ctx = argparse.Namespace(build=build, work=pathlib.Path(d), model=pathlib.Path(d) / "model",
                                 data=pathlib.Path(d) / "train.jsonl", steps=args.steps, timeout=args.timeout,
                                 select=args.server_gpu, dry=args.dry_run_cpu)
        server_fixtures.build_tiny_model(ctx.model)
        words = ["the quick brown", "a lazy dog", "seven wizards", "numbers plus", "question answer", "think step"]
        with open(ctx.data, "w") as f:
            for i in range(64):
                f.write(json.dumps({"prompt": words[i % len(words)] + f" {i % 10}"}) + "\n")
        ref = None
        for name, fn in (("A", variant_a), ("B", lambda c: variant_b(c, ref)), ("C", variant_c)):
            if name not in want:
                continue
            t0 = time.time()
            try:
                res = fn(ctx)
            except (AssertionError, OSError, subprocess.SubprocessError) as e:
                res = Result(name, DESC[(name, ctx.dry)])
                res.notes.append(f"{type(e).__name__}: {str(e)[:1500]}")
            res.seconds = time.time() - t0
            if name == "A":
                ref = res
            results.append(res)
            print(f"== {name} ({res.desc}): {'ok' if res.ok else 'FAILED'} in {res.seconds:.0f} s", flush=True)
            for n in res.notes:
                print(f"   {n}")
            if not res.ok and res.log:
                print(res.log)
    print()
    print("per step: reward / loss")
    print(f"{'step':>4}" + "".join(f"{r.name + ' reward':>11}{r.name + ' loss':>11}" for r in results))
    for s in range(args.steps):
        line = f"{s + 1:>4}"
        for r in results:
            if s < len(r.rows):
                line += f"{r.rows[s]['reward']:>11.3f}{r.rows[s]['loss']:>11.2e}"
            else:
                line += f"{'-':>11}{'-':>11}"
        print(line)
    print()
    print(f"{'variant':<8}{'reward 1-5':>11}{'last 5':>8}{'median step s':>15}{'median sync s':>15}  verdict")
    for r in results:
        first, last = r.summary() if r.rows else (float("nan"), float("nan"))
        st = sorted(x["step_time"] for x in r.rows)
        sy = sorted(x["sync_time"] for x in r.rows)
        med = lambda xs: f"{xs[len(xs) // 2]:.4f}" if xs else "-"
        print(f"{r.name:<8}{first:>11.3f}{last:>8.3f}{med(st):>15}{med(sy):>15}  {'PASS' if r.ok else 'FAIL'}  "
              + "; ".join([r.desc] + r.notes))
    ok = all(r.ok for r in results) and len(results) == len(want)
    each = ", ".join(f"{r.name}={'ok' if r.ok else 'FAIL'}" for r in results)
    print(f"summary: GRPO GPU check {'PASS' if ok else 'FAIL'} ({each}) in {time.time() - t_start:.0f} s")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
