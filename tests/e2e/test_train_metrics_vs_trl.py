"""metrics.jsonl against TRL's own GRPOTrainer logs (issue 27): the same tiny model, data and settings, two
optimizer steps each, on the CPU (seconds). TRL's trainer runs unmodified (generation with transformers, its
reward function named like tandem's built-in, so that rewards/<name>/* line up); tandem-train runs against a
tandem-serve.

- Key sets: every key TRL logs at a training step is in tandem's rows, except TRL_ONLY (none today); every key
  tandem writes beyond TRL's is in TANDEM_ONLY (documented in docs/training.md) — a new key in either run fails
  here until it is listed.
- Meanings, where both runs allow them to be checked (the completions themselves differ: each side samples with
  its own random numbers). The model's EOS row is tilted so that about 1 token in 8 is EOS: some completions end,
  others are cut at max_completion_length, and both kinds of length metric see both.
  * num_tokens is cumulative prompt + completion tokens: num_tokens[k] - num_tokens[k-1] - B * mean_length[k] is
    B times the prompt's length, the same integer in both runs (one prompt, repeated);
  * epoch, learning_rate and kl (0: the policy is the reference before the first update... and after it, kl is
    measured on the round's own samples) agree; min_length <= mean_length <= max_length <= max_completion_length,
    and the *_terminated_length keys are 0 when every completion was clipped (TRL's convention), else bracket
    their mean; clip_ratio/low_min <= low_mean and high_mean <= high_max;
  * the completions/* metrics of each run equal what its own completions give under TRL's definitions: a
    completion's length counts its tokens, EOS included; it is clipped when its last token is not EOS, and the
    terminated lengths are those of the others (0, 0, 0 when none ended). TRL's completions come from its reward
    function's completion_ids, tandem's from completions.jsonl;
  * tandem's num_tokens also equals the tokens of its completions.jsonl (prompt_ids + completion_ids), summed.
"""
import contextlib
import json
import math
import re
import sys
import pathlib

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from server_fixtures import TandemServer, build_tiny_model, free_port  # noqa: E402
from test_train_grpo import launch  # noqa: E402

trl = pytest.importorskip("trl")

PROMPT = "numbers plus 7"
ROWS, G, MAX_LEN, STEPS = 16, 8, 8, 2

# Keys TRL logs at a training step that tandem does not write (none: tandem writes every one).
TRL_ONLY = set()
# Keys tandem writes that TRL does not (docs/training.md, metrics.jsonl, says what each is).
TANDEM_ONLY = {
    "step", "elapsed", "num_items_in_batch", "policy_version", "prompts_skipped",
    "rollout_time", "reward_time", "train_time", "sync_time", "sync_transfer_time", "sync_begin_time",
    "sync_end_time", "sync_commit_time", "sync_bytes", "step_wall_time", "other_time", "refresh_time",
    "generate_issue_time", "generate_wait_time", "rewards_phase_time", "old_logps_time", "ref_logps_time",
    "forward_backward_time", "optimizer_time", "weight_sync_phase_time", "log_time", "checkpoint_time",
    "reward_overlap_time", "logps_overlap_time", "train_overlap_time", "trainer_busy_fraction",
    "rollout_busy_fraction", "staleness/mean", "staleness/max", "staleness/hist/0", "samples_dropped_stale",
}


TRL_COMPLETIONS = []   # the completion_ids TRL's reward function was given, one list per generation round


def regex_format(completions, completion_ids=None, **kwargs):
    """tandem's built-in regex_format with --format-regex [0-9] --format-regex-mode search, as a TRL reward."""
    TRL_COMPLETIONS.append([list(ids) for ids in completion_ids])
    return [1.0 if re.search("[0-9]", c) else 0.0 for c in completions]


def tilt_toward_eos(model_dir, p_eos=0.12):
    """Sets the lm_head row of EOS along the mean final hidden state of a few sampled continuations, so that EOS
    gets about p_eos of the probability at a typical position (the random tiny model almost never ends)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(0)
    ids = tok(PROMPT, return_tensors="pt").input_ids.repeat(16, 1)
    with torch.no_grad():
        seqs = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=MAX_LEN,
                              pad_token_id=tok.eos_token_id)
        h = model(seqs, output_hidden_states=True).hidden_states[-1].reshape(-1, model.config.hidden_size)
        lse = torch.logsumexp(h @ model.lm_head.weight.T, -1).mean().item()
        mean_h = h.mean(0)
        model.lm_head.weight[tok.eos_token_id] = (lse + math.log(p_eos / (1 - p_eos))) * mean_h / mean_h.dot(mean_h)
    model.save_pretrained(model_dir)
    return tok.eos_token_id


def length_metrics(completions, eos):
    """TRL's completions/* of one round from its completions' token ids."""
    lengths = [len(c) for c in completions]
    ended = [len(c) for c in completions if c and c[-1] == eos]
    term = ended or [0]
    return {"completions/mean_length": sum(lengths) / len(lengths), "completions/min_length": min(lengths),
            "completions/max_length": max(lengths),
            "completions/clipped_ratio": 1 - len(ended) / len(lengths),
            "completions/mean_terminated_length": sum(term) / len(term),
            "completions/min_terminated_length": min(term), "completions/max_terminated_length": max(term)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    d = tmp_path_factory.mktemp("metrics-vs-trl")
    model_dir = d / "model"
    build_tiny_model(model_dir)
    eos = tilt_toward_eos(model_dir)
    settings = dict(max_steps=STEPS, per_device_train_batch_size=G, num_generations=G, max_completion_length=MAX_LEN,
                    logging_steps=1, beta=0.04, learning_rate=1e-2, seed=3, loss_type="grpo")

    args = GRPOConfig(output_dir=str(d / "trl"), use_cpu=True, bf16=False, report_to=[], save_strategy="no",
                      **settings)
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=regex_format, args=args,
                          train_dataset=Dataset.from_list([{"prompt": PROMPT}] * ROWS),
                          processing_class=AutoTokenizer.from_pretrained(model_dir))
    trainer.train()
    trl_rows = {e["step"]: e for e in trainer.state.log_history if "loss" in e}
    assert len(TRL_COMPLETIONS) == STEPS, len(TRL_COMPLETIONS)   # one round per step

    data = d / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": PROMPT}) + "\n" for _ in range(ROWS)))
    # The same settings through a config file with TRL's names.
    (d / "grpo.json").write_text(json.dumps(settings))
    out = d / "tandem"
    control = f"tcp://127.0.0.1:{free_port()}"
    with TandemServer(model_dir, "--control", control):
        procs = launch(["--config", str(d / "grpo.json"), "--model", str(model_dir), "--train-file", str(data),
                        "--output-dir", str(out), "--rollout-servers", control, "--rewards", "regex_format",
                        "--format-regex", "[0-9]", "--format-regex-mode", "search", "--log-completions", "true",
                        "--save-steps", "0", "--device", "cpu", "--init-timeout", "60"], 1, free_port(), d)
        code = procs[0][0].wait(timeout=300)
        procs[0][1].close()
    assert code == 0, (d / "rank0.log").read_text()
    rows = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    completions = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    return trl_rows, rows, completions, eos


def test_key_sets(runs):
    trl_rows, rows, _, _ = runs
    assert sorted(trl_rows) == sorted(rows) == list(range(1, STEPS + 1))
    for step in rows:
        trl_keys, ours = set(trl_rows[step]), set(rows[step])
        missing = trl_keys - ours - TRL_ONLY
        assert not missing, f"TRL logs {sorted(missing)}, tandem does not (add them, or list them in TRL_ONLY)"
        extra = ours - trl_keys - TANDEM_ONLY
        assert not extra, f"tandem writes {sorted(extra)}, TRL does not: document them and list them in TANDEM_ONLY"
    shared = sorted(set(trl_rows[1]) & set(rows[1]))
    print("shared keys:", shared)
    for key in ("num_tokens", "epoch", "completions/min_length", "completions/max_length",
                "completions/mean_terminated_length", "completions/min_terminated_length",
                "completions/max_terminated_length", "completions/clipped_ratio", "clip_ratio/low_min",
                "clip_ratio/high_max"):
        assert key in shared, key


def prompt_tokens(rows, step):
    """num_tokens' growth at step less its completions' tokens, per completion: the prompt's length."""
    before = rows[step - 1]["num_tokens"] if step > 1 else 0
    return (rows[step]["num_tokens"] - before - G * rows[step]["completions/mean_length"]) / G


def test_shared_keys_mean_what_trl_means(runs):
    trl_rows, rows, completions, eos = runs
    for step in rows:
        ours, theirs = rows[step], trl_rows[step]
        # Cumulative prompt + completion tokens: the same prompt length falls out of both, every step.
        p_ours, p_trl = prompt_tokens(rows, step), prompt_tokens(trl_rows, step)
        assert p_ours == p_trl and p_ours == int(p_ours) and p_ours > 0, (step, p_ours, p_trl)
        assert ours["epoch"] == pytest.approx(theirs["epoch"]) == pytest.approx(step * 1 / ROWS)
        assert ours["learning_rate"] == pytest.approx(theirs["learning_rate"])
        if step == 1:   # the policy is the reference until the first update
            assert ours["kl"] == theirs["kl"] == 0
        for r in (ours, theirs):
            assert r["completions/min_length"] <= r["completions/mean_length"] <= r["completions/max_length"] <= MAX_LEN
            if r["completions/clipped_ratio"] == 1:
                assert r["completions/mean_terminated_length"] == r["completions/min_terminated_length"] == \
                    r["completions/max_terminated_length"] == 0
            else:
                assert r["completions/min_terminated_length"] <= r["completions/mean_terminated_length"] <= \
                    r["completions/max_terminated_length"]
            assert r["clip_ratio/low_min"] <= r["clip_ratio/low_mean"] and \
                r["clip_ratio/high_mean"] <= r["clip_ratio/high_max"]
            assert all(not (isinstance(v, float) and math.isnan(v)) for v in r.values())
    # Each run's length metrics are TRL's definitions applied to its own completions; between them, both runs saw
    # completions that ended and completions that were cut.
    ends = set()
    for step in rows:
        ours = [c["completion_ids"] for c in completions if c["step"] == step]
        assert len(ours) == G
        assert all(c["truncated"] == (c["completion_ids"][-1] != eos) for c in completions if c["step"] == step)
        for got, ids in ((rows[step], ours), (trl_rows[step], TRL_COMPLETIONS[step - 1])):
            want = length_metrics(ids, eos)
            for key, value in want.items():
                assert got[key] == pytest.approx(value), (step, key, got[key], value)
            ends.add(0 < want["completions/clipped_ratio"] < 1)
    assert True in ends, "no round had both ended and cut completions: the EOS tilt is off"
    # tandem's count is its completions' prompt and completion tokens, summed over the steps so far.
    for step in rows:
        seen = sum(len(c["prompt_ids"]) + len(c["completion_ids"]) for c in completions if c["step"] <= step)
        assert rows[step]["num_tokens"] == seen
