"""Mixed pool on one host (issue #9): T trainer ranks (ZeRO-3 over NCCL, GPUs 0..T-1) + S rollout servers
(GPUs T..T+S-1) started by `tandem-train launch`, weights pushed to the servers over NCCL after every step.

    python3 bench/bench_pool_gpu.py [--build build-gpu.carry] [--configs 7+1,6+2] [--shape 1.5b] [--steps 20]
    python3 bench/bench_pool_gpu.py --configs 1+1 --shape 0.5b --steps 4      # smoke test on 2 GPUs
    python3 bench/bench_pool_gpu.py --configs 1+1 --server-gpu same [--lora-r 16]   # one GPU: trainer and server share it
    python3 bench/bench_pool_gpu.py --device-check                             # CPU dry run: 2 ranks + 1 server

Model: random bf16 Qwen2.5-shaped (tied, vocab 151936) built with transformers (benchlib.build_model), with
the small byte-level tokenizer of tests/e2e/server_fixtures.py (tiny: that file's 2-layer Llama, vocab 300).
Task: prompts ask for a number; reward = the built-in regex_format (search) on the decoded completion. Only 300
of the 151,936 ids decode to text with that tokenizer, so a random 0.5b/1.5b model writes a digit in about 2 % of
256-token completions: too rare to learn from in 20 steps. Their reward is therefore "the completion holds any
text at all" (pattern '.'; about 40 % at the start), tiny's is "holds a digit" ([0-9]).
GRPO: num_generations 8, --batch completions per rank (all ranks together: T * batch / 8 prompts per step),
--zero-stage 3, gradient checkpointing on, --weight-sync-transport nccl, --weight-sync-steps 1. With --lora-r R:
LoRA adapters of rank R on every projection instead (--use-peft, alpha 2R), the adapters alone pushed over NCCL.
Per step, from rank 0's metrics.jsonl: rollout s = rollout_time (generation as rank 0 waits for it), train s =
train_time (micro-steps + optimizer), sync s = sync_time (the push to every server), rollout tok/s = mean
completion length * completions of all ranks / rollout s, train tok/s = num_tokens (completion tokens trained on,
all ranks; the prompts' tokens are processed too but not counted) / train s, sync GB/s = sync_bytes (sent by all
ranks to all servers) / sync s. Medians leave step 1 out (it creates the NCCL communicators).
GPU memory: nvidia-smi sampled every second; peak per GPU minus what the GPU held just before the launch.
Beside sync GB/s: a torch copy of 1 GiB cuda:0 -> cuda:T (first server's GPU), one direction.
The launcher is stopped once the last metrics row is written (the final checkpoint would only cost time).
Exit 1 when a run fails or its reward does not rise (mean of the first 5 steps vs the last 5; needs >= 10 steps).
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

import torch

import benchlib
from benchlib import MemSampler, build_model, gpu_mem_mib, use_devlib
from server_fixtures import free_port

# Per shape: reward pattern, learning rate, max completion length. A random model's near-uniform policy moves only
# with large Adam steps: tiny's 2e-2 is scripts/gpu-grpo-check.py's; on a CPU proxy (Qwen2 width 384, 2 layers,
# vocab 151936) '.' rose from about 0.45 to 0.77 in 8 steps at 1e-2 and stayed flat at 4e-4, so the real widths
# (896, 1536) get about 1e-2 * 384 / width (Adam moves each layer's output in proportion to lr * width).
TASKS = {"tiny": ("[0-9]", 2e-2, 12), "0.5b": (".", 3e-3, 256), "1.5b": (".", 2e-3, 256), "7b": (".", 1e-3, 256),
         "14b": (".", 1e-3, 256)}
WORDS = ["the quick brown", "a lazy dog", "seven wizards", "numbers plus", "question answer", "think step"]


def expected_rank_bytes(model_dir, params, T, batch, tokens_per_seq, lora_r=0):
    """(total, text) per trainer rank (trainer/zero3.c, shared/model_train.c): 18 B/param / T (bf16 shard 2, fp32
    master 4, Adam 8, fp32 gradient 4); the gathered units' slots (embedding, final norm, 2 layers; bf16) and
    their fp32 gradient buffers; activations with checkpointing (bf16): the L + 1 layer inputs, one layer's
    activations and gradients, two logit chunks of at most 2^28 elements. With lora_r: the frozen base, the
    adapters' fp32 state and the same activations instead."""
    c = json.loads((model_dir / "config.json").read_text())
    C, I, L, V = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    QD = c["num_attention_heads"] * c.get("head_dim", C // c["num_attention_heads"])
    KVD = c["num_key_value_heads"] * c.get("head_dim", C // c["num_attention_heads"])
    layer = C * (QD + 2 * KVD) + QD * C + 3 * C * I + 2 * C
    slots = V * C + C * (1 if c.get("tie_word_embeddings") else V + 1) + 2 * layer
    state, gathered, grad_work = 18 * params / T, 2 * slots, 4 * slots * (1 + 1 / T)
    N = batch * tokens_per_seq
    chunk = 2 * min(1 << 28, N * V) * 2
    acts = 2 * N * ((L + 1) * C + (5 * C + 2 * KVD + 3 * I) + (3 * C + 2 * KVD + 3 * I) + 2 * C) + chunk
    if lora_r:   # frozen bf16 base (2 B/param, whole on a lone rank), fp32 adapters with Adam and gradient (16 B)
        adapter = lora_r * L * ((C + QD) + 2 * (C + KVD) + (QD + C) + 2 * (C + I) + (I + C))
        base, ad = 2 * params, 16 * adapter
        total = base + ad + acts
        text = (f"LoRA r {lora_r} (all-linear): frozen bf16 base 2 B x {params / 1e6:.1f}M = {base / 1e9:.3f} GB + "
                f"adapters 16 B x {adapter / 1e6:.2f}M = {ad / 1e9:.3f} GB + activations ({batch} x {tokens_per_seq} "
                f"tokens) {acts / 1e9:.3f} GB = {total / 1e9:.2f} GB (+ CUDA context, cuBLAS workspace, the "
                "adapter path's work buffers)")
        return total, text
    total = state + gathered + grad_work + acts
    text = (f"18 B x {params / 1e6:.1f}M params / {T} = {state / 1e9:.3f} GB + gathered units (embedding, final, "
            f"2 layers) {gathered / 1e9:.3f} GB + their fp32 gradient work {grad_work / 1e9:.3f} GB + activations "
            f"({batch} x {tokens_per_seq} tokens) {acts / 1e9:.3f} GB = {total / 1e9:.2f} GB (+ CUDA context, "
            "cuBLAS workspace)")
    return total, text


def print_step(n, r):
    print(f"  step {n}: reward {r['reward']:.3f}, step {r['step_time']:.2f} s (train {r['train_time']:.2f}, "
          f"sync {r['sync_time']:.3f})", flush=True)


def run_config(a, T, S, model_dir, data, work, regex, lr, comp_len):
    """Runs one T+S configuration; returns (metrics rows, launch log text, failure note or '', mem dict)."""
    cpu = a.device_check
    out, logs = work / f"run-{T}+{S}", work / f"logs-{T}+{S}"
    cmd = [str(a.build / "bin" / "tandem-train"), "launch", "--model", str(model_dir), "--ranks", str(T),
           "--servers", str(S), "--server-device", "cpu" if cpu else "cuda:0" if a.server_gpu == "same" else "cuda",
           "--master-port", str(free_port()),
           "--control-port", str(free_port(S)), "--log-dir", str(logs)]
    cmd += [f"--server-arg={x}" for x in a.server_arg]
    cmd += ["--", "--train-file", str(data), "--output-dir", str(out), "--rewards", "regex_format",
            "--format-regex", regex, "--format-regex-mode", "search", "--num-generations", "8",
            "--per-device-train-batch-size", str(a.batch), "--gradient-accumulation-steps", "1",
            "--max-completion-length", str(comp_len), "--max-prompt-length", "64", "--learning-rate", str(lr),
            "--max-steps", str(a.steps), "--logging-steps", "1", "--save-steps", "0", "--zero-stage", "3",
            "--gradient-checkpointing", "true", "--seed", "3", "--init-timeout", "600", "--comm-timeout", "600",
            "--rollout-timeout", "600", "--device", "cpu" if cpu else "cuda",
            "--weight-sync-transport", "zmq" if cpu or a.server_gpu == "same" else "nccl", "--weight-sync-steps", "1"]
    if a.lora_r:   # LoRA on the frozen base; lora_sync adapter: the adapters alone each step
        cmd += ["--use-peft", "--lora-r", str(a.lora_r), "--lora-alpha", str(2 * a.lora_r), "--lora-dropout", "0",
                "--lora-target-modules", "all-linear"]
    env = dict(os.environ)
    if cpu:  # several processes on a few cores
        env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    print("$ " + " ".join(cmd), flush=True)
    metrics, log_path = out / "metrics.jsonl", work / f"launch-{T}+{S}.log"
    rows, text, note, mem, stopped = benchlib.run_launch(cmd, env, metrics, a.steps, a.timeout, f"pool_{T}+{S}",
                                                         log_path, logs, print_step)
    want = "weight sync over ZeroMQ" if cpu or a.server_gpu == "same" else "weight sync over NCCL"
    if not note and want not in text:
        note = f"the trainer's start line lacks {want!r}" + benchlib.launch_log_tails(text, logs)
    print(f"{T}+{S}: {len(rows)} steps, {'stopped after the last step' if stopped else 'exited by itself'}",
          flush=True)
    return rows, text, note, mem


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def report(T, S, rows, batch, copy, mem, expect, zero_line, shape, cpu):
    """(table lines, summary text, reward verdict or '')."""
    n_comp = T * batch
    where = "all on the CPU" if cpu else f"ranks on GPU 0..{T - 1}, servers on GPU {T}..{T + S - 1}"
    lines = [f"== {T}+{S}: {T} trainer rank(s), {S} server(s), {where}, {shape}, {n_comp} completions per step",
             f"{'step':>4}{'reward':>8}{'mean len':>9}{'rollout s':>10}{'train s':>9}{'sync s':>8}{'step s':>8}"
             f"{'rollout tok/s':>14}{'train tok/s':>12}{'sync GB/s':>10}"]
    derived = any("rollout_time" not in r for r in rows)
    cols = []
    for i, r in enumerate(rows):
        ro = r["rollout_time"] if "rollout_time" in r else r["step_time"] - r["train_time"] - r["sync_time"]
        rtok = r["completions/mean_length"] * n_comp / ro if ro > 0 else float("nan")
        ttok = r["num_tokens"] / r["train_time"] if r["train_time"] > 0 else float("nan")
        sgb = r["sync_bytes"] / r["sync_time"] / 1e9 if r["sync_time"] > 0 else float("nan")
        c = (r["reward"], r["completions/mean_length"], ro, r["train_time"], r["sync_time"], r["step_time"], rtok,
             ttok, sgb)
        cols.append(c)
        lines.append(f"{i + 1:>4}{c[0]:>8.3f}{c[1]:>9.1f}{c[2]:>10.3f}{c[3]:>9.3f}{c[4]:>8.3f}{c[5]:>8.3f}"
                     f"{c[6]:>14.0f}{c[7]:>12.0f}{c[8]:>10.2f}")
    rest = cols[1:] if len(cols) > 2 else cols
    m = [med([c[k] for c in rest]) for k in range(9)]
    if cols:
        lines.append(f"{'med':>4}{m[0]:>8.3f}{m[1]:>9.1f}{m[2]:>10.3f}{m[3]:>9.3f}{m[4]:>8.3f}{m[5]:>8.3f}"
                     f"{m[6]:>14.0f}{m[7]:>12.0f}{m[8]:>10.2f}   (median of steps {'2' if len(cols) > 2 else '1'}.."
                     f"{len(cols)})")
    if derived:
        lines.append("rollout s = step_time - train_time - sync_time (rollout_time not logged)")
    lines.append("sync GB/s: sync_bytes (all ranks to all servers) / sync_time; torch copy " +
                 ("not measured (CPU)" if cpu else f"cuda:0 -> cuda:{T}, 1 GiB: {copy:.1f} GB/s"))
    lines.append("ZeRO-3 all-gather / reduce-scatter bus bandwidth: not measured by this script (the trainer "
                 "logs no figure for it)")
    if zero_line:
        lines.append(f"trainer's ZeRO memory line: {zero_line}")
    lines.append(f"expected per trainer rank: {expect}")
    if mem:
        lines.append("GPU memory peak (MiB, and above the GPU's use before the launch): " + ", ".join(
            f"GPU{g} {'trainer' if g < T else 'server' if g < T + S else 'idle'} {p} (+{d})"
            for g, (p, d) in mem.items()))
    else:
        lines.append("GPU memory: not measured (no nvidia-smi)")
    verdict = ""
    if len(rows) >= 10:
        first, last = sum(c[0] for c in cols[:5]) / 5, sum(c[0] for c in cols[-5:]) / 5
        lines.append(f"reward: first 5 steps {first:.3f}, last 5 {last:.3f}")
        if not last > first:
            verdict = f"reward did not rise ({first:.3f} -> {last:.3f})"
    else:
        lines.append(f"reward check skipped: {len(rows)} steps (needs 10)")
    tpeak = max((mem[g][0] for g in mem if g < T), default=0)
    summary = (f"{T}+{S}: step {m[5]:.2f} s = rollout {m[2]:.2f} + train {m[3]:.2f} + sync {m[4]:.3f} s; rollout "
               f"{m[6]:.0f} tok/s, train {m[7]:.0f} tok/s, sync {m[8]:.1f} GB/s" +
               ("" if cpu else f" (p2p copy {copy:.0f}), trainer GPU peak {tpeak / 1024:.1f} GiB"))
    return lines, summary, verdict


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build-gpu.carry")
    ap.add_argument("--trainers", type=int, default=7)
    ap.add_argument("--servers", type=int, default=1)
    ap.add_argument("--configs", default="", help="comma list of T+S, run in turn (overrides --trainers/--servers)")
    ap.add_argument("--shape", choices=[*benchlib.QWEN_SHAPES, "tiny"], default="1.5b")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=16, help="completions per rank per step (multiple of 8)")
    ap.add_argument("--lr", type=float, default=None, help="learning rate (default: per shape, see TASKS)")
    ap.add_argument("--regex", default=None, help="reward pattern (default: per shape, see the text above)")
    ap.add_argument("--server-arg", action="append", default=None,
                    help="tandem-serve argument, repeatable (default --gpu-memory-utilization=0.85 on GPUs)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per configuration")
    ap.add_argument("--lora-r", type=int, default=0,
                    help="train LoRA adapters of this rank on every projection (alpha 2r), pushed as adapters")
    ap.add_argument("--server-gpu", choices=["next", "same"], default="next",
                    help="next: servers on the GPUs after the trainers'; same: one server beside trainer rank 0 on "
                         "GPU 0 (one-GPU machines: weights over zmq, and trainer and server take turns on the GPU)")
    ap.add_argument("--device-check", action="store_true",
                    help="CPU dry run: --device cpu on both sides (zmq sync), 2 ranks + 1 server, tiny shape")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM still stops the launcher
    if a.device_check:
        a.configs, a.shape = "2+1", "tiny"
    configs = [tuple(map(int, c.split("+"))) for c in (a.configs or f"{a.trainers}+{a.servers}").split(",")]
    if a.batch % 8 or any(t < 1 or s < 1 for t, s in configs):
        ap.error("--batch must be a multiple of 8 (num_generations) and every config needs T >= 1, S >= 1")
    if a.server_gpu == "same" and any(t != 1 or s != 1 for t, s in configs):
        ap.error("--server-gpu same runs the 1+1 config only (one GPU for both)")
    if a.server_arg is None:
        a.server_arg = (["--kv-cache-memory=256M"] if a.device_check else
                        ["--gpu-memory-utilization=0.4"] if a.server_gpu == "same" else ["--gpu-memory-utilization=0.85"])
    regex, lr, comp_len = TASKS[a.shape]
    regex, lr = a.regex or regex, a.lr or lr
    a.build = pathlib.Path(a.build).resolve()
    if not (a.build / "bin" / "tandem-train").exists():
        sys.exit(f"{a.build / 'bin' / 'tandem-train'} not found (--build names the carried build folder)")
    use_devlib(a.build)
    if not a.device_check:
        need = 1 if a.server_gpu == "same" else max(t + s for t, s in configs)
        if torch.cuda.device_count() < need:
            sys.exit(f"need {need} GPUs for {a.configs or configs}, found {torch.cuda.device_count()}")
    results, ok = [], True
    t_start = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-pool-") as d:
        work = pathlib.Path(d)
        model_dir = work / "model"
        model_dir.mkdir()
        params = sum(build_model(model_dir, a.shape).values())
        data = work / "train.jsonl"
        prompts = [f"question {WORDS[i % len(WORDS)]} {i % 10}: answer a number" for i in range(512)]
        data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        prompt_len = max(len(tok.encode(p).ids) for p in prompts)
        print(f"{a.shape}: {params / 1e6:.1f}M params, reward regex_format {regex!r} (search), lr {lr}, "
              f"max completion {comp_len}, batch {a.batch} per rank", flush=True)
        for T, S in configs:
            copy = float("nan") if a.device_check or a.server_gpu == "same" else benchlib.p2p_copy_gbs(T)
            rows, log, note, mem = run_config(a, T, S, model_dir, data, work, regex, lr, comp_len)
            zero_line = next((ln.split("tandem-train: ", 1)[-1] for ln in log.splitlines() if "ZeRO-3 over" in ln), "")
            _, expect = expected_rank_bytes(model_dir, params, T, a.batch, prompt_len + comp_len, a.lora_r)
            lines, summary, verdict = report(T, S, rows, a.batch, copy, mem, expect, zero_line, a.shape,
                                            a.device_check)
            if note or verdict:
                ok = False
                lines.append(f"FAILED: {note or verdict}")
                summary += f" FAILED: {(note or verdict).splitlines()[0]}"
            results.append(summary)
            print("\n".join(lines), flush=True)
            if os.environ.get("OUT"):
                pathlib.Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
                (pathlib.Path(os.environ["OUT"]) / f"pool_{T}+{S}.txt").write_text("\n".join(lines) + "\n")
    dev = "CPU dry run" if a.device_check else f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}"
    print(f"summary: pool {'PASS' if ok else 'FAIL'} on {dev}, {a.shape}, {a.steps} steps, "
          f"{time.time() - t_start:.0f} s: " + "; ".join(results))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
