"""GPU training-step throughput: tandem (CUDA backend) vs PyTorch on the same model shape, batch and GPU, one run.

    python3 bench/bench_model_gpu.py --build build-gpu [--shapes qwen2.5-0.5b,qwen2.5-1.5b] [--batch 8] [--seq 1024]

Two modes, both sides the same work, random weights, next-token cross-entropy over batch x seq tokens:
  fwdbwd : forward + backward, bf16 parameters, no optimizer step, no activation checkpointing.
  update-nockpt : update without activation checkpointing on both sides (--gradient-checkpointing false; fits
           in memory at these shapes and batch), so no forward runs twice.
           PyTorch: the transformers model in bf16 (sdpa attention).
  update : the policy update a GRPO/SFT step runs (the trainer's defaults, TRL's usual set-up): activation
           checkpointing, forward + backward, global gradient-norm clipping to 1.0, AdamW on fp32 master weights.
           tandem: bf16 parameters + fp32 master/m/v (bench_model_step --checkpoint --adamw);
           PyTorch: fp32 parameters under torch.autocast(bf16), gradient checkpointing, clip_grad_norm_, fused AdamW.
Every tandem mode keeps the forward's logits for the backward (the trainer's keep_logits default);
--recompute-logits recomputes them in chunks instead (keep_logits false).
MFU = 6 * params * tokens/s / peak (model FLOPs: recomputation is not counted), peak = 989 TFLOP/s (H100/H200
dense bf16).
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
from transformers import AutoModelForCausalLM

from benchlib import QWEN_SHAPES, qwen_config

SHAPES = {f"qwen2.5-{s}": s for s in QWEN_SHAPES}  # the --shapes names
PEAK = 989e12


def torch_step(cfg, B, T, mode, steps=5, warmup=2):
    torch.manual_seed(0)
    update = mode.startswith("update")
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32 if update else torch.bfloat16,
                                             attn_implementation="sdpa").cuda()
    opt = None
    if update:
        if mode == "update":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    ids = torch.randint(0, cfg.vocab_size, (B, T), device="cuda")
    for it in range(warmup + steps):
        if it == warmup:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=update):
            logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, cfg.vocab_size),
                                                 ids[:, 1:].reshape(-1))
        loss.backward()
        if update:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    n = sum(p.numel() for p in model.parameters())
    del model, opt
    torch.cuda.empty_cache()
    return dt, n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build-gpu")
    ap.add_argument("--shapes", default=",".join(n for n in SHAPES if n != "qwen2.5-3b"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--modes", default="update,fwdbwd")
    ap.add_argument("--recompute-logits", action="store_true",
                    help="tandem recomputes the logits in backward (keep_logits false) instead of keeping them")
    ap.add_argument("--profile", action="store_true",
                    help="also one profiled tandem step per mode and shape (TANDEM_PROFILE_OPS=1): GPU time per op")
    args = ap.parse_args()
    exe = pathlib.Path(args.build) / "bench" / "bench_model_step"
    rows = []
    for mode in args.modes.split(","):
        flags = {"update": ["--checkpoint", "--adamw"], "update-nockpt": ["--adamw"], "fwdbwd": []}[mode]
        flags += [] if args.recompute_logits else ["--keep-logits"]
        for name in args.shapes.split(","):
            cfg = qwen_config(SHAPES[name])
            with tempfile.TemporaryDirectory() as d:
                cfg.save_pretrained(d)
                out = subprocess.run([str(exe), d, "--device", "cuda", "--batch", str(args.batch), "--seq",
                                      str(args.seq), "--steps", "5", "--warmup", "2", *flags],
                                     capture_output=True, text=True)
            if out.returncode != 0:
                rows.append((mode, name, None, None, None, out.stderr.strip()[-300:]))
                continue
            ours = json.loads(out.stdout)
            if args.profile:
                with tempfile.TemporaryDirectory() as d:
                    cfg.save_pretrained(d)
                    prof = subprocess.run([str(exe), d, "--device", "cuda", "--batch", str(args.batch), "--seq",
                                           str(args.seq), "--steps", "1", "--warmup", "1", *flags],
                                          capture_output=True, text=True, env=dict(os.environ, TANDEM_PROFILE_OPS="1"))
                print(f"--- {mode} {name}: one warm-up + one step, profiled\n" + prof.stderr.strip())
            t_torch, n = torch_step(cfg, args.batch, args.seq, mode)
            tok = args.batch * args.seq
            rows.append((mode, name, n, tok / ours["step_s"], tok / t_torch, ""))
    print(f"GPU {torch.cuda.get_device_name()} batch={args.batch} seq={args.seq} torch={torch.__version__}")
    print(f"{'mode':<14}{'shape':<14}{'params':>14}{'tandem tok/s':>14}{'MFU':>7}{'torch tok/s':>13}{'MFU':>7}"
          f"{'ratio':>8}")
    for mode, name, n, ours, theirs, note in rows:
        if ours is None:
            print(f"{mode:<14}{name:<14} tandem failed: {note}")
            continue
        print(f"{mode:<14}{name:<14}{n:>14,}{ours:>14.0f}{6 * n * ours / PEAK:>7.1%}{theirs:>13.0f}"
              f"{6 * n * theirs / PEAK:>7.1%}{ours / theirs:>7.2f}x")
    print("summary: train " + "; ".join(
        f"{mode} {name} failed" if ours is None
        else f"{mode} {name} {ours:.0f} tok/s MFU {6 * n * ours / PEAK:.1%} {ours / theirs:.2f}x torch"
        for mode, name, n, ours, theirs, _ in rows))
    sys.exit(1 if any(r[3] is None for r in rows) else 0)


if __name__ == "__main__":
    main()
