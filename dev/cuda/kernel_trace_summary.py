"""Summarise kernel traces written by dev/cuda/kernel_trace.c: for each trace file and device, the kernels of a decode
step grouped by kernel and by the kernel before it (so that o_proj and down_proj, both plain GEMVs, come apart), with
their count and median duration per step, and the idle time between kernels.

    python3 dev/cuda/kernel_trace_summary.py --layers 64 /tmp/kt.*

Steps are counted as the q|k|v projections (gemv_kernel<1, 2>, one a layer at batch 1) over --layers. Gaps shorter
than 30 us are counted as inside a step (a graph replay's kernel boundaries), longer ones as host time between steps.
Names are demangled with c++filt when it is on PATH.
"""
import argparse
import collections
import statistics
import subprocess

SHORT = ["gemv_kernel<1, 0>", "gemv_kernel<1, 1>", "gemv_kernel<1, 2>", "gemv_kernel<2, 0>", "gemv_kernel<2, 1>",
         "gemv_kernel<2, 2>", "paged_mma", "paged_merge", "peer_all_reduce", "nccl", "embedding", "rmsnorm", "sample",
         "logprob"]


def short(name):
    return next((k for k in SHORT if k in name), name[:40])


def demangle(names):
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
        return out[:len(names)] if len(out) >= len(names) else names
    except OSError:
        return names


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--min-us", type=float, default=5.0, help="leave out kernels under this many us a step")
    ap.add_argument("traces", nargs="+")
    args = ap.parse_args()
    for path in args.traces:
        by_device = collections.defaultdict(list)
        with open(path) as f:
            for line in f:
                parts = line.split(" ", 3)
                if len(parts) == 4:
                    by_device[int(parts[0])].append((int(parts[1]), int(parts[2]), parts[3].strip()))
        for device, kernels in sorted(by_device.items()):
            kernels.sort()
            names = [short(n) for n in demangle([k[2] for k in kernels])]
            durations, gaps_before = collections.defaultdict(list), collections.defaultdict(list)
            inside = between = 0
            for i, (start, end, _) in enumerate(kernels):
                key = f"{names[i]} <- {names[i - 1] if i else '-'}"
                durations[key].append(end - start)
                if i:
                    gap = start - kernels[i - 1][1]
                    if gap < 30000:
                        inside += max(gap, 0)
                        gaps_before[key].append(gap)
                    else:
                        between += gap
            qkv = sum(len(v) for k, v in durations.items() if k.startswith("gemv_kernel<1, 2>"))
            steps = max(qkv // args.layers, 1)
            busy = sum(e - s for s, e, _ in kernels)
            print(f"== {path} cuda:{device}: {len(kernels)} kernels, ~{steps} steps; a step: kernels "
                  f"{busy / steps / 1e3:.0f} us, gaps < 30 us {inside / steps / 1e3:.0f} us, longer gaps "
                  f"{between / steps / 1e3:.0f} us")
            print(f"   {'kernel <- the kernel before it':<48}{'a step':>8}{'median us':>11}{'us a step':>11}"
                  f"{'gap before':>12}")
            for key, d in sorted(durations.items(), key=lambda kv: -sum(kv[1])):
                if sum(d) / steps / 1e3 < args.min_us:
                    continue
                gap = statistics.median(gaps_before.get(key, [0])) / 1e3
                print(f"   {key[:48]:<48}{len(d) / steps:>8.1f}{statistics.median(d) / 1e3:>11.2f}"
                      f"{sum(d) / steps / 1e3:>11.0f}{gap:>12.2f}")


if __name__ == "__main__":
    main()
