"""tandem-serve --tensor-parallel-size N on N GPUs vs N = 1: decode time per token through HTTP, beside the bandwidth
roofline of the N GPUs, in one run.

    python3 bench/bench_serve_tp_gpu.py --build build-gpu.carry [--shape 7b] [--tp 1,2] [--streams 1,16]
                                        [--grpo [--grpo-prompts 64] [--grpo-tokens 1024]]

A random Qwen2.5-shaped model (bf16, tied embeddings) is saved once. For each N a server runs on cuda:0..N-1 and,
for each concurrency C, C clients each ask /v1/completions for 32 prompt ids, greedy, ignore_eos, twice: T1 = 32
and T2 = 288 new tokens; the decode time per step is (time(T2) - time(T1)) / 256, which leaves out the prefill and
the HTTP round trip. Roofline of a decode step at batch C: every weight read once, split over N GPUs, plus each
sequence's KV cache at the mean context, at the device copy bandwidth BW measured here with torch on cuda:0
(bytes read + written / time): bound = (weight bytes / N + C * KV bytes) / BW. The table gives ms per step, the
share of that bound, and TP N's speed-up over TP 1.
Also reports how many of the first 16 greedy tokens of a prompt each server shares with the first one's, and fails
when the first differs by more than a near-tie: the other server's first token must be among the first server's 5
best with a logprob within NEAR_TIE of its top (random weights give near-flat logits, and bf16 sums in another order
part on near-ties, at 32B even on the first token).
--server-args passes more tandem-serve options to every server (e.g. --enforce-eager to see the CUDA graphs' share).
--random-weights (always for the 32b and 72b shapes) writes config.json alone and starts the servers with
--load-format random:
random weights made on the GPUs, the same model at every TP size, no 65 / 145 GB of files.
--grpo adds a GRPO-shaped load per N: --grpo-prompts prompts of 256 ids, n = 8 each, --grpo-tokens new tokens,
temperature 1, ignore_eos, all at once; generated tokens/s, TP N's over the first N's, and where the engine's time
went (steps, their model + sampling time and host time). --kv sizes each GPU's KV pool alike, so TP N also has N
times the room for sequences in flight.
--dry-run-cpu checks this script without GPUs: the tiny test model on the CPU backend (TP as CPU shards).
"""
import argparse
import concurrent.futures
import json
import pathlib
import random
import sys
import tempfile
import time

import benchlib
from benchlib import build_model, completions, engine_counters, engine_split, server_fixtures, use_devlib

PROMPT_LEN, T1, T2 = 32, 32, 288
# nats. bf16 sums in another order, through every layer, move a logit by up to tenths (32B random weights: TP 2's
# first token was 0.094 below TP 1's top); a wrong model's token is nowhere near the 5 best.
NEAR_TIE = 0.5
GRPO_PROMPT_LEN, GRPO_N = 256, 8


def post_completion(url, body):
    status, out, _ = server_fixtures.http_json("POST", url + "/v1/completions", body, timeout=600)
    assert status == 200, out
    return out["choices"][0]


def complete(url, prompt, max_tokens):
    choice = post_completion(url, {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                                   "return_token_ids": True})
    ids = choice["token_ids"]
    assert len(ids) == max_tokens, choice
    return ids


def first_token(url, prompt):
    """The greedy first token and the 5 best first tokens' logprobs ({id: logprob})."""
    choice = post_completion(url, {"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 5,
                                   "return_tokens_as_token_ids": True, "return_token_ids": True})
    top = {int(k.split(":", 1)[1]): v for k, v in choice["logprobs"]["top_logprobs"][0].items()}
    return choice["token_ids"][0], top


def timed(url, prompts, max_tokens):
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: complete(url, p, max_tokens), prompts))
    return time.perf_counter() - t0, outs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build-gpu.carry")
    ap.add_argument("--shape", choices=[*benchlib.QWEN_SHAPES, *benchlib.QWEN_CONFIG_ONLY_SHAPES], default="7b")
    ap.add_argument("--random-weights", action="store_true", help="--load-format random (config.json alone)")
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--kv", default="8G", help="--kv-cache-memory of each server (per GPU)")
    ap.add_argument("--server-args", default="", help="more tandem-serve options, space-separated")
    ap.add_argument("--grpo", action="store_true", help="also a GRPO-shaped load per tensor-parallel size")
    ap.add_argument("--grpo-prompts", type=int, default=64)
    ap.add_argument("--grpo-tokens", type=int, default=1024)
    ap.add_argument("--dry-run-cpu", action="store_true")
    args = ap.parse_args()
    build = pathlib.Path(args.build).resolve()
    use_devlib(build)
    server_fixtures.BUILD = build
    tps = [int(x) for x in args.tp.split(",")]
    streams = [int(x) for x in args.streams.split(",")]
    if args.dry_run_cpu:
        bw, gpu = float("nan"), "no GPU (dry run)"
    else:
        import torch
        bw = benchlib.measure_ceilings()[0] / 1e9
        gpu = f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}"
    rows, grpo_rows, ok = [], [], True
    with tempfile.TemporaryDirectory() as d:
        model_dir = pathlib.Path(d) / "model"
        model_dir.mkdir()
        random_weights = args.random_weights or args.shape in benchlib.QWEN_CONFIG_ONLY_SHAPES
        if args.dry_run_cpu:
            params = sum(build_model(model_dir, "tiny").values())
        elif random_weights:
            params = benchlib.build_config_only(model_dir, args.shape)
        else:
            params = sum(build_model(model_dir, args.shape).values())
        load = ["--load-format", "random"] if random_weights else []
        cfg = json.loads((model_dir / "config.json").read_text())
        V = cfg["vocab_size"]
        D = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        kv_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * D * 2   # K and V, bf16
        weight_bytes = 2 * params
        prompts = [[(97 * s + 13 * i + 5) % (V - 1) + 1 for i in range(PROMPT_LEN)] for s in range(max(streams))]
        ref = None
        for tp in tps:
            dev = ["--device", "cpu"] if args.dry_run_cpu else ["--device", "cuda"]
            srv = server_fixtures.TandemServer(model_dir, *dev, *load, "--tensor-parallel-size", tp, "--kv-cache-memory",
                                               "64M" if args.dry_run_cpu else args.kv, *args.server_args.split(),
                                               start_timeout=600)
            try:
                head = complete(srv.url, prompts[0], 16)
                first, top = first_token(srv.url, prompts[0])
                if ref is None:
                    ref, ref_first, ref_top = head, first, top
                same = next((i for i, (a, b) in enumerate(zip(head, ref)) if a != b), len(ref))
                print(f"TP {tp}: the first {same} of 16 greedy tokens equal TP {tps[0]}'s", flush=True)
                if first != ref_first:
                    gap = ref_top[ref_first] - ref_top.get(first, float("-inf"))   # inf: not among the 5 best
                    print(f"TP {tp}: first token {first} against {ref_first}: TP {tps[0]} gave it a logprob {gap:.4f} "
                          f"below its top ({'a near-tie' if gap <= NEAR_TIE else 'more than a near-tie: wrong'})",
                          flush=True)
                    ok = ok and gap <= NEAR_TIE
                for c in streams:
                    timed(srv.url, prompts[:c], T1)   # warm-up: this batch size's graphs are recorded
                    t1, _ = timed(srv.url, prompts[:c], T1)
                    t2, _ = timed(srv.url, prompts[:c], T2)
                    step = (t2 - t1) / (T2 - T1)
                    ctx = PROMPT_LEN + (T1 + T2) / 2
                    bound = (weight_bytes / tp + c * ctx * kv_per_token) / (bw * 1e9)
                    rows.append((tp, c, step, bound))
                    print(f"TP {tp}, {c} streams: {step * 1e3:.2f} ms per decode step", flush=True)
                if args.grpo:
                    rng = random.Random(7)
                    gp = [[rng.randrange(1, V) for _ in range(GRPO_PROMPT_LEN)] for _ in range(args.grpo_prompts)]
                    completions(srv.url, gp[:2], 4, n=2, temperature=1.0)   # warm-up
                    before = engine_counters(srv.url)
                    t0 = time.perf_counter()
                    out = completions(srv.url, gp, args.grpo_tokens, n=GRPO_N, temperature=1.0)
                    dt = time.perf_counter() - t0
                    assert len(out) == GRPO_N * args.grpo_prompts and all(len(o) == args.grpo_tokens for o in out)
                    split = engine_split(before, engine_counters(srv.url), dt)
                    grpo_rows.append((tp, sum(map(len, out)) / dt, dt, split))
                    print(f"TP {tp}, grpo load: {grpo_rows[-1][1]:.0f} tok/s ({dt:.1f} s); engine {split}", flush=True)
            finally:
                srv.stop()
    print(f"{gpu}; {'tiny test model' if args.dry_run_cpu else 'Qwen2.5-' + args.shape.upper() + ' shape'}"
          f"{' (--load-format random)' if random_weights else ''} "
          f"({params / 1e9:.2f} B params, {weight_bytes / 1e9:.1f} GB bf16); device copy BW {bw:.0f} GB/s (read + "
          f"write)")
    print(f"{'TP':>3}{'streams':>9}{'ms/step':>10}{'bound ms':>10}{'of bound':>10}{'vs TP ' + str(tps[0]):>10}")
    base = {c: s for tp, c, s, _ in rows if tp == tps[0]}
    for tp, c, step, bound in rows:
        print(f"{tp:>3}{c:>9}{step * 1e3:>10.2f}{bound * 1e3:>10.2f}{bound / step:>10.0%}{base[c] / step:>9.2f}x")
    if grpo_rows:
        print(f"grpo load ({args.grpo_prompts} prompts x n={GRPO_N}, {GRPO_PROMPT_LEN} + {args.grpo_tokens} tokens, "
              f"T=1, --kv {args.kv} a GPU):")
        print(f"{'TP':>3}{'tok/s':>10}{'seconds':>10}{'vs TP ' + str(tps[0]):>10}")
        for tp, tok_s, dt, _ in grpo_rows:
            print(f"{tp:>3}{tok_s:>10.0f}{dt:>10.1f}{tok_s / grpo_rows[0][1]:>9.2f}x")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
