"""CPU forward+backward throughput: tandem's model core vs PyTorch, same model shape, batch and threads, one run.

    OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 $VENV/bin/python bench/bench_model.py [--build build] [--batch 4] [--seq 256]

Both sides: fp32, random weights, next-token cross-entropy over B packed/batched sequences of length T,
forward + backward (no optimizer step). Prints a table and the ratio tandem / PyTorch.
"""
import argparse
import json
import os
import pathlib
import subprocess
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

SHAPES = {
    # ~34M parameters, a small Llama shape with GQA.
    "llama-34m": lambda: LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                                     num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                                     tie_word_embeddings=False),
    # Qwen2.5-0.5B's layer shape with 4 layers instead of 24 and a 32k vocabulary (the CPU has 2 cores).
    "qwen2-0.5b-4layers": lambda: Qwen2Config(vocab_size=32768, hidden_size=896, intermediate_size=4864,
                                              num_hidden_layers=4, num_attention_heads=14, num_key_value_heads=2,
                                              max_position_embeddings=4096, tie_word_embeddings=True),
}


def torch_step_time(cfg, B, T, steps, warmup):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    for it in range(warmup + steps):
        if it == warmup:
            t0 = time.perf_counter()
        model.zero_grad(set_to_none=False)
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1))
        loss.backward()
    return (time.perf_counter() - t0) / steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.environ.get("TANDEM_BUILD_DIR", "build"))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    threads = int(os.environ.get("OMP_NUM_THREADS", "2"))
    torch.set_num_threads(threads)
    exe = pathlib.Path(args.build) / "bench" / "bench_model_step"
    rows = []
    for name in args.shapes.split(","):
        cfg = SHAPES[name]()
        with tempfile.TemporaryDirectory() as d:
            cfg.save_pretrained(d)
            out = subprocess.run([str(exe), d, "--batch", str(args.batch), "--seq", str(args.seq), "--steps",
                                  str(args.steps), "--warmup", str(args.warmup)],
                                 capture_output=True, text=True, check=True).stdout
        ours = json.loads(out)
        t_torch = torch_step_time(cfg, args.batch, args.seq, args.steps, args.warmup)
        tok = args.batch * args.seq
        rows.append((name, ours["params"], tok / ours["step_s"], tok / t_torch, t_torch / ours["step_s"]))
    print(f"threads={threads} batch={args.batch} seq={args.seq} steps={args.steps} torch={torch.__version__}")
    print(f"{'shape':<22}{'params':>12}{'tandem tok/s':>15}{'torch tok/s':>14}{'ratio':>8}")
    for name, params, ours, theirs, ratio in rows:
        print(f"{name:<22}{params:>12,}{ours:>15.1f}{theirs:>14.1f}{ratio:>7.2f}x")


if __name__ == "__main__":
    main()
