"""Resume on another number of ranks: an SFT checkpoint of flat ZeRO-3 written by N CPU ranks resumes on M ranks
(2 -> 1, 2 -> 4, 4 -> 2; stages 1 and 2: 2 -> 4) and continues as the resume on N does.

The global batch stays 8 rows (per-device batch x accumulation x ranks) and shuffle_dataset is off, so the ranks'
interleaved shards (data.h: rank r takes records g % N == r) hand the same 8 records to each optimizer step
whatever the number of ranks; the checkpoint's per-rank data_position is rescaled (x N / M). The optimizer state
is re-sliced from the old ranks' flat shards (checkpoint_reslice.c), the same floats. What differs is only the
order of the sums: the loss and the gradient of 8 rows are summed over M ranks (and micro-steps) instead of N, so
the losses agree within 1e-5 (relative) and the final weights within lr / 1000 (as test_train_node_sharding.py
allows HSDP; float32 rounding of the per-rank partial sums, which Adam's division by sqrt(v) can amplify for the
smallest moments; measured 1.2e-7 after 3 steps here), not bit for bit; the N -> N resume is bit for bit. A shuffled
epoch under way is refused, naming both sides, and so is a cut text no run writes (hpz:3 of 2 ranks). Checkpoints of
the node-aware cuts (HSDP, hpZ) resuming under another cut: test_train_node_sharding.py.
"""
import json
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from server_fixtures import build_tiny_model  # noqa: E402
from test_train_sft_resume import losses, run, write_sft  # noqa: E402

LR = 1e-2
# (per-device batch, gradient accumulation) for each number of ranks: 8 rows per optimizer step.
SHAPE = {1: (2, 4), 2: (2, 2), 4: (2, 1)}


def args(d, out, world, extra=(), stage=3):
    b, ga = SHAPE[world]
    return ["--mode", "sft", "--model", str(d / "model"), "--train-file", str(d / "train.jsonl"), "--output-dir",
            str(d / out), "--per-device-train-batch-size", str(b), "--gradient-accumulation-steps", str(ga),
            "--learning-rate", str(LR), "--max-steps", "6", "--save-steps", "3", "--logging-steps", "1",
            "--zero-stage", str(stage), "--seed", "5", "--init-timeout", "60", "--shuffle-dataset", "false", *extra]


def train(d, out, world, extra=(), stage=3):
    codes, logs = run(args(d, out, world, extra, stage), world, d, out)
    assert codes == [0] * world, logs
    return logs


def weights(path):
    from safetensors.numpy import load_file
    return {k: v.astype(np.float32) for k, v in load_file(str(path)).items()}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume-world")
    build_tiny_model(d / "model")
    write_sft(d / "train.jsonl", n=48)
    return d


def check_resumes(d, written_by, ranks_after, stage=3):
    full = f"full{written_by}" + ("" if stage == 3 else f"-stage{stage}")
    train(d, full, written_by, stage=stage)
    ckpt = d / full / "checkpoint-3"
    assert json.loads((ckpt / "trainer_state.json").read_text())["world_size"] == written_by
    same = f"{full}-to-{written_by}"
    train(d, same, written_by, ["--resume", str(ckpt)], stage)
    ref_losses, ref_w = losses(d / same), weights(d / same / "checkpoint-6" / "model.safetensors")
    # Resuming on the same ranks repeats the uninterrupted run bit for bit.
    assert ref_losses == {s: losses(d / full)[s] for s in (4, 5, 6)}
    for m in ranks_after:
        out = f"{full}-to-{m}"
        logs = train(d, out, m, ["--resume", str(ckpt)], stage)
        assert (f"written by {written_by} ranks cutting the ZeRO state full_shard; re-slicing it for {m} ranks "
                "cutting it full_shard") in logs, logs
        got = losses(d / out)
        assert sorted(got) == [4, 5, 6], got
        for s in (4, 5, 6):
            assert abs(got[s] - ref_losses[s]) <= 1e-5 * abs(ref_losses[s]), (m, s, got[s], ref_losses[s])
        w = weights(d / out / "checkpoint-6" / "model.safetensors")
        assert w.keys() == ref_w.keys()
        worst = max(float(np.max(np.abs(w[k] - ref_w[k]))) for k in w)
        assert worst <= LR / 1000, (m, worst)


def test_two_ranks_resume_on_one_and_on_four(setup):
    check_resumes(setup, 2, (1, 4))


def test_four_ranks_resume_on_two(setup):
    check_resumes(setup, 4, (2,))


@pytest.mark.parametrize("stage", [1, 2])
def test_stages_one_and_two_resume_on_another_number_of_ranks(setup, stage):
    """Every stage keeps the same slices of master and moments (zero3.h), so stages 1 and 2 re-slice alike."""
    check_resumes(setup, 2, (4,), stage)


def test_what_cannot_be_resliced_is_refused(setup):
    d = setup
    ckpt = d / "full2" / "checkpoint-3"
    if not ckpt.exists():
        pytest.skip("needs the checkpoint of test_two_ranks_resume_on_one_and_on_four")
    # A shuffled epoch under way: each rank's order is a permutation of its own shard.
    codes, logs = run(args(d, "refused-shuffle", 1, ["--resume", str(ckpt), "--shuffle-dataset", "true"]), 1, d,
                      "refused-shuffle")
    assert codes == [1] and "written by 2 ranks at position" in logs and "shuffle_dataset on" in logs, logs
    # A cut no run of 2 ranks writes (hpZ's G divides the ranks): a damaged or hand-edited trainer_state.json.
    bad = d / "bad-cut-ckpt"
    bad.mkdir()
    for f in ckpt.iterdir():
        (bad / f.name).symlink_to(f)
    (bad / "trainer_state.json").unlink()
    state = json.loads((ckpt / "trainer_state.json").read_text())
    state["zero_slicing"] = "hpz:3"
    (bad / "trainer_state.json").write_text(json.dumps(state))
    codes, logs = run(args(d, "refused-cut", 1, ["--resume", str(bad)]), 1, d, "refused-cut")
    assert codes == [1], logs
    assert 'zero_slicing "hpz:3" of 2 ranks is not a cut tandem makes' in logs, logs
