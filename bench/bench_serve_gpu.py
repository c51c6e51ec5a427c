"""tandem-serve on a GPU (CUDA backend) vs transformers `generate` on the same GPU, same model, one run.

    python3 bench/bench_serve_gpu.py --build build-gpu.carry [--streams 1,64,256] [--max-tokens 128]

A random Qwen2.5-0.5B-shaped model (bf16) is saved once with a small byte-level tokenizer. For each concurrency C:
  tandem : C concurrent HTTP clients on /v1/completions (32 prompt ids, greedy, max_tokens T, ignore_eos);
  torch  : model.generate on the batch of the same C prompts (greedy, exactly T new tokens, sdpa, bf16).
Also checks correctness: for 4 prompts, the greedy tokens of both agree on their first 8 tokens (bf16 kernels
differ in rounding, so long continuations may part on near-ties).
"""
import argparse
import concurrent.futures
import pathlib
import sys
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "e2e"))
import server_fixtures  # noqa: E402


def build_model(d):
    server_fixtures.build_tokenizer(d)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=4096, bos_token_id=None, eos_token_id=None)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    model.save_pretrained(d, safe_serialization=True)
    return model.cuda()


def prompts_for(c, length=32):
    g = torch.Generator().manual_seed(c)
    return torch.randint(300, 151936, (c, length), generator=g)


def completions(url, prompts, max_tokens):
    def one(p):
        status, body, _ = server_fixtures.http_json("POST", url + "/v1/completions", {
            "model": "bench", "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}, timeout=900)
        assert status == 200, body
        return body["choices"][0]["token_ids"]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, [p.tolist() for p in prompts]))


def torch_generate(model, prompts, max_tokens):
    with torch.no_grad():
        out = model.generate(prompts.cuda(), attention_mask=torch.ones_like(prompts).cuda(), do_sample=False,
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0)
    return out[:, prompts.shape[1]:].tolist()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build-gpu.carry")
    ap.add_argument("--streams", default="1,64,256")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    server_fixtures.BUILD = pathlib.Path(args.build).resolve()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        model = build_model(d)
        with server_fixtures.TandemServer(d, "--device", "cuda", "--kv-cache-memory", "16G", "--max-num-seqs", "256",
                                          "--max-num-batched-tokens", "8192", "--served-model-name", "bench",
                                          start_timeout=300) as srv:
            p = prompts_for(4)
            ours = completions(srv.url, p, 8)
            theirs = torch_generate(model, p, 8)
            agree = sum(a == b for a, b in zip(ours, theirs))
            print(f"greedy agreement on the first 8 tokens: {agree}/4 prompts", flush=True)
            for c in map(int, args.streams.split(",")):
                p = prompts_for(c)
                completions(srv.url, p[:2], 4)  # warm-up
                t0 = time.perf_counter()
                out = completions(srv.url, p, args.max_tokens)
                ours = sum(map(len, out)) / (time.perf_counter() - t0)
                torch_generate(model, p[:2], 4)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                gen = torch_generate(model, p, args.max_tokens)
                theirs = sum(map(len, gen)) / (time.perf_counter() - t0)
                rows.append((c, ours, theirs))
                print(f"streams {c}: tandem {ours:.0f} tok/s, transformers {theirs:.0f} tok/s", flush=True)
    print(f"GPU {torch.cuda.get_device_name()}, Qwen2.5-0.5B shape, bf16, 32-token prompts, {args.max_tokens} new tokens, "
          f"greedy, torch={torch.__version__}")
    print(f"{'streams':>8}{'tandem tok/s':>15}{'transformers tok/s':>20}{'ratio':>8}")
    for c, ours, theirs in rows:
        print(f"{c:>8}{ours:>15.0f}{theirs:>20.0f}{ours / theirs:>7.2f}x")


if __name__ == "__main__":
    main()
