"""Rollout server throughput vs transformers `generate`, same model, same machine, one run.

    OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 $VENV/bin/python bench/bench_serve.py [--build build] [--streams 1,16,64]

A random Llama (hidden 512, 8 layers, GQA 8:4, vocab 8192, fp32) is saved once. For each concurrency C:
  tandem : C concurrent HTTP clients, each POST /v1/completions (32 prompt token ids, greedy, max_tokens T,
           ignore_eos) against tandem-serve (CPU backend); generated tokens / wall time.
  torch  : model.generate on a batch of the same C prompts, greedy, exactly T new tokens; C*T / wall time.
Prints a table and the ratio tandem / transformers.
"""
import argparse
import concurrent.futures
import os
import pathlib
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from benchlib import server_fixtures


def build_model(out_dir):
    server_fixtures.build_tokenizer(out_dir)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                      bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    return model


def prompts_for(c, length=32):
    g = torch.Generator().manual_seed(c)
    return torch.randint(300, 8192, (c, length), generator=g)


def bench_tandem(url, prompts, max_tokens):
    def one(p):
        status, body, _ = server_fixtures.http_json("POST", url + "/v1/completions", {
            "model": "bench", "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}, timeout=600)
        assert status == 200, body
        return body["usage"]["completion_tokens"]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        total = sum(pool.map(one, [p.tolist() for p in prompts]))
    return total / (time.perf_counter() - t0)


def bench_torch(model, prompts, max_tokens):
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0)
    dt = time.perf_counter() - t0
    return (out.shape[1] - prompts.shape[1]) * prompts.shape[0] / dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.environ.get("TANDEM_BUILD_DIR", "build"))
    ap.add_argument("--streams", default="1,16,64")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    server_fixtures.BUILD = pathlib.Path(args.build).resolve()
    threads = int(os.environ.get("OMP_NUM_THREADS", "2"))
    torch.set_num_threads(threads)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        model = build_model(d)
        with server_fixtures.TandemServer(d, "--kv-cache-memory", "1G", "--max-num-seqs", "64",
                                         "--served-model-name", "bench") as srv:
            url = srv.url
            bench_tandem(url, prompts_for(2), 8)  # warm-up
            for c in map(int, args.streams.split(",")):
                p = prompts_for(c)
                ours = bench_tandem(url, p, args.max_tokens)
                theirs = bench_torch(model, p, args.max_tokens)
                rows.append((c, ours, theirs))
    print(f"threads={threads} prompt=32 tokens, {args.max_tokens} new tokens each, greedy, fp32, torch={torch.__version__}")
    print(f"{'streams':>8}{'tandem tok/s':>15}{'transformers tok/s':>20}{'ratio':>8}")
    for c, ours, theirs in rows:
        print(f"{c:>8}{ours:>15.1f}{theirs:>20.1f}{ours / theirs:>7.2f}x")


if __name__ == "__main__":
    main()
