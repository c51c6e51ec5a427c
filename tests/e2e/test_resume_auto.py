"""`resume: auto` (docs/kubernetes.md, "Restarting and resuming"): what a run that its scheduler restarts (a JobSet
with restarts, k8s/base/grpo.json) needs. The first start finds no checkpoint and trains from step 0; an attempt
that stopped before its first checkpoint leaves files that the next start replaces instead of refusing the
output_dir; a later start continues from the latest complete checkpoint, with the same losses as a run that was never
stopped (CPU, 2 ranks, ZeRO-3: bit for bit). `auto` with overwrite_output_dir is refused as `latest` is.
"""
import json
import pathlib
import shutil
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from test_train_sft_resume import losses, run, setup, sft_args  # noqa: E402,F401


def test_first_start_trains_from_step_0_then_restart_continues(setup):
    d = setup
    model, data = d / "model", d / "train.jsonl"
    # First start, no output_dir yet: the same run as one without resume (6 steps, checkpoints 3 and 6).
    codes, logs = run(sft_args(model, data, d / "ref"), 2, d, "ref")
    assert codes == [0, 0], logs
    out = d / "auto"
    codes, logs = run(sft_args(model, data, out, ["--resume", "auto"]), 2, d, "auto-1")
    assert codes == [0, 0], logs
    assert f"resume auto: no complete checkpoint in {out}; starting at step 0" in logs, logs
    assert losses(out) == losses(d / "ref") and sorted(losses(out)) == [1, 2, 3, 4, 5, 6]
    # The attempt stopped during step 5: what it left is checkpoint-3 and the rows of steps 1-4.
    shutil.rmtree(out / "checkpoint-6")
    rows = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("".join(r + "\n" for r in rows if json.loads(r)["step"] <= 4))
    codes, logs = run(sft_args(model, data, out, ["--resume", "auto"]), 2, d, "auto-2")
    assert codes == [0, 0], logs
    assert f"resume auto: continuing from {out}/checkpoint-3, the latest complete checkpoint" in logs, logs
    assert "resumed from" in logs and "at step 3" in logs, logs
    assert losses(out) == losses(d / "ref")


def test_attempt_stopped_before_its_first_checkpoint_is_replaced(setup):
    d = setup
    model, data = d / "model", d / "train.jsonl"
    out = d / "stopped"
    out.mkdir()
    # What an attempt killed at step 2 leaves: metrics rows and a checkpoint it never finished.
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in (1, 2)))
    (out / "checkpoint-3.tmp").mkdir()
    codes, logs = run(sft_args(model, data, out, ["--max-steps", "3", "--resume", "auto"]), 2, d, "stopped")
    assert codes == [0, 0], logs
    assert "resume auto, nothing to resume from: deleted the earlier run's metrics.jsonl" in logs, logs
    assert sorted(losses(out)) == [1, 2, 3] and 9.0 not in losses(out).values()


def test_auto_with_overwrite_output_dir_is_refused(setup):
    d = setup
    codes, logs = run(sft_args(d / "model", d / "train.jsonl", d / "refused",
                               ["--resume", "auto", "--overwrite-output-dir"]), 1, d, "refused")
    assert codes == [2] or codes == [1], logs
    assert "overwrite_output_dir: it deletes the checkpoints of output_dir that resume auto continues from" in logs, logs
