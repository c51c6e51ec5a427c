"""Transport nccl straight into tensor-parallel shards, on the CPU (its CPU twin: shared/comm's host backend between
CPU trainer ranks and CPU servers; the same code as on GPUs, fp32 slices instead of bf16).

Two trainer ranks (ZeRO-3) push every step with `--weight-sync-transport nccl` to two servers at once, one of two
engines of 2 tensor-parallel shards each (--devices cpu,cpu) and a plain one: 3 server members of the communicator
beside the 2 ranks (engine 0's shards receive and copy their staging to engine 1's). Each rank sends each shard only the parts of its slice that the shard holds (whole rows straight from the slice,
o_proj / down_proj column blocks packed), and each shard receives them straight into its own staging.

Checks:
- the run ends, the trainer says it synced over the host communicator, and both servers are at the last version;
- after the run each server's greedy tokens AND logprobs equal, exactly, those of a fresh server of the same
  tensor-parallel size loaded from the run's last checkpoint (fp32, the masters the ranks sent): every shard holds
  the checkpoint's shards bit for bit (a part received into the wrong place, or missed, changes the logits);
- servers restarted at the same endpoints, one with another tensor-parallel size (2 -> 4: KV heads now replicated
  on two shards each), take a new run's pushes, cut for their new sizes, and again equal fresh servers of those
  sizes from that run's checkpoint.

GPU (`python3 tests/e2e/test_weight_sync_shards.py --gpu`, scripts/gpu-check.sh B shards; no pytest there): the same
over NCCL with bf16 slices, then over zmq (the ranks' bf16 units as frames), a trainer rank on cuda:0, a TP = 2 server on cuda:0-1 (2 GPUs; every process its own
NCCL_HOSTID, since the trainer and shard 0 share cuda:0) and a plain server on the last GPU; one GPU runs the plain
server alone. Synced servers equal fresh ones from the checkpoint bit for bit (the checkpoint's fp32 masters round to
the bf16 the ranks sent).
"""
import concurrent.futures
import contextlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from server_fixtures import (BUILD, Skip, TandemServer, build_tiny_model, cuda_devices, free_port,  # noqa: E402
                             http_json, metric, metrics, skip)

PROMPT = [5, 17, 33, 4]


def greedy(url):
    status, out, _ = http_json("POST", url + "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
        "logprobs": 1})
    assert status == 200, out
    choice = out["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def policy_version(url):
    return metric(metrics(url), "tandem_policy_version")


def write_dataset(path, n=64):
    words = ["the quick brown", "a lazy dog", "seven wizards", "numbers plus", "question answer", "think step"]
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": words[i % len(words)] + f" {i % 10}", "id": i}) + "\n")


def host_env(name):
    """Every process its own NCCL host id: NCCL then joins processes that share a GPU over its network transport."""
    return {"NCCL_HOSTID": f"tandem-shards-{name}", "NCCL_NVLS_ENABLE": "0"}


def args(model_dir, data, out_dir, controls, steps, device, transport="nccl"):
    return ["--device", device, "--model", str(model_dir), "--train-file", str(data), "--output-dir", str(out_dir),
            "--rollout-servers", ",".join(controls), "--rewards", "regex_format", "--format-regex", "[0-9]",
            "--format-regex-mode", "search", "--num-generations", "4", "--per-device-train-batch-size", "4",
            "--gradient-accumulation-steps", "1", "--max-completion-length", "8", "--max-prompt-length", "64",
            "--learning-rate", "2e-2", "--max-steps", str(steps), "--logging-steps", "1", "--save-steps", "0",
            "--zero-stage", "3", "--seed", "5", "--init-timeout", "60", "--comm-timeout", "30",
            "--rollout-timeout", "60", "--weight-sync-transport", transport]


def run_ranks(d, model_dir, data, out_dir, controls, steps, world=2, device="cpu", transport="nccl"):
    if not (BUILD / "bin" / "tandem-train").exists():
        skip(f"{BUILD}/bin/tandem-train is not built")
    port, procs = free_port(), []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", **host_env(f"rank{rank}"))
        log = open(d / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen([str(BUILD / "bin" / "tandem-train"),
                                        *args(model_dir, data, out_dir, controls, steps, device, transport)],
                                       env=env, stdout=log, stderr=subprocess.STDOUT), log))
    codes = [p.wait(timeout=600) for p, _ in procs]
    for _, log in procs:
        log.close()
    logs = [(d / f"rank{r}.log").read_text() for r in range(world)]
    assert codes == [0] * world, "\n".join(logs)
    return logs


def same_as_fresh(ckpt, served, tp, server_args=()):
    """A fresh server of tp shards from the checkpoint answers exactly as the synced one did."""
    with TandemServer(ckpt, "--tensor-parallel-size", tp, *server_args, start_timeout=300) as fresh:
        want = greedy(fresh.url)
    assert served == want, f"tensor-parallel size {tp}: synced {served} != fresh from {ckpt.name} {want}"


def run(d, gpu, transport="nccl"):
    """Servers {tp: server args}, 1 or 2 ranks, 3 steps over transport nccl; every server then equals a fresh one."""
    model_dir, data = d / "model", d / "train.jsonl"
    build_tiny_model(model_dir)
    write_dataset(data)
    if gpu:
        gpus = cuda_devices()
        if gpus < 1:
            skip("NCCL into a GPU server needs a CUDA device; none visible")
        plan = {1: ["--device", f"cuda:{gpus - 1}", "--kv-cache-memory", "256M"]}
        if gpus >= 2:
            plan[2] = ["--device", "cuda:0", "--kv-cache-memory", "256M"]
        world, device = 1, "cuda"
        said = "weight sync over NCCL" if transport == "nccl" else "weight sync over ZeroMQ"
    else:
        # The TP 2 server runs two engines of 2 shards (--devices): engine 0's shards receive, and each copies its
        # staging to the same shard of engine 1.
        plan, world, device, said = {2: ["--devices", "cpu,cpu"], 1: []}, 2, "cpu", \
            "weight sync over the host communicator"
    controls = {tp: f"tcp://127.0.0.1:{free_port()}" for tp in plan}
    with contextlib.ExitStack() as stack:
        servers = {tp: stack.enter_context(TandemServer(model_dir, "--control", controls[tp], "--tensor-parallel-size",
                                                        tp, *plan[tp], env=host_env(f"server{tp}"),
                                                        start_timeout=300))
                   for tp in plan}
        before = {tp: greedy(srv.url) for tp, srv in servers.items()}
        logs = run_ranks(d, model_dir, data, d / "run", list(controls.values()), 3, world, device, transport)
        assert said in logs[0], logs[0]
        assert "ZeroMQ from now on" not in logs[0] and "using transport zmq" not in logs[0], logs[0]
        rows = [json.loads(line) for line in (d / "run" / "metrics.jsonl").read_text().splitlines()]
        assert len(rows) == 3 and all(r["sync_bytes"] > 0 for r in rows), rows
        served = {tp: greedy(srv.url) for tp, srv in servers.items()}
        if not gpu:   # both engines of the two-engine server answer alike (requests go to the least loaded one)
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                assert all(a == served[2] for a in pool.map(lambda _: greedy(servers[2].url), range(4)))
        assert all(policy_version(srv.url) == 3 for srv in servers.values())
    for tp in plan:
        assert served[tp] != before[tp], f"the TP = {tp} server's answer did not change: the weights never arrived"
        same_as_fresh(d / "run" / "checkpoint-3", served[tp], tp, plan[tp])
    return rows, controls


def test_nccl_transport_into_shards(tmp_path):
    d = tmp_path
    model_dir, data = d / "model", d / "train.jsonl"
    _, controls = run(d, gpu=False)   # writes model_dir and data
    controls = [controls[2], controls[1]]

    # The TP = 2 server comes back with 4 shards at the same control endpoint: the next run's trainer learns the size
    # from its hello and cuts for 4 shards.
    with contextlib.ExitStack() as stack:
        tp4 = stack.enter_context(TandemServer(model_dir, "--control", controls[0], "--tensor-parallel-size", 4))
        tp1 = stack.enter_context(TandemServer(model_dir, "--control", controls[1]))
        run_ranks(d, model_dir, data, d / "run2", controls, steps=2)
        served = {4: greedy(tp4.url), 1: greedy(tp1.url)}
        assert policy_version(tp4.url) == 2
    for tp, got in served.items():
        same_as_fresh(d / "run2" / "checkpoint-2", got, tp)


def test_nccl_into_gpu_shards(tmp_path):
    run(tmp_path, gpu=True)


if __name__ == "__main__":
    if "--gpu" not in sys.argv:
        sys.exit("usage: test_weight_sync_shards.py --gpu   (TANDEM_BUILD_DIR: the build)")
    try:
        lines = []
        for transport in ("nccl", "zmq"):   # zmq: GPU ranks send their bf16 units as they are
            rows, controls = run(pathlib.Path(tempfile.mkdtemp(prefix=f"shards-{transport}-")), True, transport)
            lines.append(f"{transport} into servers of tensor-parallel sizes {sorted(controls)}, sync ms "
                         + " ".join(f"{r['sync_time'] * 1e3:.1f}" for r in rows))
        print(f"summary: PASS: {'; '.join(lines)}; each equal to fresh servers from the checkpoint")
    except Skip as e:
        print(f"summary: SKIP: {e}")
        sys.exit(77)
