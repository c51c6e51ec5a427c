"""The demo's spread: `tandem-train demo` on the CPU over several seeds, OpenBLAS core types and demo settings.

    python3 bench/demo_spread.py [--build build] [--seeds 1,2,3,4,5] [--coretypes default,Sandybridge]
                                 [--variant NAME=ARGS]... [--parallel N] [--threads T] [--deadline S] [--out DIR]

Each run is `tandem-train demo --device cpu --threads T --seed S ARGS` with OPENBLAS_CORETYPE set to the core type
("default": OpenBLAS's own choice for this CPU). Another core type runs other GEMM kernels, so the sums are rounded
in another order: what the demo reaches must not depend on it. Runs go N at a time; a run still going at the
deadline is stopped and its last evaluation reported. The table gives, per run, held-out accuracy before and after
GRPO, the GRPO steps, why GRPO stopped and the wall time; then, per variant, the lowest final accuracy and the
largest number of steps. Needs only the Python standard library (it runs on bare GPU hosts too).
"""
import argparse
import concurrent.futures
import json
import os
import pathlib
import re
import shlex
import subprocess
import time

EVAL_LINE = re.compile(r"GRPO step (\d+): validation accuracy ([\d.]+) %, held-out accuracy ([\d.]+) %")


def run_one(binary, out, seed, core, threads, args, deadline):
    env = dict(os.environ)
    if core != "default":
        env["OPENBLAS_CORETYPE"] = core
    cmd = [binary, "demo", "--output-dir", str(out), "--device", "cpu", "--threads", str(threads), "--seed", str(seed),
           *args]
    t0 = time.time()
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.parent / (out.name + ".log")
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=deadline).returncode
        except subprocess.TimeoutExpired:
            rc = "deadline"
    wall = time.time() - t0
    row = {"seed": seed, "core": core, "rc": rc, "wall": wall, "before": None, "after": None, "steps": None,
           "stopped": "", "validation": None}
    summary = out / "demo_summary.json"
    if rc == 0 and summary.exists():
        s = json.loads(summary.read_text())
        row.update(before=s["accuracy_before"], after=s["accuracy_after"], steps=s["grpo"]["steps"],
                   stopped=s["grpo"].get("stopped_by", ""),
                   validation=s["evaluations"][-1].get("validation_accuracy"))
    else:
        evals = [m.groups() for m in EVAL_LINE.finditer(log.read_text(errors="replace"))]
        if evals:
            row.update(before=float(evals[0][2]) / 100, after=float(evals[-1][2]) / 100, steps=int(evals[-1][0]),
                       validation=float(evals[-1][1]) / 100, stopped=f"not finished ({rc})")
        else:
            row["stopped"] = f"failed ({rc}): {log}"
    return row


def pct(x):
    return "-" if x is None else f"{100 * x:.1f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--seeds", default="1,2,3,4,5")
    ap.add_argument("--coretypes", default="default")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=ARGS: demo arguments of one variant (repeatable; default: the demo's defaults)")
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--deadline", type=float, default=3600, help="seconds a run may take (default 3600)")
    ap.add_argument("--out", default="/tmp/demo-spread")
    a = ap.parse_args()
    binary = str(pathlib.Path(a.build) / "bin" / "tandem-train")
    variants = [v.split("=", 1) for v in a.variant] or [["default", ""]]
    jobs = [(name, shlex.split(args), int(seed), core) for name, args in variants for seed in a.seeds.split(",")
            for core in a.coretypes.split(",")]
    out = pathlib.Path(a.out)
    rows = []
    with concurrent.futures.ThreadPoolExecutor(a.parallel) as pool:
        futs = {pool.submit(run_one, binary, out / f"{name}-s{seed}-{core}", seed, core, a.threads, args,
                            a.deadline): name for name, args, seed, core in jobs}
        for fut in concurrent.futures.as_completed(futs):
            r = fut.result()
            r["variant"] = futs[fut]
            rows.append(r)
            print(f"done: {r['variant']} seed {r['seed']} {r['core']}: {pct(r['before'])} -> {pct(r['after'])} % "
                  f"at step {r['steps']} ({r['stopped']}), {r['wall']:.0f} s", flush=True)
    rows.sort(key=lambda r: (r["variant"], r["seed"], r["core"]))
    print(f"\n{'variant':<12} {'seed':>4} {'coretype':<10} {'before %':>8} {'after %':>8} {'valid %':>8} {'steps':>6} "
          f"{'wall s':>7}  stopped by")
    for r in rows:
        print(f"{r['variant']:<12} {r['seed']:>4} {r['core']:<10} {pct(r['before']):>8} {pct(r['after']):>8} "
              f"{pct(r['validation']):>8} {str(r['steps']):>6} {r['wall']:>7.0f}  {r['stopped']}")
    print()
    for name, _ in variants:
        mine = [r for r in rows if r["variant"] == name and r["after"] is not None]
        if mine:
            print(f"{name}: final held-out accuracy {pct(min(r['after'] for r in mine))}-"
                  f"{pct(max(r['after'] for r in mine))} %, before {pct(min(r['before'] for r in mine))}-"
                  f"{pct(max(r['before'] for r in mine))} %, GRPO steps {min(r['steps'] for r in mine)}-"
                  f"{max(r['steps'] for r in mine)}, wall {min(r['wall'] for r in mine):.0f}-"
                  f"{max(r['wall'] for r in mine):.0f} s over {len(mine)} runs")


if __name__ == "__main__":
    main()
