"""The rollout server's decode step alone on a GPU: bench_decode_step (the model's padded decode step + greedy
sampling + the token download, no HTTP, no engine thread) beside the bandwidth / compute roofline measured in the
same run, so that the end-to-end figures of bench_serve_gpu.py can be split into GPU time and host time.

    python3 bench/bench_decode_gpu.py --build build-gpu.carry [--shapes 0.5b,1.5b] [--batches 1,64,256,512]
                                      [--ctx 512] [--steps 64] [--eager-too] [--profile 1,512]
                                      [--ab TANDEM_GEMM_AUTOTUNE=0]

roofline (tokens/s) = min(B * copy_bw / (weight bytes + K/V bytes read), peak bf16 / (2 * params)); copy_bw is a
device-to-device copy (read + write) and peak a large bf16 matmul, both timed with torch here. --profile reruns the
listed batch sizes eagerly under TANDEM_PROFILE_OPS=1 and prints the per-op GPU time (shares, not timings: the
profiler synchronises).
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from benchlib import QWEN_SHAPES, QWEN_VOCAB, measure_ceilings, roofline, use_devlib


def write_config(d, shape):
    cfg = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=QWEN_VOCAB,
               tie_word_embeddings=True, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
               hidden_act="silu", **QWEN_SHAPES[shape])
    (d / "config.json").write_text(json.dumps(cfg))


def variant_env(variant):
    """The environment of an --ab variant: NAME=VALUE, or several joined by commas (A=1,B=2)."""
    env = {}
    for part in variant.split(","):
        name, sep, value = part.partition("=")
        if not sep or not name:
            raise SystemExit(f"--ab: {part!r} is not NAME=VALUE (variants are separated by ';', a variant's "
                             f"variables by ',')")
        env[name] = value
    return env


def run(exe, d, args, profile=False, extra_env=None):
    env = dict(os.environ, **({"TANDEM_PROFILE_OPS": "1", "TANDEM_GEMM_AUTOTUNE": "0"} if profile else {}),
               **(extra_env or {}))
    t0 = time.perf_counter()
    p = subprocess.run([str(exe), str(d), "--device", "cuda", *args], capture_output=True, text=True, env=env,
                       timeout=900)
    print(f"[bench_decode_step {' '.join(args)}{' (profiled)' if profile else ''} {extra_env or ''}: "
          f"{time.perf_counter() - t0:.1f} s]", flush=True)
    if p.returncode != 0:
        sys.exit(f"bench_decode_step failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    return rows, p.stderr


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build-gpu.carry")
    ap.add_argument("--shapes", default="0.5b,1.5b")
    ap.add_argument("--batches", default="1,64,256,512")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--eager-too", action="store_true", help="also every batch size without CUDA graphs")
    ap.add_argument("--profile", default="", help="batch sizes to profile op by op (eager), e.g. 1,512")
    ap.add_argument("--ab", default="", help="environment variants to time beside the default, separated by ';', "
                    "each NAME=VALUE or several joined by ',', e.g. 'TANDEM_GEMM_AUTOTUNE=0;TANDEM_GEMM_AUTOTUNE=2'")
    args = ap.parse_args()
    build = pathlib.Path(args.build).resolve()
    use_devlib(build)
    exe = build / "bench" / "bench_decode_step"
    import torch
    bw, peak = measure_ceilings()
    print(f"GPU {torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s",
          flush=True)
    table = []
    for shape in args.shapes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            d = pathlib.Path(tmp)
            write_config(d, shape)
            common = ["--batches", args.batches, "--ctx", str(args.ctx), "--steps", str(args.steps)]
            rows, _ = run(exe, d, common)
            eager = {}
            if args.eager_too:
                eager = {r["batch"]: r for r in run(exe, d, common + ["--eager"])[0]}
            variants = [v for v in args.ab.split(";") if v]
            # One run per entry, in order: a variant named twice (an interleaved repeat) runs twice.
            ab = [{r["batch"]: r for r in run(exe, d, common, extra_env=variant_env(v))[0]} for v in variants]
            for r in rows:
                params = r["weight_bytes"] / 2
                # roofline() takes K/V bytes per token and a mean context: give it the step's bytes per sequence
                mem, comp = roofline(r["batch"], 1.0, r["weight_bytes"], r["kv_bytes_per_step"] / r["batch"],
                                     params, bw, peak)
                roof = min(mem, comp)
                bytes_step = r["weight_bytes"] + r["kv_bytes_per_step"]
                table.append((shape, r, roof, bytes_step / (r["step_ms"] * 1e-3) / bw, eager.get(r["batch"]),
                              [(v, ab[k][r["batch"]]["step_ms"]) for k, v in enumerate(variants)]))
                print(json.dumps(dict(shape=shape, **r, roofline_tok_s=round(roof))), flush=True)
            if args.profile:
                for b in args.profile.split(","):
                    _, prof = run(exe, d, ["--batches", b, "--ctx", str(args.ctx), "--steps", "16", "--warmup", "2"],
                                  profile=True)
                    print(f"--- {shape}, batch {b}, eager, op profile (18 steps):")
                    print("\n".join(line for line in prof.splitlines() if line.strip()), flush=True)
    print(f"\ndecode step alone (model + greedy sampling + download), ctx {args.ctx}, {args.steps} steps")
    print(f"{'shape':>6}{'batch':>7}{'step ms':>10}{'tok/s':>11}{'roofline':>11}{'% roof':>8}{'% copy bw':>11}"
          f"{'eager ms':>10}")
    for shape, r, roof, bw_share, e, abv in table:
        print(f"{shape:>6}{r['batch']:>7}{r['step_ms']:>10.3f}{r['tokens_per_s']:>11.0f}{roof:>11.0f}"
              f"{r['tokens_per_s'] / roof:>8.1%}{bw_share:>11.1%}" + (f"{e['step_ms']:>10.3f}" if e else "")
              + "".join(f"   {v}: {ms:.3f} ms ({ms / r['step_ms']:.2f}x)" for v, ms in abv))
    print("summary: " + "; ".join(f"{s} b{r['batch']} {r['step_ms']:.2f} ms {r['tokens_per_s'] / roof:.0%} roof"
                                  for s, r, roof, _, _, _ in table))


if __name__ == "__main__":
    main()
