"""Two builds' bench_server_steps, alternated: the CPU server's prefill and decode throughput, before vs after.

    python3 bench/bench_server_steps_ab.py --base /tmp/base/build --new build --model MODEL_DIR \
        [--batches 1,8,64,512] [--prompt 9] [--decode 6] [--rounds 8] [--threads 1]

MODEL_DIR needs only config.json (random weights). Each round runs the base build's bench, then the new one's (each
the best of 3 runs per batch size), with OMP_NUM_THREADS and OPENBLAS_NUM_THREADS = --threads. Alternating keeps a
shared, loaded machine's drift out of the ratios. Prints, per batch size, the best and the median over the rounds of
prefill and decode tokens/s for each build and new / base.
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess


def run(build, args, env):
    out = subprocess.run([str(pathlib.Path(build) / "bench" / "bench_server_steps"), args.model,
                          "--batches", args.batches, "--prompt", str(args.prompt), "--decode", str(args.decode),
                          "--repeat", "3"], capture_output=True, text=True, env=env, check=True).stdout
    return [json.loads(line) for line in out.splitlines()]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="build folder of the baseline")
    p.add_argument("--new", required=True, help="build folder of the change")
    p.add_argument("--model", required=True, help="model folder (config.json)")
    p.add_argument("--batches", default="1,8,64,512")
    p.add_argument("--prompt", type=int, default=9)
    p.add_argument("--decode", type=int, default=6)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), OPENBLAS_NUM_THREADS=str(args.threads))
    got = {}
    for _ in range(args.rounds):
        for tag in ("base", "new"):
            for row in run(getattr(args, tag), args, env):
                got.setdefault((tag, row["batch"]), []).append(row)
    name = pathlib.Path(args.model).name
    for b in map(int, args.batches.split(",")):
        line = [f"{name} threads={args.threads} B={b}"]
        for kind in ("prefill_tokens_per_s", "decode_tokens_per_s"):
            base = [r[kind] for r in got[("base", b)]]
            new = [r[kind] for r in got[("new", b)]]
            line.append(f"{kind.split('_')[0]} base {max(base):.0f} (median {statistics.median(base):.0f}) "
                        f"new {max(new):.0f} (median {statistics.median(new):.0f}) "
                        f"new/base best {max(new) / max(base):.2f} median "
                        f"{statistics.median(new) / statistics.median(base):.2f}")
        print(" | ".join(line))


if __name__ == "__main__":
    main()
