"""Asynchronous GRPO (issue 24): one trainer rank (GPU 0) and one rollout server (GPU 1) started by `tandem-train
launch`, GRPO with long-tailed completion lengths, run once per --staleness value (max_staleness, TRL's name; 0 =
synchronous rounds), so that the overlap of generation and training can be read against the synchronous run.

    python3 bench/bench_async_gpu.py --shape 1.5b --steps 20               # 2 GPUs: sync vs max_staleness 1, 2
    python3 bench/bench_async_gpu.py --shape 7b --staleness 0,1 --steps 10  # 7B: two calls, each under 10 minutes
    python3 bench/bench_async_gpu.py --shape 7b --staleness 0,2 --steps 10
    python3 bench/bench_async_gpu.py --shape 1.5b --steps 6 --server-gpu same   # 1 GPU: a smoke test, no overlap
    python3 bench/bench_async_gpu.py --dry-run-cpu                          # CPU dry run: tiny model, CPU backend
    ASYNC_ARGS="--shape 1.5b --steps 20" scripts/gpu-check.sh build-gpu.carry async   # from the carried build

Model: random bf16 Qwen2.5-shaped (tied, vocab 151936; benchlib.build_model) with the small byte-level tokenizer
of tests/e2e/server_fixtures.py, whose eos is <|im_end|>; --dry-run-cpu: that file's tiny 2-layer Llama (vocab 300).
Long-tailed lengths, on purpose: a random model's next token is close to uniform over its vocabulary, so left alone
it would almost never sample eos and every completion would run to --max-completion-length. Before the model is
saved, its eos row of the output embedding (tied: the input embedding's too, which no prompt uses) is scaled by a
factor chosen so that the mean completion length is --mean-length (default max_completion_length / 4). The factor
comes from 32 completions (of the first 32 prompts) that transformers samples from the random model at the run's
temperature (1, no top-k / top-p) with eos suppressed, to the cap: scaling the eos row changes the eos logit x_t
alone, so a completion of the scaled model follows the same distribution until it stops, and stops at token t with
probability sigmoid(a x_t - lse_t) (lse_t: log-sum-exp of the other logits). The expected length of each sampled
completion follows for any factor a; a is found by bisection on their mean. The tail is heavier than a geometric's:
a random model's hidden states persist along a completion, so some completions are unlikely to stop at any token (on
a CPU proxy, Qwen2 vocabulary, 0.5B width, 4 layers, cap 256, aimed at a mean of 64: 64 completions transformers
sampled from the scaled model had mean 72, median 48, 3 at the cap; the calibration expected 64, 36 and 2.0 %). The
expected median and fraction reaching the cap are printed at the start, the lengths the runs had (mean, max, clipped
ratio) per run; with 32 or 64 completions a round, most rounds have some that run to the cap, and a synchronous
round lasts as long as they do (the long tail). The servers generate with the weights' eos as with any model:
nothing is forced (no ignore_eos, no min_tokens, no stop ids).
The learning rate is 1e-6 by default: a step costs the same compute whatever the rate, and at this rate the bf16
weights the servers sample with barely move, so the completions, and with them the lengths, are nearly the same in
every run (the seeds follow the step a round trains at, whatever max_staleness) and the runs compare like with like.
Task: the prompts and reward of bench_pool_gpu.py (regex_format: any text, or a digit on the tiny model).
GRPO: num_generations 8, --batch completions a round (= steps_per_generation x --micro; 7B 32, else 64), --micro
completions a micro-step, gradient_accumulation_steps = batch / micro (one optimizer step a round, so a round
generated k rounds ahead is exactly k versions old and none is dropped), loss_type --loss-type (TRL's default dapo:
its micro-steps wait for the whole round; grpo lets those before the optimizer step start while the round streams
in), the importance sampling correction on (the default), weights pushed to the server after every step (NCCL; zmq
on the CPU and with --server-gpu same), gradient checkpointing on.

Per run, from rank 0's metrics.jsonl (docs/training.md), over the measured steps: those after the first --warmup
(NCCL communicators, CUDA graphs, the first round) and before the last max_staleness ones (with nothing left to
generate ahead, the server idles there):
  step s        median step_wall_time (record to record: every second of it is attributed to one phase)
  gen s         median rollout_time (a round's generation, sending to collected; overlapping training when ahead)
  train s       median trainer compute: old_logps_time + ref_logps_time + forward_backward_time + optimizer_time
  tok/s         trained tokens per second: growth of num_tokens (prompt + completion tokens of the completions trained
                on) over the measured steps' step_wall_time
  trainer busy  trainer_busy_fraction (model compute over wall time), weighted by step_wall_time
  rollout busy  rollout_busy_fraction (the server's engine step seconds over wall time), weighted likewise
  staleness     staleness/hist/<s> summed over every step; dropped: samples_dropped_stale summed
Where the time goes: the mean of each accounting field (refresh_time ... checkpoint_time, other_time) over the
measured steps; they add up to the mean step_wall_time. `other` is what no phase claims. Beside it, the issue's
remainder: step_time - rollout_time - train_time - sync_time (the "0.6 s nobody accounts for" of the synchronous 7B
run in issue 24), beside the phases it is made of.
Targets (issue 24), per run against the synchronous run (--staleness must include 0): the bottleneck pool (rollout
when the synchronous gen s >= its train s, else trainer) busy >= 90 %, and step s <= 1.1 x max(gen s, train s) of the
synchronous run. --server-gpu same: trainer and server share GPU 0, so neither pool's figure measures overlap (they
take turns on one GPU); the targets are printed but say so. --dry-run-cpu: likewise on 2 shared cores.
Each invocation must finish within a device call (10 minutes; the script prints each run's time, start-up
included): 7B as two calls, each with its own synchronous run (which also shows how much the synchronous figures
move between runs). --json writes every run's figures, and a later invocation without a synchronous run may take
that one's from --baseline.
Exit 1 when a run fails (the others are still reported); a missed target is a FAIL in the summary line.
"""
import argparse
import json
import os
import pathlib
import signal
import statistics
import sys
import tempfile
import time

import benchlib
from benchlib import build_model, use_devlib
from server_fixtures import free_port

WORDS = ["the quick brown", "a lazy dog", "seven wizards", "numbers plus", "question answer", "think step"]
# Per shape: reward pattern (as bench_pool_gpu.py), completions a round, completions a micro-step. The 7B trainer
# holds 18 B/param (~127 GB) on its one GPU, which leaves room for the activations of 4 x 1,090 tokens
# (bench_pool_gpu's expected_rank_bytes model); its rounds are 32 completions so that a run of 10 steps and its
# start fit in a few minutes (the synchronous 7B step trained 16 completions in 1.50 s).
SHAPES = {"tiny": ("[0-9]", 16, 8), "1.5b": (".", 64, 16), "7b": (".", 32, 4)}
PHASES = ["refresh_time", "generate_issue_time", "generate_wait_time", "rewards_phase_time", "old_logps_time",
          "ref_logps_time", "forward_backward_time", "optimizer_time", "weight_sync_phase_time", "log_time",
          "checkpoint_time", "other_time"]
# Of the phases above, what ran while the round was still coming in (streaming groups).
OVERLAP = ["reward_overlap_time", "logps_overlap_time", "train_overlap_time"]
COMPUTE = ["old_logps_time", "ref_logps_time", "forward_backward_time", "optimizer_time"]


def eos_scale(model, d, eos, mean_len, prompts, cap, n_seq=32):
    """The factor for the eos row of model's output embedding that makes the mean completion length (capped at
    cap) mean_len, from n_seq completions sampled with eos suppressed (module docstring). Returns (factor,
    {expected mean, median, fraction reaching the cap, mean length before})."""
    import torch
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    dev = next(model.parameters()).device
    ids = [tok.encode(p).ids for p in prompts[:n_seq]]   # distinct prompts: the runs go through many
    P = max(map(len, ids))
    x = torch.tensor([[0] * (P - len(i)) + i for i in ids], device=dev)   # left-padded
    att = (torch.arange(P, device=dev)[None] >= torch.tensor([P - len(i) for i in ids], device=dev)[:, None]).long()
    torch.manual_seed(1)
    with torch.no_grad():
        seq = model.generate(x, attention_mask=att, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, min_p=None,
                             max_new_tokens=cap, suppress_tokens=[eos], eos_token_id=None,
                             pad_token_id=0)
        att = torch.cat([att, torch.ones_like(seq[:, P:])], dim=1)
        h = model.model(seq, attention_mask=att, position_ids=(att.cumsum(1) - 1).clamp(min=0)).last_hidden_state
        W = model.get_output_embeddings().weight.float()
        xs, lses = [], []
        for b in range(len(ids)):   # position P - 1 + t predicts completion token t
            logits = h[b, P - 1:P - 1 + cap].float() @ W.t()
            xs.append(logits[:, eos].clone())
            logits[:, eos] = -torch.inf
            lses.append(torch.logsumexp(logits, dim=1))
    xe, lse = torch.stack(xs).double(), torch.stack(lses).double()   # (n_seq, cap)

    def lengths(a):
        """(P(length >= t) for t = 1..cap, per sequence; P(no eos before the cap), per sequence)"""
        stay = torch.cumprod(1 - torch.sigmoid(a * xe - lse), dim=1)
        return torch.cat([torch.ones_like(stay[:, :1]), stay[:, :-1]], dim=1), stay[:, -1]

    def mean_length(a):
        return lengths(a)[0].sum(1).mean().item()

    lo, hi = 0.0, 1.0
    while mean_length(hi) > mean_len:
        lo, hi = hi, hi * 2
        if hi > 1e6:
            raise SystemExit(f"no eos scale brings the mean completion length down to {mean_len:.0f} (at 1e6: "
                             f"{mean_length(hi):.0f}): raise --mean-length")
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_length(mid) > mean_len else (lo, mid)
    at_least, clipped = lengths(hi)
    cdf = 1 - at_least.mean(0)   # P(length < t), t = 1..cap, over the sequences
    median = int((cdf < 0.5).sum().item())
    return hi, {"mean": mean_length(hi), "median": median, "clipped": clipped.mean().item(),
                "before": mean_length(1.0)}


def launch_cmd(a, model_dir, data, out, logs, staleness):
    cpu, same = a.dry_run_cpu, a.server_gpu == "same"
    server_dev = "cpu" if cpu else "cuda:0" if same else "cuda:1"
    cmd = [str(a.build / "bin" / "tandem-train"), "launch", "--model", str(model_dir), "--ranks", "1",
           "--servers", "1", "--server-device", server_dev, "--master-port", str(free_port()),
           "--control-port", str(free_port()), "--log-dir", str(logs)]
    if cpu or same:
        cmd += ["--control-insecure"]   # weights over zmq without CURVE's encryption (about 10x the bandwidth)
    cmd += [f"--server-arg={x}" for x in a.server_arg]
    cmd += ["--", "--train-file", str(data), "--output-dir", str(out), "--rewards", "regex_format",
            "--format-regex", a.regex, "--format-regex-mode", "search", "--num-generations", "8",
            "--per-device-train-batch-size", str(a.micro), "--gradient-accumulation-steps", str(a.batch // a.micro),
            "--max-completion-length", str(a.max_completion_length), "--max-prompt-length", "64",
            "--temperature", "1", "--learning-rate", str(a.lr), "--loss-type", a.loss_type,
            "--max-staleness", str(staleness), "--max-steps", str(a.steps), "--logging-steps", "1",
            "--save-steps", "0", "--zero-stage", "3", "--gradient-checkpointing", "true", "--seed", "3",
            "--init-timeout", "600", "--comm-timeout", "600", "--rollout-timeout", "600",
            "--device", "cpu" if cpu else "cuda", "--weight-sync-transport", "zmq" if cpu or same else "nccl",
            "--weight-sync-steps", "1"]
    return cmd


def show_step(n, r):
    print(f"  step {n}: {r.get('step_wall_time', float('nan')):.2f} s (gen {r.get('rollout_time', float('nan')):.2f}, "
          f"wait {r.get('generate_wait_time', float('nan')):.2f}, fwd/bwd {r.get('forward_backward_time', 0):.2f}), "
          f"mean length {r.get('completions/mean_length', 0):.0f}, max {r.get('completions/max_length', 0):.0f}, "
          f"staleness {r.get('staleness/mean', 0):.2f}", flush=True)


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def analyse(rows, k, warmup):
    """Figures of one run (module docstring); None when no step is left to measure."""
    m = rows[warmup:len(rows) - k]
    if not m:
        return None
    wall = sum(r["step_wall_time"] for r in m)
    prev = rows[warmup - 1]["num_tokens"] if warmup > 0 else 0
    bins = sorted({int(key.rsplit("/", 1)[1]) for r in rows for key in r if key.startswith("staleness/hist/")})
    f = {"steps": f"{warmup + 1}..{len(rows) - k}", "n": len(m),
         "step": med([r["step_wall_time"] for r in m]), "step_time": med([r["step_time"] for r in m]),
         "gen": med([r["rollout_time"] for r in m]), "train": med([sum(r[p] for p in COMPUTE) for r in m]),
         "train_time": med([r["train_time"] for r in m]), "sync": med([r["sync_time"] for r in m]),
         "tok_s": (m[-1]["num_tokens"] - prev) / wall if wall > 0 else float("nan"),
         "trainer_busy": sum(r["trainer_busy_fraction"] * r["step_wall_time"] for r in m) / wall,
         "hist": {b: sum(r.get(f"staleness/hist/{b}", 0) for r in rows) for b in bins},
         "dropped": sum(r.get("samples_dropped_stale", 0) for r in rows),
         "mean_len": statistics.mean(r["completions/mean_length"] for r in rows),
         "max_len": max(r["completions/max_length"] for r in rows),
         "clipped": statistics.mean(r["completions/clipped_ratio"] for r in rows),
         "phases": {p: statistics.mean(r.get(p, 0.0) for r in m) for p in PHASES},
         "overlap": {p: statistics.mean(r.get(p, 0.0) for r in m) for p in OVERLAP},
         "wall_mean": wall / len(m),
         "remainder": statistics.mean(r["step_time"] - r["rollout_time"] - r["train_time"] - r["sync_time"]
                                      for r in m)}
    busy = [r for r in m if "rollout_busy_fraction" in r]
    bw = sum(r["step_wall_time"] for r in busy)
    f["rollout_busy"] = sum(r["rollout_busy_fraction"] * r["step_wall_time"] for r in busy) / bw if bw else float("nan")
    return f


def phase_lines(k, f):
    """Where the step time goes, one run."""
    ph, short = f["phases"], lambda p: p.replace("_time", "").replace("_phase", "")
    lines = [f"-- max_staleness {k}: where a step's {f['wall_mean']:.3f} s go (means of steps {f['steps']}; rank 0)",
             "   " + ", ".join(f"{short(p)} {ph[p]:.3f}" for p in PHASES),
             f"   sum of the phases {sum(ph.values()):.3f} s; unattributed (other) {ph['other_time']:.3f} s; the "
             f"trainer idles waiting for generation {ph['generate_wait_time']:.3f} s"]
    lines.append("   of those, run while the round was still coming in: " +
                 ", ".join(f"{short(p)} {f['overlap'][p]:.3f}" for p in OVERLAP))
    if k == 0:
        # The remainder. A synchronous round's rollout_time covers issuing, waiting and what ran while it
        # streamed in; train_time the micro-steps and optimizer steps; what is left is refresh, the rewards,
        # logprobs and log work after the round is in (less the micro-steps counted in both, train_overlap).
        rest = ["refresh_time", "rewards_phase_time", "old_logps_time", "ref_logps_time", "log_time",
                "checkpoint_time", "other_time"]
        lines.append(f"   issue-24 remainder step_time - rollout_time - train_time - sync_time = {f['remainder']:.3f} "
                     f"s (mean; medians: step_time {f['step_time']:.3f}, rollout {f['gen']:.3f}, train "
                     f"{f['train_time']:.3f}, sync {f['sync']:.3f}); candidates: " +
                     ", ".join(f"{short(p)} {ph[p]:.3f}" for p in rest))
    else:
        lines.append("   (no issue-24 remainder: rollout_time overlaps training when rounds go ahead)")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build-gpu.carry")
    ap.add_argument("--shape", choices=["1.5b", "7b"], default="1.5b")
    ap.add_argument("--staleness", default="0,1,2", help="max_staleness values, one run each (0 = synchronous)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (= rounds) per run (default 20; dry "
                    "run 7)")
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of the figures")
    ap.add_argument("--batch", type=int, default=None, help="completions per round (multiple of 8 and of --micro; "
                    "default per shape: 1.5b 64, 7b 32, dry run 16)")
    ap.add_argument("--micro", type=int, default=None, help="completions per micro-step (default per shape: 1.5b 16, "
                    "7b 4, dry run 8)")
    ap.add_argument("--max-completion-length", type=int, default=None, help="default 1024 (dry run 48)")
    ap.add_argument("--mean-length", type=float, default=None,
                    help="mean completion length (capped) the eos scaling aims at (default max completion length / 4)")
    ap.add_argument("--lr", type=float, default=1e-6, help="learning rate (see the text above)")
    ap.add_argument("--loss-type", default="dapo", help="tandem-train --loss-type (TRL's default dapo)")
    ap.add_argument("--server-gpu", choices=["other", "same"], default="other",
                    help="other: the server on GPU 1; same: on GPU 0 beside the trainer (1-GPU smoke test)")
    ap.add_argument("--server-arg", action="append", default=None,
                    help="tandem-serve argument, repeatable (default --gpu-memory-utilization=0.85, with --server-gpu "
                         "same 0.5; dry run --kv-cache-memory=256M)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per run")
    ap.add_argument("--json", default=None, help="write every run's figures here (default $OUT/async_SHAPE.json when "
                    "OUT is set), to give a later invocation as --baseline")
    ap.add_argument("--baseline", default=None, help="the synchronous run's figures from an earlier invocation's "
                    "--json (same shape, batch, micro and lengths), for the targets when --staleness lacks 0")
    ap.add_argument("--dry-run-cpu", action="store_true",
                    help="the same runs with the tiny test model, trainer and server on the CPU backend (zmq), short")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM still stops the launcher
    cpu = a.dry_run_cpu
    shape = "tiny" if cpu else a.shape
    a.regex, batch, micro = SHAPES[shape]
    a.micro = a.micro or micro
    a.batch = a.batch or batch
    a.steps = a.steps or (7 if cpu else 20)
    a.max_completion_length = a.max_completion_length or (48 if cpu else 1024)
    a.mean_length = a.mean_length or a.max_completion_length / 4
    try:
        stalenesses = [int(x) for x in a.staleness.split(",")]
    except ValueError:
        ap.error(f"--staleness {a.staleness!r}: expected a comma list of integers >= 0, e.g. 0,1,2")
    if any(k < 0 for k in stalenesses):
        ap.error("--staleness: every value must be >= 0")
    if a.batch % 8 or a.batch % a.micro:
        ap.error(f"--batch {a.batch} must be a multiple of 8 (num_generations) and of --micro {a.micro}")
    if a.steps < a.warmup + max(stalenesses) + 1:
        ap.error(f"--steps {a.steps} leaves no step to measure: it must be at least --warmup ({a.warmup}) + the "
                 f"largest --staleness ({max(stalenesses)}) + 1")
    if not 1 <= a.mean_length:
        ap.error("--mean-length must be >= 1")
    same = a.server_gpu == "same" and not cpu
    if same and shape == "7b":
        ap.error("--server-gpu same with --shape 7b: the 7B trainer's state alone (18 B/param, ~127 GB) leaves no room "
                 "for a server on its GPU; use --shape 1.5b for the 1-GPU smoke test")
    if a.server_arg is None:
        a.server_arg = (["--kv-cache-memory=256M"] if cpu else
                        [f"--gpu-memory-utilization={0.5 if same else 0.85}"])
    base_run = None
    if a.baseline and 0 in stalenesses:
        ap.error("--baseline stands in for the synchronous run: drop it, or drop 0 from --staleness")
    if a.baseline:
        try:
            saved = json.loads(pathlib.Path(a.baseline).read_text())
            base_run, got = saved["runs"]["0"], saved["setup"]
        except (OSError, ValueError, KeyError) as e:
            sys.exit(f"--baseline {a.baseline}: no synchronous run's figures there ({e!r}); give the --json file of "
                     "an invocation whose --staleness included 0")
        want = {"shape": shape, "batch": a.batch, "micro": a.micro, "max_completion_length": a.max_completion_length,
                "mean_length": a.mean_length, "loss_type": a.loss_type, "server_gpu": a.server_gpu}
        diff = {k: (got.get(k), v) for k, v in want.items() if got.get(k) != v}
        if diff:
            sys.exit(f"--baseline {a.baseline} was measured with other settings (baseline, now): {diff}; run the "
                     "synchronous run with the same options")
    a.build = pathlib.Path(a.build).resolve()
    if not (a.build / "bin" / "tandem-train").exists():
        sys.exit(f"{a.build / 'bin' / 'tandem-train'} not found: --build names a CPU build or an unpacked GPU carry "
                 "(scripts/gpu-check.sh BUILD async unpacks BUILD/carry.tar.xz and runs this script with $ASYNC_ARGS)")
    use_devlib(a.build)
    if not cpu:
        import torch
        need = 1 if same else 2
        if torch.cuda.device_count() < need:
            sys.exit(f"need {need} GPU(s) (trainer on GPU 0, server on GPU {0 if same else 1}), found "
                     f"{torch.cuda.device_count()}; --server-gpu same runs on one, --dry-run-cpu on none")
    caveat = ("CPU dry run: trainer and server share 2 cores, busy fractions and overlap mean nothing here" if cpu
              else "--server-gpu same: trainer and server share GPU 0, so the overlap and the targets mean nothing"
              if same else "")
    t_start = time.time()
    results, failures = {}, []
    with tempfile.TemporaryDirectory(prefix="bench-async-") as d:
        work = pathlib.Path(d)
        model_dir = work / "model"
        model_dir.mkdir()
        prompts = [f"question {WORDS[i % len(WORDS)]} {i % 10}: answer a number" for i in range(512)]
        data = work / "train.jsonl"
        data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        scaled = {}

        def edit(model, md):
            from server_fixtures import EOS_TOKEN
            from tokenizers import Tokenizer
            eos = Tokenizer.from_file(str(md / "tokenizer.json")).token_to_id(EOS_TOKEN)
            factor, expect = eos_scale(model, md, eos, a.mean_length, prompts, a.max_completion_length)
            with __import__("torch").no_grad():
                model.get_output_embeddings().weight[eos] *= factor
            scaled.update(expect, eos=eos, factor=factor)

        params = sum(build_model(model_dir, shape, edit).values())
        cap = a.max_completion_length
        print(f"{shape}: {params / 1e6:.1f}M params; eos (id {scaled['eos']}) row scaled x{scaled['factor']:.2f}: "
              f"expected completion length (cap {cap}) mean {scaled['mean']:.0f} (unscaled {scaled['before']:.0f}), "
              f"median {scaled['median']}, {scaled['clipped'] * 100:.1f} % reaching the cap; {a.batch} completions "
              f"a round ({a.batch // 8} prompts x 8), micro-batch {a.micro}, {a.batch // a.micro} micro-steps, loss "
              f"{a.loss_type}, lr {a.lr}", flush=True)
        if caveat:
            print(f"NOTE: {caveat}", flush=True)
        for k in stalenesses:
            out, logs = work / f"run-s{k}", work / f"logs-s{k}"
            cmd = launch_cmd(a, model_dir, data, out, logs, k)
            env = dict(os.environ)
            if cpu:  # two processes on a few cores
                env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
            print(f"== max_staleness {k}\n$ " + " ".join(cmd), flush=True)
            t0 = time.time()
            try:
                rows, text, note, mem, _ = benchlib.run_launch(cmd, env, out / "metrics.jsonl", a.steps, a.timeout,
                                                              f"async_s{k}", work / f"launch-s{k}.log", logs, show_step)
            except SystemExit:   # SIGTERM (a timeout around this script): the launcher is stopped; report the rest
                failures.append(f"max_staleness {k}: interrupted by SIGTERM after {time.time() - t0:.0f} s; the runs "
                                "after it were not started")
                break
            want = "weight sync over ZeroMQ" if cpu or same else "weight sync over NCCL"
            if not note and want not in text:
                note = f"the trainer's start line lacks {want!r}" + benchlib.launch_log_tails(text, logs)
            print(f"max_staleness {k}: {len(rows)} steps in {time.time() - t0:.0f} s (start-up included)"
                  + ("; GPU memory peak MiB (above before the launch): " + ", ".join(
                      f"GPU{g} {p} (+{dp})" for g, (p, dp) in mem.items()) if mem else ""), flush=True)
            if note:
                failures.append(f"max_staleness {k}: {note.splitlines()[0]}")
                print(f"FAILED: {note}", flush=True)
                continue
            f = analyse(rows, k, a.warmup)
            if f is None:
                failures.append(f"max_staleness {k}: no step left to measure")
                continue
            results[k] = f
    setup = {"shape": shape, "batch": a.batch, "micro": a.micro, "max_completion_length": a.max_completion_length,
             "mean_length": a.mean_length, "loss_type": a.loss_type, "server_gpu": a.server_gpu, "lr": a.lr}
    json_path = a.json or (pathlib.Path(os.environ["OUT"]) / f"async_{shape}.json" if os.environ.get("OUT") else None)
    if json_path:
        pathlib.Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(json_path).write_text(json.dumps({"setup": setup, "runs": results}, indent=1))
    if 0 not in results and base_run:
        results[0] = dict(base_run, from_file=True)
    print_report(a, shape, results, failures, caveat, time.time() - t_start)
    sys.exit(1 if failures else 0)


def print_report(a, shape, results, failures, caveat, elapsed):
    base = results.get(0)
    lines = [ln for k, f in sorted(results.items()) if not f.get("from_file") for ln in phase_lines(k, f)]
    lines += [f"== async GRPO, {shape}, 1 trainer rank + 1 server ("
             + ("both on the CPU" if a.dry_run_cpu else "both on GPU 0" if a.server_gpu == "same" else
                "GPU 0 + GPU 1") + f"), {a.batch} completions a round, lengths capped at {a.max_completion_length}",
             f"{'stale':>5}{'steps':>7}{'step s':>8}{'gen s':>7}{'train s':>8}{'tok/s':>9}{'trainer':>8}{'rollout':>8}"
             f"{'len mean':>9}{'max':>6}{'clip %':>7}{'dropped':>8}  staleness hist"]
    for k, f in sorted(results.items()):
        hist = " ".join(f"{b}:{n}" for b, n in f["hist"].items())
        name = f"{k}*" if f.get("from_file") else str(k)
        lines.append(f"{name:>5}{f['steps']:>7}{f['step']:>8.3f}{f['gen']:>7.3f}{f['train']:>8.3f}{f['tok_s']:>9.0f}"
                     f"{f['trainer_busy'] * 100:>7.1f}%{f['rollout_busy'] * 100:>7.1f}%{f['mean_len']:>9.1f}"
                     f"{f['max_len']:>6.0f}{f['clipped'] * 100:>7.1f}{f['dropped']:>8.0f}  {hist}")
    if base is not None and base.get("from_file"):
        lines.append(f"0*: the synchronous run of --baseline {a.baseline}")
    lines.append("step s / gen s / train s: medians (train = old/ref logprobs + forward/backward + optimizer); "
                 "trainer / rollout: busy fractions over the measured steps; len: every step")
    verdicts = []
    if base is None:
        lines.append("targets: not computed (no synchronous run: --staleness must include 0)")
    else:
        pool = "rollout" if base["gen"] >= base["train"] else "trainer"
        bound = 1.1 * max(base["gen"], base["train"])
        lines.append(f"targets (issue 24), against the synchronous run: bottleneck pool = {pool} (sync gen "
                     f"{base['gen']:.3f} s vs train {base['train']:.3f} s): busy >= 90 %; step <= 1.1 x "
                     f"{max(base['gen'], base['train']):.3f} = {bound:.3f} s")
        for k, f in sorted(results.items()):
            busy = f[f"{pool}_busy"]
            ok_busy, ok_step = busy >= 0.9, f["step"] <= bound
            lines.append(f"  max_staleness {k}: {pool} busy {busy * 100:.1f} % {'PASS' if ok_busy else 'FAIL'}; "
                         f"step {f['step']:.3f} s {'PASS' if ok_step else 'FAIL'}")
            verdicts.append(f"s{k} busy {'PASS' if ok_busy else 'FAIL'} ({busy * 100:.0f}% {pool}), step "
                            f"{'PASS' if ok_step else 'FAIL'} ({f['step']:.2f}/{bound:.2f} s)")
    if caveat:
        lines.append(f"NOTE: {caveat}")
    for fl in failures:
        lines.append(f"FAILED: {fl}")
    print("\n".join(lines), flush=True)
    if os.environ.get("OUT"):
        pathlib.Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (pathlib.Path(os.environ["OUT"]) / f"async_{shape}.txt").write_text("\n".join(lines) + "\n")
    where = "CPU dry run" if a.dry_run_cpu else "1 GPU (server beside the trainer)" if a.server_gpu == "same" else ""
    if not where:
        import torch
        where = f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}"
    print(f"summary: async GRPO {'FAIL' if failures else 'ran'} on {where}, {shape}, {a.steps} steps a run, "
          f"{elapsed:.0f} s: " + ("; ".join(verdicts) or "no targets") +
          (f"; {len(failures)} run(s) failed" if failures else "") + (" (targets meaningless here)" if caveat else ""))


if __name__ == "__main__":
    main()
