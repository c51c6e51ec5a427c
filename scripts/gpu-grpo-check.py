"""GRPO end to end on one GPU: tandem-serve --device cuda and one tandem-train rank --device cuda, the toy task of
tests/e2e/test_train_grpo.py (reward: a digit in the completion), 20 steps; then the same run on the CPU backend.
Prints both reward curves and a verdict: each run must finish and raise its mean reward (last 5 steps vs first 5).

    python3 scripts/gpu-grpo-check.py --build build-gpu.carry
"""
import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "e2e"))
import server_fixtures  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(build, model_dir, data, out_dir, device, steps):
    control = f"tcp://127.0.0.1:{free_port()}"
    with server_fixtures.TandemServer(model_dir, "--control", control, "--device", device, start_timeout=300):
        args = [str(build / "bin" / "tandem-train"), "--model", str(model_dir), "--train-file", str(data),
                "--output-dir", str(out_dir), "--rollout-servers", control, "--rewards", "regex_format",
                "--format-regex", "[0-9]", "--format-regex-mode", "search", "--num-generations", "8",
                "--per-device-train-batch-size", "8", "--max-completion-length", "12", "--learning-rate", "2e-2",
                "--max-steps", str(steps), "--logging-steps", "1", "--loss-type", "grpo", "--seed", "3",
                "--device", device]
        env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return None, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, proc.stderr


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build-gpu.carry")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    build = pathlib.Path(args.build).resolve()
    server_fixtures.BUILD = build
    ok = True
    with tempfile.TemporaryDirectory() as d:
        d = pathlib.Path(d)
        server_fixtures.build_tiny_model(d / "model")
        words = ["the quick brown", "a lazy dog", "seven wizards", "numbers plus", "question answer", "think step"]
        with open(d / "train.jsonl", "w") as f:
            for i in range(64):
                f.write(json.dumps({"prompt": words[i % len(words)] + f" {i % 10}"}) + "\n")
        for device in ("cuda", "cpu"):
            try:
                rows, log = run(build, d / "model", d / "train.jsonl", d / device, device, args.steps)
            except (AssertionError, subprocess.TimeoutExpired) as e:
                rows, log = None, str(e)[-2000:]
            if rows is None:
                print(f"{device}: FAILED\n{log}")
                ok = False
                continue
            rewards = [r["reward"] for r in rows]
            first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
            good = len(rows) == args.steps and last > first
            ok &= good
            print(f"{device}: {'ok' if good else 'FAILED'} reward {first:.3f} -> {last:.3f}; per step "
                  + " ".join(f"{x:.2f}" for x in rewards))
            print(f"{device}: step_time median {sorted(r['step_time'] for r in rows)[len(rows) // 2]:.3f} s")
    print("GRPO on GPU:", "PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
