"""The GEMMs of one training step: tandem (bench/bench_gemm.c, ops_matmul_* on cuBLASLt) vs PyTorch, one GPU, one run.

    python3 bench/bench_gemm_gpu.py --build build-gpu.carry [--shapes 0.5b,1.5b] [--chunk-sweep 2048,4096]
                                    [--no-fused] [--step] [--min-ms 40]

For each model shape bench_gemm lists every GEMM a step issues (Qwen2.5 shapes, 8192 tokens, activation
checkpointing, lm_head in model_train.c's row chunks) with its calls per step, and times each on several tandem
variants in alternation (one CUDA context each, same process):
  heuristic  TANDEM_GEMM_AUTOTUNE=0: cuBLASLt heuristic's first pick (the behaviour before autotuning)
  autotune   TANDEM_GEMM_AUTOTUNE=2: the fastest of the heuristic's candidates, timed on first use (logged)
  ws128      autotune with a 128 MiB cuBLASLt workspace (bench_gemm --variant ws128: OpsSettings.gemm_workspace_mib = 128) instead of 32 MiB
PyTorch runs the same shapes and dtypes on the same GPU, also as the median of 5 timed rounds: F.linear (bf16,
bias when the GEMM has one), torch.mm / Tensor.addmm_ for din, and for dw an fp32-output addmm (out_dtype=float32,
accumulating like tandem's beta 1) where this torch has it, else a bf16 mm added into the fp32 gradient.
Also (tandem autotuned): the step with one fused [q | k | v] projection (unless --no-fused), the lm_head GEMMs with
other chunk row counts (--chunk-sweep), and with --step bench_model_step (update mode: checkpointing + AdamW,
batch 8 x 1024) with autotuning off and on. The last table compares the step's GEMM time (each GEMM weighted by
its calls per step).
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from benchlib import qwen_config

VARIANTS = ["heuristic:0:32", "autotune:2:32", "ws128:1:128"]
ROUNDS = 5


def run_c(exe, args):
    out = subprocess.run([str(exe), *args], capture_output=True, text=True,
                         env=dict(os.environ, NCCL_NVLS_ENABLE="0"))
    if out.returncode != 0:
        raise RuntimeError(f"{exe.name} {' '.join(args)} failed rc={out.returncode}: {out.stderr.strip()[-600:]}")
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return [r for r in rows if not r.get("step")], next(r for r in rows if r.get("step")), out.stderr


def time_cuda(fn, min_ms):
    """Median ms per call over ROUNDS batches of about min_ms / ROUNDS each."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(3):
        fn()
    b.record()
    b.synchronize()
    iters = max(3, min(5000, int(min_ms / ROUNDS / max(a.elapsed_time(b) / 3, 1e-3))))
    times = []
    for _ in range(ROUNDS):
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / iters)
    return sorted(times)[ROUNDS // 2]


DW_MODE = None


def torch_ms(g, min_ms):
    """PyTorch's time for one GEMM of bench_gemm's list (same shapes, bf16 operands)."""
    global DW_MODE
    N, IC, OC, kind = g["N"], g["IC"], g["OC"], g["kind"]
    dev, bf = "cuda", torch.bfloat16
    w = torch.empty(OC, IC, device=dev, dtype=bf).uniform_(-1, 1)
    if kind.startswith("fwd"):
        x = torch.empty(N, IC, device=dev, dtype=bf).uniform_(-1, 1)
        b = torch.empty(OC, device=dev, dtype=bf).uniform_(-1, 1) if kind == "fwd+bias" else None
        return time_cuda(lambda: F.linear(x, w, b), min_ms)
    dout = torch.empty(N, OC, device=dev, dtype=bf).uniform_(-1, 1)
    if kind == "din":
        return time_cuda(lambda: torch.mm(dout, w), min_ms)
    if kind == "din+=":
        din = torch.empty(N, IC, device=dev, dtype=bf).uniform_(-1, 1)
        return time_cuda(lambda: din.addmm_(dout, w), min_ms)
    x = torch.empty(N, IC, device=dev, dtype=bf).uniform_(-1, 1)
    dw = torch.empty(OC, IC, device=dev, dtype=torch.float32).uniform_(-1, 1)
    ways = {
        "addmm(out_dtype=float32, out=dw)": lambda: torch.addmm(dw, dout.t(), x, out_dtype=torch.float32, out=dw),
        "dw = addmm(out_dtype=float32)": lambda: torch.addmm(dw, dout.t(), x, out_dtype=torch.float32),
        "dw.add_(mm bf16)": lambda: dw.add_(torch.mm(dout.t(), x)),
    }
    if DW_MODE is None:
        for name, fn in ways.items():
            try:
                fn()
                DW_MODE = name
                break
            except (TypeError, RuntimeError):
                continue
    return time_cuda(ways[DW_MODE], min_ms)


def flop(g):
    return 2.0 * g["N"] * g["IC"] * g["OC"]


def step_bench(build, shape, autotune):
    """tok/s of bench_model_step (update mode) with autotuning on or off."""
    exe = pathlib.Path(build) / "bench" / "bench_model_step"
    cfg = qwen_config(shape)
    with tempfile.TemporaryDirectory() as d:
        cfg.save_pretrained(d)
        out = subprocess.run([str(exe), d, "--device", "cuda", "--batch", "8", "--seq", "1024", "--steps", "5",
                              "--warmup", "2", "--checkpoint", "--adamw"], capture_output=True, text=True,
                             env=dict(os.environ, NCCL_NVLS_ENABLE="0", TANDEM_GEMM_AUTOTUNE=autotune))
    if out.returncode != 0:
        raise RuntimeError(f"bench_model_step {shape} failed: {out.stderr.strip()[-400:]}")
    return json.loads(out.stdout)["tokens_per_s"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build-gpu")
    ap.add_argument("--shapes", default="0.5b,1.5b")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="NAME:AUTOTUNE:WORKSPACE_MB,... (first = baseline)")
    ap.add_argument("--chunk-sweep", default="1664,2048", help="other lm_head chunk row counts (empty: none)")
    ap.add_argument("--no-fused", action="store_true", help="skip the fused-qkv what-if")
    ap.add_argument("--step", action="store_true", help="also bench_model_step with autotuning off and on")
    ap.add_argument("--step-only", action="store_true", help="only the bench_model_step comparison")
    ap.add_argument("--min-ms", type=float, default=40)
    args = ap.parse_args()
    if args.step_only:
        for shape in args.shapes.split(","):
            off, on = step_bench(args.build, shape, "0"), step_bench(args.build, shape, "1")
            print(f"bench_model_step update {shape}: autotune off {off:.0f} tok/s, on {on:.0f} tok/s ({on / off:.3f}x)",
                  flush=True)
        return 0
    exe = pathlib.Path(args.build) / "bench" / "bench_gemm"
    specs = args.variants.split(",")
    names = [s.split(":")[0] for s in specs]
    vflags = [a for s in specs for a in ("--variant", s)]
    tuned = "autotune:1:32"
    mm = ["--min-ms", str(args.min_ms)]
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    summary, sweep, steps = [], [], []
    for shape in args.shapes.split(","):
        t0 = time.time()
        rows, st, err = run_c(exe, ["--shape", shape, *mm, *vflags])
        log = [ln[len("tandem gemm autotune: "):] for ln in err.splitlines() if ln.startswith("tandem gemm autotune")]
        if log:
            changed = sum(1 for ln in log if " kept #0 " not in ln)
            print(f"--- {shape}: {len(log)} plans tuned (autotune context), {changed} changed from the heuristic's "
                  f"first pick; bench_gemm {time.time() - t0:.0f} s")
            for ln in log:
                print("    " + ln)
        t_ms = [torch_ms(g, args.min_ms) for g in rows]
        torch_step = sum(ms * g["calls"] for ms, g in zip(t_ms, rows))
        print(f"\n{shape}: TFLOP/s per GEMM (N x IC -> OC, calls per step; median of {ROUNDS} rounds); "
              f"torch dw: {DW_MODE}")
        print(f"{'gemm':<13}{'kind':<9}{'N':>6}{'IC':>6}{'OC':>7}{'calls':>6}" + "".join(f"{n:>11}" for n in names)
              + f"{'torch':>8}{'best/torch':>11}")
        for g, tms in zip(rows, t_ms):
            ms = [g["ms"][n] for n in names]
            print(f"{g['name']:<13}{g['kind']:<9}{g['N']:>6}{g['IC']:>6}{g['OC']:>7}{g['calls']:>6}"
                  + "".join(f"{flop(g) / x * 1e-9:>11.0f}" for x in ms)
                  + f"{flop(g) / tms * 1e-9:>8.0f}{tms / min(ms):>10.2f}x")
        fused = None
        if not args.no_fused:
            frows, fst, _ = run_c(exe, ["--shape", shape, "--fused-qkv", *mm, "--variant", tuned])
            f_torch = sum(torch_ms(g, args.min_ms) * g["calls"] for g in frows)
            fused = (fst["gemm_ms"]["autotune"], f_torch)
            for g in frows:
                if g["name"] == "qkv":
                    print(f"{'qkv (fused)':<13}{g['kind']:<9}{g['N']:>6}{g['IC']:>6}{g['OC']:>7}{g['calls']:>6}"
                          f"   autotune {flop(g) / g['ms']['autotune'] * 1e-9:.0f}")
        summary.append((shape, st, torch_step, fused))
        lm = [(g, tms) for g, tms in zip(rows, t_ms) if g["name"].startswith("lm_head")]
        base = names[1] if len(names) > 1 else names[0]
        sweep.append((shape, st["chunk_rows"], sum(g["ms"][base] * g["calls"] for g, _ in lm),
                      sum(flop(g) * g["calls"] for g, _ in lm), sum(t * g["calls"] for g, t in lm)))
        for r in [x for x in args.chunk_sweep.split(",") if x]:
            lrows, lst, _ = run_c(exe, ["--shape", shape, "--lm-only", "--chunk-rows", r, *mm, "--variant", tuned])
            sweep.append((shape, lst["chunk_rows"], lst["gemm_ms"]["autotune"],
                          sum(flop(g) * g["calls"] for g in lrows),
                          sum(torch_ms(g, args.min_ms) * g["calls"] for g in lrows)))
        if args.step:
            t0 = time.time()
            steps.append((shape, step_bench(args.build, shape, "0"), step_bench(args.build, shape, "1")))
            print(f"--- {shape}: bench_model_step x2 {time.time() - t0:.0f} s", flush=True)

    print(f"\nlm_head GEMMs per step (fwd x2, din, dw+=, 8192 tokens) by chunk rows; tandem {base} vs torch:")
    print(f"{'shape':<7}{'rows':>6}{'tandem ms':>11}{'TFLOP/s':>9}{'torch ms':>10}")
    for shape, rows, ms, fl, tms in sorted(sweep):
        print(f"{shape:<7}{rows:>6}{ms:>11.2f}{fl / ms * 1e-9:>9.0f}{tms:>10.2f}")
    if steps:
        print("\nbench_model_step, update mode (checkpointing + AdamW), batch 8 x 1024, tok/s:")
        for shape, off, on in steps:
            print(f"{shape:<7} autotune off {off:>9.0f}  on {on:>9.0f}  ({on / off:.3f}x)")
    print("\nGEMM time per training step (8192 tokens, checkpointing; each GEMM x its calls per step), "
          "ms (effective TFLOP/s):")
    print(f"{'shape':<7}{'TFLOP':>7}{'lm rows':>8}" + "".join(f"{n:>14}" for n in names)
          + f"{'torch':>14}{'best/torch':>11}" + ("" if args.no_fused else f"{'fused qkv':>14}{'torch':>14}"))
    for shape, st, tms, fused in summary:
        tfl = st["gemm_tflop"]
        ms = st["gemm_ms"]
        cells = "".join(f"{ms[n]:>7.1f} ({tfl / ms[n] * 1e3:>3.0f})" for n in names)
        line = (f"{shape:<7}{tfl:>7.1f}{st['chunk_rows']:>8}{cells}{tms:>7.1f} ({tfl / tms * 1e3:>3.0f})"
                f"{tms / min(ms.values()):>10.2f}x")
        if fused:
            line += f"{fused[0]:>7.1f} ({tfl / fused[0] * 1e3:>3.0f}){fused[1]:>7.1f} ({tfl / fused[1] * 1e3:>3.0f})"
        print(line)
    print("summary: gemm " + "; ".join(
        f"{shape} " + " ".join(f"{n} {st['gemm_ms'][n]:.1f} ms" for n in names) + f" torch {tms:.1f} ms"
        for shape, st, tms, _ in summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
