"""A run resumed from an earlier checkpoint logs every step once in metrics.jsonl (issue 22).

Run A (one CPU process, --mode sft) trains to step 4, saving every 2 steps, and stops. Run B resumes from A's
checkpoint-2 into the same folder and trains to step 4 again. metrics.jsonl used to hold steps 1, 2, 3, 4, 3, 4:
B appended to A's rows of steps 3 and 4. Now the rows after the checkpoint's step are removed at resume, saying
so, and B saving checkpoint-4 again replaces A's (the old copy is moved aside, never deleted first).
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from server_fixtures import build_tiny_model  # noqa: E402
from test_train_grpo import train_binary  # noqa: E402
from test_train_sft_resume import write_sft  # noqa: E402

CONTRACT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume_metrics")
    build_tiny_model(d / "model")
    write_sft(d / "train.jsonl")
    return d


def sft(d, out, *extra):
    env = {k: v for k, v in os.environ.items() if k not in CONTRACT}
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    args = [train_binary(), "--mode", "sft", "--model", str(d / "model"), "--train-file", str(d / "train.jsonl"),
            "--output-dir", str(out), "--per-device-train-batch-size", "2", "--max-steps", "4", "--save-steps", "2",
            "--logging-steps", "1", "--learning-rate", "1e-3", "--device", "cpu", *extra]
    p = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    return p.returncode, p.stdout + p.stderr


def rows(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_resumed_run_logs_every_step_once(setup):
    d = setup
    out = d / "run"
    code, log = sft(d, out)
    assert code == 0, log
    first = rows(out)
    assert [r["step"] for r in first] == [1, 2, 3, 4]

    code, log = sft(d, out, "--resume", str(out / "checkpoint-2"))
    assert code == 0, log
    again = rows(out)
    assert [r["step"] for r in again] == [1, 2, 3, 4], again
    assert "removed 2 row(s) of steps after 2" in log, log
    # Steps 1 and 2 are the first run's rows, byte for byte; 3 and 4 come from the resumed run.
    assert again[:2] == first[:2]
    assert [r["loss"] for r in again[2:]] == [r["loss"] for r in first[2:]]  # exact resume on the CPU
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "checkpoint-4", "metrics.jsonl"]
