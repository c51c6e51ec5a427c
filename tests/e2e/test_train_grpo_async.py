"""Asynchronous GRPO (max_staleness, issue 24) end to end on the CPU: one rollout server, the toy task of
test_train_grpo.py.

* With the servers' weights held still (weight_sync_steps past the run), a run with max_staleness 1 generates
  each round ahead of its training but samples the very completions the synchronous run does (the seeds follow the
  step a round trains at, the prompts the data order): the metrics, the checkpoints' data positions and the final
  weights must be the same bits, and so must the two runs resumed from their checkpoint-2.
* max_staleness 0 is the synchronous run of the build before it (TANDEM_BASELINE_BUILD_DIR: a build of the commit
  before asynchronous GRPO): every metric the baseline logs and every checkpoint's weights are the same bits.
* With weights pushed every step and max_staleness k (1, 2), a round trained once k rounds are out was sampled k
  versions before the policy it trains: staleness k, nothing dropped, every second of a step attributed.
* With a push and a checkpoint every step and log_completions, every completion's version, old logprobs,
  sampling logprobs and importance-sampling weight are recomputed with transformers on the checkpoints of those
  versions and TRL's sequence_mask formula.
* With two optimizer steps per round, a round sent ahead is two versions old when trained: max_staleness 1 drops
  it, counted in samples_dropped_stale, and those steps train on no token.
"""
import contextlib
import json
import os
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from server_fixtures import TandemServer, build_tiny_model, free_port  # noqa: E402
from test_train_grpo import _differing_keys, assert_same_run_as_baseline, _metric_rows, grpo_args, launch, write_dataset  # noqa: E402

# Every *_time field (the step's attribution) must add up to step_wall_time.
PHASES = ("refresh_time", "generate_issue_time", "generate_wait_time", "rewards_phase_time", "old_logps_time",
          "ref_logps_time", "forward_backward_time", "optimizer_time", "weight_sync_phase_time", "log_time",
          "checkpoint_time", "other_time")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("grpo_async")
    model_dir = d / "model"
    build_tiny_model(model_dir)
    data = d / "train.jsonl"
    write_dataset(data)
    return d, model_dir, data


def run(setup, tag, steps, world, extra, binary=None):
    d, model_dir, data = setup
    out_dir = d / tag
    control = f"tcp://127.0.0.1:{free_port()}"
    with contextlib.ExitStack() as stack:
        stack.enter_context(TandemServer(model_dir, "--control", control))
        args = grpo_args(model_dir, data, out_dir, control, steps=steps, extra=extra)
        procs = launch(args, world, free_port(), d, binary=binary)
        codes = [p.wait(timeout=600) for p, _ in procs]
        for _, log in procs:
            log.close()
    logs = "".join((d / f"rank{r}.log").read_text()[-3000:] for r in range(world))
    assert codes == [0] * world, logs
    return out_dir, _metric_rows(out_dir), (d / "rank0.log").read_text()


def test_staleness_zero_is_the_baseline_build(setup):
    base = os.environ.get("TANDEM_BASELINE_BUILD_DIR")
    if not base:
        pytest.skip("set TANDEM_BASELINE_BUILD_DIR to a build of the commit before asynchronous GRPO")
    extra = ["--save-steps", "3", "--per-device-train-batch-size", "16"]
    out_b, rows_b, _ = run(setup, "baseline", 6, 2, extra, binary=str(pathlib.Path(base) / "bin" / "tandem-train"))
    out_0, rows_0, _ = run(setup, "staleness-0", 6, 2, [*extra, "--max-staleness", "0"])
    assert sorted(rows_b) == sorted(rows_0) == [1, 2, 3, 4, 5, 6]
    assert_same_run_as_baseline(out_b, rows_b, out_0, rows_0, ("checkpoint-3", "checkpoint-6"))


def test_ahead_with_still_weights_is_the_synchronous_run(setup):
    runs = {}
    for k in (0, 1):
        runs[k] = run(setup, f"still-{k}", 6, 2, ["--max-staleness", str(k), "--weight-sync-steps", "100",
                                                   "--save-steps", "2"])
    (out0, rows0, _), (out1, rows1, _) = runs[0], runs[1]
    assert sorted(rows0) == sorted(rows1) == [1, 2, 3, 4, 5, 6]
    for step in rows0:
        differing = [k for k in _differing_keys(rows0[step], rows1[step]) if not k.startswith("staleness/")]
        assert not differing, (step, {k: (rows0[step].get(k), rows1[step].get(k)) for k in differing})
        assert rows1[step]["samples_dropped_stale"] == 0 and rows1[step]["staleness/max"] == 0
    assert len({rows0[s]["loss"] for s in rows0}) > 1
    for ckpt in ("checkpoint-2", "checkpoint-4", "checkpoint-6"):
        state = [json.loads((out / ckpt / "trainer_state.json").read_text()) for out in (out0, out1)]
        assert state[0]["data_position"] == state[1]["data_position"], (ckpt, state)
        assert (out0 / ckpt / "model.safetensors").read_bytes() == (out1 / ckpt / "model.safetensors").read_bytes()
    # Resumed from checkpoint-2, the servers get its weights and keep them: the two resumed runs read the data from
    # the checkpoint's position (not past the round the first run had read ahead) and are the same run again.
    resumed = {k: run(setup, f"still-{k}-resumed", 6, 2, ["--max-staleness", str(k), "--weight-sync-steps", "100",
                                                          "--save-steps", "2", "--resume",
                                                          str(runs[k][0] / "checkpoint-2")])
               for k in (0, 1)}
    (res0, rrows0, _), (res1, rrows1, _) = resumed[0], resumed[1]
    assert sorted(rrows0) == sorted(rrows1) == [3, 4, 5, 6]
    for step in rrows0:
        differing = [k for k in _differing_keys(rrows0[step], rrows1[step]) if not k.startswith("staleness/")]
        assert not differing, (step, {k: (rrows0[step].get(k), rrows1[step].get(k)) for k in differing})
    assert (res0 / "checkpoint-6" / "model.safetensors").read_bytes() == \
        (res1 / "checkpoint-6" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("ahead", [1, 2])
def test_rounds_ahead_are_that_many_versions_stale(setup, ahead):
    out, rows, log = run(setup, f"stale-{ahead}", 6, 1, ["--max-staleness", str(ahead)])
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    per_round = 8   # one prompt of 8 completions per round on the one rank
    assert rows[1]["staleness/max"] == 0 and rows[1]["staleness/hist/0"] == per_round
    for s in range(1, 7):
        r = rows[s]
        assert r["samples_dropped_stale"] == 0, r
        assert sum(r[f"staleness/hist/{b}"] for b in range(ahead + 1)) == per_round, r
        assert r["staleness/max"] <= min(s - 1, ahead), r
        assert r["policy_version"] == s
        assert abs(sum(r[k] for k in PHASES) - r["step_wall_time"]) < 1e-6 * max(1.0, r["step_wall_time"]), r
        assert all(r[k] >= 0 for k in PHASES if k != "other_time"), r
        assert 0 < r["trainer_busy_fraction"] <= 1 and 0 <= r["rollout_busy_fraction"] <= 1.05, r
    # Once the ring is full, a round was sent `ahead` rounds before its training: sampled `ahead` versions before the
    # policy it trains (or fewer, when a push landed before the server began it).
    assert sum(rows[s][f"staleness/hist/{ahead}"] for s in range(ahead + 1, 7)) > 0
    assert "will be dropped" not in log


def test_rounds_too_old_are_dropped_and_counted(setup):
    out, rows, log = run(setup, "stale-drop", 6, 2, ["--max-staleness", "1", "--steps-per-generation", "2",
                                                     "--per-device-train-batch-size", "8"])
    assert "will be dropped" in log
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    per_round = 2 * 16   # two ranks, each two micro-steps of 8 completions per round
    dropped = 0
    for s in (1, 3, 5):   # each round's first step carries its metrics (the second repeats them)
        r = rows[s]
        kept = sum(r[f"staleness/hist/{b}"] for b in (0, 1))
        assert kept + r["samples_dropped_stale"] == per_round, r
        assert r["staleness/max"] <= 1
        dropped += r["samples_dropped_stale"]
        if r["samples_dropped_stale"] == per_round:
            assert r["num_items_in_batch"] == 0 and r["loss"] == 0, r
            assert r["num_tokens"] == rows[s - 1]["num_tokens"], r   # nothing trained on: the count stands
    assert rows[1]["samples_dropped_stale"] == 0
    assert dropped > 0


def _logps(model_dir, prompt, completion, temperature=1.0):
    """Per-token logprobs of completion after prompt under the weights in model_dir (transformers, fp32)."""
    import torch
    from transformers import AutoModelForCausalLM
    model = _logps.cache.get(model_dir)
    if model is None:
        model = _logps.cache[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1] / temperature
    return torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(completion)[:, None])[:, 0].numpy()


_logps.cache = {}


def _sequence_mask_ratio(old, sampled, clip_max=3.0):
    """TRL 1.16's vllm_importance_sampling_mode "sequence_mask" (the default; clip_min unset): exp of the summed
    log-difference, 0 when above clip_max (the formula tests/reference/test_grpo_vs_trl.py proves tandem's equal to
    TRL's own code)."""
    import numpy as np
    ratio = float(np.exp(np.sum(np.nan_to_num(np.asarray(old, dtype=np.float64) - np.asarray(sampled)))))
    return 0.0 if ratio > clip_max else ratio


def test_one_round_ahead_versions_and_importance_weights(setup):
    """max_staleness 1, a push every step, a checkpoint every step, log_completions: each completion trained at step
    s was sampled by version s - 2 (or s - 1 when the push landed before the server began it) and trained from
    policy version s - 1; its sampling logprobs are those weights' (transformers on checkpoint-v), its old logprobs
    the policy's (checkpoint-(s - 1)), and its importance-sampling weight is TRL's formula on them."""
    import numpy as np
    d, model_dir, _ = setup
    out, rows, _ = run(setup, "versions-1", 5, 1, ["--max-staleness", "1", "--save-steps", "1",
                                                   "--log-completions", "true"])
    weights = {0: str(model_dir), **{v: str(out / f"checkpoint-{v}") for v in range(1, 6)}}
    logged = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert sorted({c["step"] for c in logged}) == [1, 2, 3, 4, 5] and len(logged) == 5 * 8
    one_version = 0
    for c in logged:
        policy = c["step"] - 1                # one optimizer step per round, a push after each
        assert c["staleness"] == policy - c["version"] and c["kept"], c
        assert c["staleness"] == 0 if c["step"] == 1 else c["staleness"] in (0, 1), c
        old = _logps(weights[policy], c["prompt_ids"], c["completion_ids"])
        np.testing.assert_allclose(c["old_logps"], old, rtol=0, atol=2e-4)
        ratio = _sequence_mask_ratio(old, c["sampling_logps"])
        assert abs(c["importance_sampling_ratio"] - ratio) <= 1e-3 * max(1.0, ratio), (c, ratio)
        if c["version"] == c["version_end"]:   # sampled by one version throughout: the server's logprobs are its
            one_version += 1
            sampled = _logps(weights[c["version"]], c["prompt_ids"], c["completion_ids"])
            np.testing.assert_allclose(c["sampling_logps"], sampled, rtol=0, atol=2e-4)
    assert one_version >= len(logged) // 2
    assert sum(c["staleness"] == 1 for c in logged) > 0
    # Stale rounds move the weights: some importance weights are away from 1.
    assert any(abs(c["importance_sampling_ratio"] - 1) > 1e-4 for c in logged if c["staleness"] == 1)
