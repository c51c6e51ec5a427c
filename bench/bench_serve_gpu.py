"""tandem-serve on a GPU (CUDA backend) vs transformers `generate` on the same GPU, same model, one run, beside
the roofline measured in the same run.

    python3 bench/bench_serve_gpu.py --build build-gpu.carry [--shape 0.5b|1.5b] [--streams 1,64,256,512]
                                     [--max-tokens 128] [--no-quick] [--grpo [--grpo-torch]]

A random Qwen2.5-shaped model (bf16, tied embeddings) is saved once with a small byte-level tokenizer. For each
concurrency C:
  tandem : C concurrent HTTP clients on /v1/completions (32 prompt ids, greedy, max_tokens T, ignore_eos);
  torch  : model.generate on the batch of the same C prompts (greedy, exactly T new tokens, sdpa, bf16). With
           --quick (the default) batches of 256 and more generate 32 tokens instead of T: their tok/s then comes
           from a shorter context (slightly in torch's favour); the table marks those rows.
Roofline per batch b, from two ceilings measured here with torch on the same GPU:
  BW   = device-to-device copy of 2 GiB, (bytes read + bytes written) / time;
  PEAK = bf16 matmul 8192^3, 2 * 8192^3 / time;
  memory bound  = b * BW / (weight bytes + b * KV bytes per sequence at the mean context, prompt + T/2)
                  (one decode step reads every weight once and each sequence's KV cache once);
  compute bound = PEAK / (2 * params) tokens/s (attention FLOPs left out: small at these contexts);
  roofline = min of the two; each side is reported as a % of it.
--grpo adds a GRPO-shaped load: 64 prompts of 256 ids, n = 8 each (64 concurrent requests, 512 sequences),
1024 new tokens, temperature 1, ignore_eos; total generated tokens/s of tandem (transformers too with --grpo-torch:
one generate call, num_return_sequences 8; slow). --streams none skips the streams table.
--eager-too also runs the streams on a second tandem-serve with --enforce-eager (decode without CUDA graphs) and
prints the graphs' gain beside each row. Each batch size is warmed up at its own size first (the server records a
decode graph on a size's first use).
Also checks correctness: for 4 prompts, the greedy tokens of both agree on their first 8 tokens (bf16 kernels
differ in rounding, so long continuations may part on near-ties).
"""
import argparse
import pathlib
import tempfile
import time

import torch

import benchlib
from benchlib import completions, engine_counters, engine_split, measure_ceilings, roofline, server_fixtures, use_devlib

VOCAB = benchlib.QWEN_VOCAB
PROMPT_LEN = 32


def build_model(d, shape):
    model = benchlib.build_qwen_model(d, shape, "cuda", attn_implementation="sdpa").eval()
    return model, model.config


def prompts_for(c, length=PROMPT_LEN):
    g = torch.Generator().manual_seed(c)
    return torch.randint(300, VOCAB, (c, length), generator=g)


def torch_generate(model, prompts, max_tokens, n=1, sample=False):
    with torch.no_grad():
        out = model.generate(prompts.cuda(), attention_mask=torch.ones_like(prompts).cuda(), do_sample=sample,
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0,
                             num_return_sequences=n, **({"temperature": 1.0, "top_k": 0} if sample else {}))
    return out[:, prompts.shape[1]:].tolist()


def greedy_margins(model, prompts, ours):
    """Teacher-forced check of tandem's greedy tokens against transformers: for each prompt, one forward over the
    prompt + tandem's tokens; at each step the margin is transformers' top logit minus its logit of tandem's token,
    in units of that row's logit standard deviation (0 when they pick the same token). Random weights give
    near-flat logits, so bf16 rounding flips near-ties and whole sequences part; a correct decode keeps every margin
    near 0 (a few hundredths), a wrong token would sit whole standard deviations below the top. Returns the largest
    margin per prompt."""
    worst = []
    with torch.no_grad():
        for p, toks in zip(prompts, ours):
            ids = torch.cat([p, torch.tensor(toks[:-1], dtype=p.dtype)]).unsqueeze(0).cuda()
            logits = model(input_ids=ids).logits[0, len(p) - 1:].float()
            chosen = logits.gather(1, torch.tensor(toks, device=logits.device).unsqueeze(1)).squeeze(1)
            worst.append(((logits.max(dim=1).values - chosen) / logits.std(dim=1)).max().item())
    return worst


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build-gpu.carry")
    ap.add_argument("--shape", choices=list(benchlib.QWEN_SHAPES), default="0.5b")
    ap.add_argument("--streams", default="1,64,256,512")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--quick", action=argparse.BooleanOptionalAction, default=True,
                    help="torch generates 32 tokens at batch >= 256 (default on)")
    ap.add_argument("--grpo", action="store_true", help="also the GRPO-shaped load (64 x n=8, 256 + 1024 tokens)")
    ap.add_argument("--grpo-torch", action="store_true", help="and transformers on it too (minutes)")
    ap.add_argument("--eager-too", action="store_true",
                    help="also tandem-serve --enforce-eager (no CUDA graphs) on the streams, for the graphs' gain")
    args = ap.parse_args()
    server_fixtures.BUILD = pathlib.Path(args.build).resolve()
    use_devlib(server_fixtures.BUILD)
    streams = [] if args.streams == "none" else list(map(int, args.streams.split(",")))
    bw, peak = measure_ceilings()
    print(f"measured: device copy {bw / 1e12:.2f} TB/s (read + write), bf16 matmul 8192^3 {peak / 1e12:.0f} TFLOP/s",
          flush=True)
    rows, grpo = [], None
    with tempfile.TemporaryDirectory() as d:
        model, cfg = build_model(d, args.shape)
        params = sum(p.numel() for p in model.parameters())  # tied: the embedding counted once (it is the LM head)
        weight_bytes = 2 * params
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        kv_tok = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 2  # K and V, bf16
        max_seqs = max([512] + streams)
        server_args = ["--device", "cuda", "--kv-cache-memory", "40G", "--max-num-seqs", str(max_seqs),
                       "--max-num-batched-tokens", "8192", "--served-model-name", "bench"]
        eager = {}
        if args.eager_too:
            with server_fixtures.TandemServer(d, *server_args, "--enforce-eager", start_timeout=300) as srv:
                for c in streams:
                    p = prompts_for(c)
                    completions(srv.url, p[:2], 4)  # warm-up
                    t0 = time.perf_counter()
                    out = completions(srv.url, p, args.max_tokens)
                    eager[c] = sum(map(len, out)) / (time.perf_counter() - t0)
                    print(f"streams {c}: tandem --enforce-eager {eager[c]:.0f} tok/s", flush=True)
        with server_fixtures.TandemServer(d, *server_args, start_timeout=300) as srv:
            p = prompts_for(4)
            ours = completions(srv.url, p, 8)
            theirs = torch_generate(model, p, 8)
            agree = sum(a == b for a, b in zip(ours, theirs))
            margins = greedy_margins(model, p, ours)
            print(f"greedy agreement on the first 8 tokens: {agree}/4 prompts; transformers' logit margin against "
                  f"tandem's tokens (teacher-forced, in logit std, worst of 8 per prompt): "
                  + ", ".join(f"{m:.3f}" for m in margins), flush=True)
            for c in streams:
                p = prompts_for(c)
                completions(srv.url, p[:2], 4)  # warm-up
                completions(srv.url, p, 4)  # and at this batch size (a CUDA graph is recorded on first use)
                before = engine_counters(srv.url)
                t0 = time.perf_counter()
                out = completions(srv.url, p, args.max_tokens)
                wall = time.perf_counter() - t0
                ours = sum(map(len, out)) / wall
                split = engine_split(before, engine_counters(srv.url), wall)
                print(f"streams {c}: engine {split}", flush=True)
                t_tok = 32 if args.quick and c >= 256 else args.max_tokens
                torch_generate(model, p[:2], 4)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                gen = torch_generate(model, p, t_tok)
                theirs = sum(map(len, gen)) / (time.perf_counter() - t0)
                mem, comp = roofline(c, PROMPT_LEN + args.max_tokens / 2, weight_bytes, kv_tok, params, bw, peak)
                rows.append((c, ours, theirs, t_tok, mem, comp, split))
                print(f"streams {c}: tandem {ours:.0f} tok/s, transformers {theirs:.0f} tok/s ({t_tok} tokens), "
                      f"roofline {min(mem, comp):.0f} tok/s", flush=True)
            if args.grpo:
                g = torch.Generator().manual_seed(7)
                gp = torch.randint(300, VOCAB, (64, 256), generator=g)
                completions(srv.url, gp[:2], 4, n=2, temperature=1.0)  # warm-up
                before = engine_counters(srv.url)
                t0 = time.perf_counter()
                out = completions(srv.url, gp, 1024, n=8, temperature=1.0)
                dt = time.perf_counter() - t0
                print(f"grpo load: engine {engine_split(before, engine_counters(srv.url), dt)}", flush=True)
                ours = sum(map(len, out)) / dt
                assert len(out) == 512, len(out)
                theirs = None
                if args.grpo_torch:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    gen = torch_generate(model, gp, 1024, n=8, sample=True)
                    theirs = sum(map(len, gen)) / (time.perf_counter() - t0)
                mem, comp = roofline(512, 256 + 512, weight_bytes, kv_tok, params, bw, peak)
                grpo = (ours, dt, theirs, mem, comp)
                print(f"grpo load: tandem {ours:.0f} tok/s ({dt:.1f} s)", flush=True)
            # What the server said about its CUDA graphs (recordings, failures) and anything that failed.
            notes = [ln for ln in srv.log_text().splitlines() if "graph" in ln or "fail" in ln]
            for ln in notes[:20]:
                print(f"server log: {ln}", flush=True)
    name = f"Qwen2.5-{args.shape.upper()} shape ({params / 1e6:.0f} M params)"
    print(f"GPU {torch.cuda.get_device_name()}, {name}, bf16, {PROMPT_LEN}-token prompts, "
          f"{args.max_tokens} new tokens, greedy, torch={torch.__version__}")
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s, bf16 {peak / 1e12:.0f} TFLOP/s; weights {weight_bytes / 1e9:.2f} GB, "
          f"KV {kv_tok / 1024:.0f} KiB/token")
    if rows:
        print(f"{'streams':>8}{'tandem tok/s':>14}{'torch tok/s':>13}{'ratio':>8}{'mem bound':>11}{'compute bd':>12}"
              f"{'tandem %roof':>14}{'torch %roof':>13}")
        for c, ours, theirs, t_tok, mem, comp, split in rows:
            roof = min(mem, comp)
            mark = "*" if t_tok != args.max_tokens else " "
            print(f"{c:>8}{ours:>14.0f}{theirs:>12.0f}{mark}{ours / theirs:>7.2f}x{mem:>11.0f}{comp:>12.0f}"
                  f"{ours / roof:>14.1%}{theirs / roof:>13.1%}"
                  + (f"   eager {eager[c]:.0f} tok/s (graphs {ours / eager[c]:.2f}x)" if c in eager else "")
                  + f"   engine: {split}")
        if any(r[3] != args.max_tokens for r in rows):
            print("* torch generated 32 tokens (--quick), not the full count")
    if grpo:
        ours, dt, theirs, mem, comp = grpo
        roof = min(mem, comp)
        extra = f", transformers {theirs:.0f} tok/s ({ours / theirs:.2f}x)" if theirs else ""
        print(f"grpo load (64 prompts x n=8, 256 + 1024 tokens, T=1): tandem {ours:.0f} tok/s in {dt:.1f} s, "
              f"{ours / roof:.1%} of roofline {roof:.0f}{extra}")
    head = "; ".join(f"{c}: {ours:.0f} tok/s {ours / theirs:.2f}x torch {ours / min(m, k):.0%} roof"
                     for c, ours, theirs, _, m, k, _ in rows)
    if grpo:
        head += ("; " if head else "") + f"grpo {grpo[0]:.0f} tok/s"
    print(f"summary: serve {args.shape} {head}")


if __name__ == "__main__":
    main()
