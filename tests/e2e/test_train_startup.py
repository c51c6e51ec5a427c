"""What tandem-train settles before its first step (one CPU process, --mode sft: no server needed).

- An --output-dir that holds an earlier run (metrics.jsonl, checkpoint-N) is refused without --resume, naming the
  files and the ways on; --overwrite-output-dir deletes that run's files (and only those) and starts over;
  --resume latest continues it. Before, a re-run truncated metrics.jsonl and left the old run's later
  checkpoints, which --resume latest then picked.
- A malformed line near the end of the training file stops the run at start, naming file:line (it used to stop
  the run only when the reader reached it, hundreds of steps in).
- trainer_state.json records the ZeRO stage the run used.
"""
import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from server_fixtures import build_tiny_model  # noqa: E402
from test_train_grpo import train_binary  # noqa: E402
from test_train_sft_resume import write_sft  # noqa: E402

CONTRACT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("startup")
    build_tiny_model(d / "model")
    write_sft(d / "train.jsonl")
    return d


def sft(d, out, *extra, steps=2, data=None):
    """One single-process SFT run; returns (exit code, output, seconds)."""
    env = {k: v for k, v in os.environ.items() if k not in CONTRACT}
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    args = [train_binary(), "--mode", "sft", "--model", str(d / "model"), "--train-file", str(data or d / "train.jsonl"),
            "--output-dir", str(out), "--per-device-train-batch-size", "2", "--max-steps", str(steps),
            "--save-steps", "1", "--logging-steps", "1", "--learning-rate", "1e-3", "--device", "cpu", *extra]
    t0 = time.time()
    p = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    return p.returncode, p.stdout + p.stderr, time.time() - t0


def steps_of(out):
    return [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_used_output_dir_is_refused_then_overwritten_or_resumed(setup):
    d = setup
    out = d / "parent-made-too" / "run"  # the parent does not exist: the run creates it
    code, log, _ = sft(d, out, steps=3)
    assert code == 0, log
    assert steps_of(out) == [1, 2, 3] and (out / "checkpoint-3").is_dir()
    (out / "notes.txt").write_text("the user's own file\n")

    # The same command again: refused before any work, and nothing is touched.
    code, log, _ = sft(d, out, steps=2)
    assert code == 1, log
    assert "holds an earlier run (metrics.jsonl, checkpoint-1, checkpoint-2, checkpoint-3)" in log, log
    assert "--resume latest" in log and "--overwrite-output-dir" in log, log
    assert "optimizer steps" not in log, log  # stopped before the data and the model
    assert steps_of(out) == [1, 2, 3] and (out / "checkpoint-3").is_dir()

    # --resume latest continues it.
    code, log, _ = sft(d, out, "--resume", "latest", steps=4)
    assert code == 0, log
    assert steps_of(out) == [1, 2, 3, 4] and "resumed from" in log

    # --overwrite-output-dir starts over: the earlier run's metrics and checkpoints go, the user's file stays,
    # and the old checkpoint-3/4 are no longer there for --resume latest to pick.
    code, log, _ = sft(d, out, "--overwrite-output-dir", steps=2)
    assert code == 0, log
    assert "--overwrite-output-dir: deleted the earlier run's metrics.jsonl, checkpoint-1" in log, log
    assert steps_of(out) == [1, 2]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-1", "checkpoint-2", "metrics.jsonl", "notes.txt"]

    code, log, _ = sft(d, out, "--overwrite-output-dir", "--resume", "latest")
    assert code == 1 and "overwrite_output_dir" in log and "give one of them" in log, log


def test_bad_line_near_the_end_stops_the_run_at_start(setup):
    d = setup
    data = d / "bad.jsonl"
    lines = (d / "train.jsonl").read_text().splitlines()
    lines[-2] = lines[-2].rstrip("}") + ', "completion": }'  # line 47 of 48: not JSON
    data.write_text("\n".join(lines) + "\n")
    code, log, seconds = sft(d, d / "bad-run", steps=1000, data=data)
    assert code == 1, log
    assert f"{data}:47: invalid JSON" in log, log
    assert "step 1/" not in log and not (d / "bad-run" / "metrics.jsonl").exists(), log
    assert seconds < 60, seconds


@pytest.mark.parametrize("stage", [1, 2])
def test_trainer_state_records_the_zero_stage(setup, stage):
    d = setup
    out = d / f"stage{stage}"
    code, log, _ = sft(d, out, "--zero-stage", str(stage), steps=1)
    assert code == 0, log
    state = json.loads((out / "checkpoint-1" / "trainer_state.json").read_text())
    assert state["zero_stage"] == stage and state["world_size"] == 1
    assert (out / "checkpoint-1" / "trainer_state" / "rank-00000" / "optimizer.safetensors").exists()
