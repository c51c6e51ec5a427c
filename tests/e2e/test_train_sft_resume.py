"""tandem-train --mode sft end to end (CPU, 2 ranks, ZeRO-3), and exact resume.

Run A trains 6 steps and saves at steps 3 and 6. Run B resumes from A's checkpoint-3 and trains to step 6.
On the CPU backend the resumed losses must equal run A's steps 4-6 bit for bit (same data order, same optimizer
state, same reductions), and the loss must fall over the run. A checkpoint with another world size is refused.
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from server_fixtures import build_tiny_model  # noqa: E402
from test_train_grpo import free_port, launch  # noqa: E402


def write_sft(path, n=48):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"question {i % 7} plus {i % 5} equals",
                                "completion": f" answer {(i % 7) + (i % 5)}"}) + "\n")


def sft_args(model_dir, data, out_dir, extra=()):
    return ["--mode", "sft", "--model", str(model_dir), "--train-file", str(data), "--output-dir", str(out_dir),
            "--per-device-train-batch-size", "4", "--gradient-accumulation-steps", "2", "--learning-rate", "1e-2",
            "--max-steps", "6", "--save-steps", "3", "--logging-steps", "1", "--zero-stage", "3", "--seed", "5",
            "--init-timeout", "60", *extra]


def run(args, world, d, tag):
    procs = launch(args, world, free_port(), d)
    codes = [p.wait(timeout=600) for p, _ in procs]
    for _, log in procs:
        log.close()
    logs = "\n".join((d / f"rank{r}.log").read_text() for r in range(world))
    (d / f"{tag}.log").write_text(logs)
    return codes, logs


def losses(out_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (out_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("sft")
    build_tiny_model(d / "model")
    write_sft(d / "train.jsonl")
    return d


def test_sft_trains_and_resumes_exactly(setup):
    d = setup
    model, data = d / "model", d / "train.jsonl"
    codes, logs = run(sft_args(model, data, d / "a"), 2, d, "a")
    assert codes == [0, 0], logs
    a = losses(d / "a")
    assert sorted(a) == [1, 2, 3, 4, 5, 6]
    assert a[6] < a[1], a
    assert (d / "a" / "checkpoint-3" / "trainer_state" / "rank-00001" / "optimizer.safetensors").exists()
    codes, logs = run(sft_args(model, data, d / "b", ["--resume", str(d / "a" / "checkpoint-3")]), 2, d, "b")
    assert codes == [0, 0], logs
    b = losses(d / "b")
    assert sorted(b) == [4, 5, 6]
    for step in (4, 5, 6):
        assert b[step] == a[step], (step, a[step], b[step])
    # The final checkpoints are the same weights.
    from safetensors.torch import load_file
    wa = load_file(str(d / "a" / "checkpoint-6" / "model.safetensors"))
    wb = load_file(str(d / "b" / "checkpoint-6" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)


def test_resume_with_another_world_size_mid_shuffled_epoch_is_refused(setup):
    """Another number of ranks re-slices a flat checkpoint (test_train_resume_world_size.py), but a shuffled epoch
    under way cannot continue: each rank's order is a permutation of its own shard."""
    d = setup
    ckpt = d / "a" / "checkpoint-3"
    if not ckpt.exists():
        pytest.skip("needs the checkpoint of test_sft_trains_and_resumes_exactly")
    codes, logs = run(sft_args(d / "model", d / "train.jsonl", d / "c", ["--resume", str(ckpt)]), 1, d, "c")
    assert codes == [1]
    assert "written by 2 ranks" in logs and "shuffle_dataset on" in logs and "WORLD_SIZE=2" in logs
