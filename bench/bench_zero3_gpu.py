"""ZeRO-3 on 1..R GPUs: does the communication hide behind compute? SFT steps of a fixed size, three runs.

    python3 bench/bench_zero3_gpu.py --build build-gpu.carry [--ranks R] [--shape 1.5b|0.5b] [--steps 8]
                                     [--batch 2] [--seq-len 1024] [--grad-accum 1] [--no-checkpointing]
    python3 bench/bench_zero3_gpu.py --dry-run-cpu      # tiny model, CPU backend, 2 ranks (checks this script)

Model: random bf16 Qwen2.5-shaped (tied, vocab 151936) built with transformers (benchlib.build_model), with the
byte-level tokenizer of tests/e2e/server_fixtures.py (dry run: that file's 2-layer Llama, vocab 300, fp32 on CPU).
Data: prompt/completion rows of exactly --seq-len tokens (--prompt-len of prompt; the completion ends with the EOS
text), counted with that tokenizer, so every step has the same size on every rank.
Runs, each `tandem-train launch --ranks N --servers 0 -- --mode sft --zero-stage 3`, --batch sequences per rank
per micro-step, --grad-accum micro-steps per optimizer step, gradient checkpointing on unless --no-checkpointing:
  1 rank; R ranks (overlap on: trainer/zero3.c prefetches unit k+1's all-gather during unit k's compute, and
  finishes each gradient reduce-scatter lazily while the next unit's backward runs); R ranks with
  --overlap-comm false (no prefetch, each reduce-scatter finished at once: communication serialised).
Step s: median step_time (metrics.jsonl, rank 0: the micro-steps and the optimizer step) of steps 3..N.
tok/s per GPU: tokens processed per rank per step (batch x grad_accum x seq_len, prompt tokens included) / step s.
Scaling: per-GPU tok/s over the 1-rank run's. The launcher is stopped once the last metrics row is written (the
final checkpoint would only cost time).

Communication per step and rank, counted from trainer/zero3.c and shared/model_train.c (stage 3, R > 1):
  all-gathers (storage dtype, bf16 on CUDA): a unit stays gathered in its slot until evicted or the optimizer step.
  The embedding (also the tied lm_head) and the final unit have a slot each: gathered once per step. Layers share 2
  slots: forward gathers all L; backward finds L-1 and L-2 still there and gathers L-2 layers; each further
  micro-step's forward finds layers 0 and 1 there (gathers L-2) and its backward L-2 again. Gradient checkpointing
  does not change this: the recompute runs inside the backward's own acquire of the layer. Overlap on or off
  gathers the same units.
    gathered elements = embed + final + layer x (L + (2 x grad_accum - 1) x (L - 2))
  reduce-scatters (fp32): every unit's gradient once per backward, i.e. grad_accum x all units.
  (Plus a few scalars: the gradient norm's all-reduce; tokens and loss over the host communicator.)
  Units are padded to a multiple of 64 x R elements (shared/layout.c), as here. These counts were checked by
  counting comm_all_gather / comm_reduce_scatter calls under gdb (CPU, 2 ranks, a 5-layer model, grad_accum 1
  and 2, overlap on and off): 10 + 7 and 16 + 14 calls per step, the element sums this script computes.
  Qwen2.5-1.5B shape, 2 ranks, grad_accum 1: 5.52 GB gathered (bf16) + 6.17 GB reduce-scattered (fp32) per rank
  and step, 5.85 GB of bus traffic.
Bus bytes (NCCL's convention for both collectives): (R - 1) / R x the full buffer's bytes. Bandwidths:
  bus GB/s serialised = bus bytes / (step s overlap off - step s 1 rank): the rate the collectives reached when
    nothing hid them (the difference also holds the gradient buffers' memsets and adds, which one rank skips);
  hidden = (off - on) / (off - 1 rank): the share of that communication time that overlap takes off the step.
"""
import argparse
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile

import torch

import benchlib
from benchlib import LAYOUT_ALIGN, build_model, server_fixtures, unit_numels, use_devlib, write_data
from server_fixtures import free_port

def comm_per_step(units, ranks, grad_accum, elem_bytes):
    """(all-gather bytes, reduce-scatter bytes) of full buffers per rank per optimizer step (docstring)."""
    q = ranks * LAYOUT_ALIGN
    padded = [(u + q - 1) // q * q for u in units]
    n_layers = len(units) - 2
    layer_gathers = n_layers + (2 * grad_accum - 1) * max(n_layers - 2, 0)
    gathered = padded[0] + padded[-1] + layer_gathers * padded[1]  # every layer unit has the same size
    return gathered * elem_bytes, grad_accum * sum(padded) * 4


def print_step(n, r):
    print(f"  step {n}: {r['step_time']:.3f} s, loss {r['loss']:.3f}", flush=True)


def run(a, ranks, overlap, model_dir, data, work, cpu):
    """One launch; returns (metrics rows, launch log text, failure note or '')."""
    tag = f"{ranks}r-{'on' if overlap else 'off'}"
    out, logs = work / f"run-{tag}", work / f"logs-{tag}"
    cmd = [str(a.build / "bin" / "tandem-train"), "launch", "--model", str(model_dir), "--ranks", str(ranks),
           "--servers", "0", "--master-port", str(free_port()), "--log-dir", str(logs), "--",
           "--mode", "sft", "--train-file", str(data), "--output-dir", str(out), "--max-prompt-length", "0",
           "--per-device-train-batch-size", str(a.batch), "--gradient-accumulation-steps", str(a.grad_accum),
           "--gradient-checkpointing", "false" if a.no_checkpointing else "true", "--zero-stage", "3",
           "--learning-rate", "1e-5", "--max-steps", str(a.steps), "--logging-steps", "1", "--save-steps", "0",
           "--seed", "3", "--init-timeout", "600", "--comm-timeout", "600", "--device", "cpu" if cpu else "cuda",
           "--overlap-comm", "true" if overlap else "false"]
    env = dict(os.environ)
    if cpu:  # several processes on a few cores
        env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    print(f"== {tag}: " + " ".join(cmd), flush=True)
    metrics, log_path = out / "metrics.jsonl", work / f"launch-{tag}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _, note = benchlib.follow_metrics(proc, metrics, a.steps, a.timeout, print_step)
        finally:
            benchlib.stop(proc, 60)  # SIGTERM: the launcher stops its ranks
    text = log_path.read_text(errors="replace")
    # The rank-0 log says whether the option took and which collectives ran.
    said_off = "overlap_comm false" in text
    if not note and said_off == overlap:
        note = f"rank 0's log {'lacks' if not overlap else 'has'} the overlap_comm false line"
    want = "ZeRO collectives over " + ("nothing (one rank)" if ranks == 1 else "ZeroMQ" if cpu else "NCCL")
    if not note and want not in text:
        note = f"rank 0's log lacks {want!r}"
    if note:
        note += benchlib.launch_log_tails(text, logs)
    benchlib.keep_launch_logs(f"zero3_{tag}", log_path, logs)  # the launcher's and ranks' logs beside the table
    return benchlib.read_metrics(metrics), text, note


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build-gpu.carry")
    ap.add_argument("--ranks", type=int, default=0, help="R; default: the visible GPUs (2 in the dry run)")
    ap.add_argument("--shape", choices=[*benchlib.QWEN_SHAPES, "tiny"], default="1.5b")
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps per run (the median leaves out 1-2)")
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank per micro-step")
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    ap.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence, prompt + completion")
    ap.add_argument("--prompt-len", type=int, default=256, help="of which the prompt (no loss on these)")
    ap.add_argument("--no-checkpointing", action="store_true", help="keep activations (default: recompute)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per run")
    ap.add_argument("--dry-run-cpu", action="store_true",
                    help="tiny model, --device cpu, 2 ranks over ZeroMQ: checks this script without GPUs")
    a = ap.parse_args()
    cpu = a.dry_run_cpu
    a.build = pathlib.Path(a.build).resolve()
    if not (a.build / "bin" / "tandem-train").exists():
        raise SystemExit(f"{a.build / 'bin' / 'tandem-train'} is not there (--build)")
    if a.steps < 4:
        raise SystemExit("--steps must be >= 4: the median is over steps 3..N")
    if not 0 < a.prompt_len < a.seq_len - 2:
        raise SystemExit("--prompt-len must be in 1 .. --seq-len - 3")
    use_devlib(a.build)
    R = a.ranks or (2 if cpu else torch.cuda.device_count())
    if R < 2:
        raise SystemExit(f"needs at least 2 ranks (got {R}; visible GPUs: "
                         f"{0 if cpu else torch.cuda.device_count()})")
    if not cpu and torch.cuda.device_count() < R:
        raise SystemExit(f"--ranks {R} but {torch.cuda.device_count()} GPUs are visible")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM still stops the launcher
    shape = "tiny" if cpu else a.shape
    runs, ok = [], True
    with tempfile.TemporaryDirectory() as d:
        d = pathlib.Path(d)
        model_dir = d / "model"
        model_dir.mkdir()
        numels = build_model(model_dir, shape)
        cfg = json.loads((model_dir / "config.json").read_text())
        units = unit_numels(numels, cfg["num_hidden_layers"])
        data = d / "train.jsonl"
        n_rows = R * a.batch * a.grad_accum * (a.steps + 1)
        write_data(data, model_dir / "tokenizer.json", server_fixtures.EOS_TOKEN, n_rows, a.seq_len, a.prompt_len)
        for ranks, overlap in ((1, True), (R, True), (R, False)):
            rows, _, note = run(a, ranks, overlap, model_dir, data, d, cpu)
            note = note or benchlib.check_sft_rows(rows, a.steps, ranks * a.batch * a.grad_accum * a.seq_len)
            if note:
                ok = False
                print(f"{ranks} rank(s), overlap {'on' if overlap else 'off'}: FAILED: {note}", flush=True)
                continue
            step = statistics.median(r["step_time"] for r in rows[2:])
            runs.append((ranks, overlap, step, [r["step_time"] for r in rows]))

    tokens = a.batch * a.grad_accum * a.seq_len  # per rank per step
    elem = 4 if cpu else 2
    params = sum(numels.values())
    dev = "CPU backend (dry run)" if cpu else f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}"
    print()
    print(f"{dev}; {'tiny test model' if cpu else 'Qwen2.5-' + a.shape.upper() + ' shape'} ({params / 1e6:.1f} M "
          f"params, {len(units) - 2} layers, {'fp32' if cpu else 'bf16'}); SFT, ZeRO-3, {a.batch} x {a.seq_len} "
          f"tokens per rank per micro-step, {a.grad_accum} micro-step(s), gradient checkpointing "
          f"{'off' if a.no_checkpointing else 'on'}; torch={torch.__version__}")
    one = next((s for r, _, s, _ in runs if r == 1), None)
    by = {(r, o): s for r, o, s, _ in runs}
    ag, rs = comm_per_step(units, R, a.grad_accum, elem)
    bus = (R - 1) / R * (ag + rs)
    print(f"{'ranks':>5} {'overlap':>7} {'step s':>8} {'tok/s/GPU':>10} {'scaling':>8} {'AG MB/step':>11} "
          f"{'RS MB/step':>11} {'bus MB/step':>12} {'bus GB/s over step':>19}  steps (s)")
    for ranks, overlap, step, all_steps in runs:
        tps = tokens / step
        eff = f"{tps / (tokens / one):.1%}" if one else "n/a"
        if ranks == 1:
            comm = f"{'-':>11} {'-':>11} {'-':>12} {'-':>19}"
        else:
            comm = f"{ag / 1e6:>11.1f} {rs / 1e6:>11.1f} {bus / 1e6:>12.1f} {bus / step / 1e9:>19.2f}"
        print(f"{ranks:>5} {'on' if overlap else 'off':>7} {step:>8.4f} {tps:>10.0f} {eff:>8} {comm}  "
              + " ".join(f"{s:.3f}" for s in all_steps), flush=True)
    n_layers = len(units) - 2
    n_ag = 2 + n_layers + (2 * a.grad_accum - 1) * max(n_layers - 2, 0)
    print(f"per rank and step ({R} ranks): {n_ag} all-gathers = embedding + final + {n_layers} + "
          f"{2 * a.grad_accum - 1} x {max(n_layers - 2, 0)} layers ({'fp32' if cpu else 'bf16'}), "
          f"{a.grad_accum * len(units)} reduce-scatters = {a.grad_accum} x {len(units)} units (fp32); "
          "bus bytes = (R-1)/R x full buffers")
    summary = f"zero3 {R} ranks: "
    on, off = by.get((R, True)), by.get((R, False))
    if one and on and off:
        serial = off - one
        hidden = (off - on) / serial if serial > 0 else float("nan")
        bw = bus / serial / 1e9 if serial > 0 else float("nan")
        print(f"serialised communication = off - 1 rank = {serial * 1e3:.1f} ms per step -> bus {bw:.1f} GB/s; "
              f"overlap hides {off - on:+.4f} s = {hidden:.0%} of it; still exposed with overlap: "
              f"{(on - one) * 1e3:.1f} ms")
        summary += (f"scaling {tokens / on / (tokens / one):.0%} per GPU with overlap, "
                    f"{tokens / off / (tokens / one):.0%} without; overlap saves {(off - on) * 1e3:.1f} ms of "
                    f"{off * 1e3:.1f} ms ({hidden:.0%} of the serialised communication, bus {bw:.1f} GB/s); "
                    f"{tokens / on:.0f} tok/s/GPU")
    else:
        summary += "incomplete"
    print("summary: " + summary + ("" if ok else " (FAILED runs above)"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
