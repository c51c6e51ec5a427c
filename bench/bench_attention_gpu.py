"""GPU training attention: tandem's CUDA kernels vs PyTorch's scaled_dot_product_attention (flash backend), one run.

    python3 bench/bench_attention_gpu.py --build build-gpu [--batch 8] [--seq 1024] [--iters 20]

Shapes: Qwen2.5-0.5B heads (14 query / 2 kv, head_dim 64) and Qwen2.5-1.5B heads (12 / 2, head_dim 128); batch
sequences of seq tokens, causal, bf16. tandem packs them (cu_seqlens); PyTorch gets (batch, heads, seq, head_dim)
with enable_gqa (or, where its flash backend refuses GQA, k/v repeated to the query heads: the same FLOPs).
TFLOP/s with the causal count fwd = 4 * seq^2 / 2 * head_dim * heads * batch, bwd = 2.5 x fwd.
The backward of PyTorch is timed alone (autograd.grad over a retained graph).
"""
import argparse
import json
import pathlib
import subprocess

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = {"qwen2.5-0.5b": (14, 2, 64), "qwen2.5-1.5b": (12, 2, 128)}


def cuda_time(fn, iters):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def torch_attention(hq, hkv, d, batch, seq, iters):
    torch.manual_seed(0)
    q = (torch.rand(batch, hq, seq, d, device="cuda") * 4 - 2).bfloat16().requires_grad_()
    k = (torch.rand(batch, hkv, seq, d, device="cuda") * 4 - 2).bfloat16()
    v = (torch.rand(batch, hkv, seq, d, device="cuda") * 2 - 1).bfloat16()
    mode = "enable_gqa"
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        kk, vv = k.clone().requires_grad_(), v.clone().requires_grad_()
        try:
            F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=True)
            call = lambda: F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=True)
        except RuntimeError:
            mode = "k/v repeated"
            kk = k.repeat_interleave(hq // hkv, dim=1).requires_grad_()
            vv = v.repeat_interleave(hq // hkv, dim=1).requires_grad_()
            call = lambda: F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
        fwd_ms = cuda_time(call, iters)
        out = call()
        dout = torch.rand_like(out) * 2 - 1
        bwd_ms = cuda_time(lambda: torch.autograd.grad(out, (q, kk, vv), dout, retain_graph=True), iters)
    return fwd_ms, bwd_ms, mode


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build-gpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    exe = pathlib.Path(args.build) / "bench" / "bench_attention"
    rows = []
    for name, (hq, hkv, d) in SHAPES.items():
        flop = 4.0 * args.seq * args.seq / 2 * d * hq * args.batch
        res = subprocess.run([str(exe), "--hq", str(hq), "--hkv", str(hkv), "--d", str(d), "--seq", str(args.seq),
                              "--batch", str(args.batch), "--iters", str(args.iters)],
                             check=True, capture_output=True, text=True)
        ours = json.loads(res.stdout.strip().splitlines()[-1])
        t_fwd, t_bwd, mode = torch_attention(hq, hkv, d, args.batch, args.seq, args.iters)
        rows.append((name, "fwd", ours["fwd_ms"], ours["fwd_tflops"], t_fwd, flop / t_fwd * 1e-9, mode))
        rows.append((name, "bwd", ours["bwd_ms"], ours["bwd_tflops"], t_bwd, 2.5 * flop / t_bwd * 1e-9, mode))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"batch {args.batch} x seq {args.seq}, causal, bf16")
    print("| shape | pass | tandem ms | tandem TFLOP/s | torch ms | torch TFLOP/s | tandem / torch | torch GQA |")
    print("|---|---|---|---|---|---|---|---|")
    for name, p, oms, otf, tms, ttf, mode in rows:
        print(f"| {name} | {p} | {oms:.3f} | {otf:.1f} | {tms:.3f} | {ttf:.1f} | {tms / oms:.2f}x | {mode} |")


if __name__ == "__main__":
    main()
