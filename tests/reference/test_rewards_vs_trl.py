"""tandem's built-in rewards against TRL's own reward functions (and Python's re for the regex reward).

- think_format   == trl.rewards.think_format_reward on ~3000 generated completions (tags in every order and
                    count, newlines, leading text, multi-byte characters, near-miss tags).
- soft_overlong  == trl.rewards.get_soft_overlong_punishment for every length 0..Lmax+5 and several
                    (Lmax, cache) pairs, compared bit for bit.
- regex_format   == re.fullmatch / re.search with TRL-style format patterns on the same completions: PCRE2
                    in tandem, Python's re in a TRL reward function, same verdicts.
The completions go through tests/reference/tools/trainer_rewards_tool.c (rewards_create + rewards_score).
"""
import json
import random
import re

import pytest
import trl.rewards as trl_rewards

from conftest import run_tool, tool

FRAGMENTS = ["<think>", "</think>", "<answer>", "</answer>", "reasoning", "42", " ", "\n", "\n\n", "x",
             "<think", "think>", "</think", "<THINK>", "é", "思考", "\t", "<think> ", "\\boxed{3}", "."]


def completions(n, seed):
    rng = random.Random(seed)
    out = ["", "<think></think>", "<think>\nok\n</think>\nanswer", " <think>a</think>",
           "<think>a<think>b</think>", "<think>a</think>b<think>", "<think>a</think></think>",
           "<think>\nx\n</think>\n<answer>\n5\n</answer>", "<think>x</think><answer>5</answer>\n"]
    while len(out) < n:
        k = rng.randint(1, 8)
        parts = [rng.choice(FRAGMENTS) for _ in range(k)]
        if rng.random() < 0.5:
            parts.insert(0, "<think>")
        out.append("".join(parts))
    return out


def score(rewards, samples, **options):
    payload = {"rewards": rewards, "options": options, "samples": samples}
    out = run_tool([tool("trainer_rewards_tool")], stdin=json.dumps(payload), timeout=60)
    return json.loads(out)["scores"]


def test_think_format_matches_trl():
    comps = completions(3000, seed=1)
    got = score(["think_format"], [{"completion": c, "completion_tokens": 1} for c in comps])
    want = trl_rewards.think_format_reward([[{"role": "assistant", "content": c}] for c in comps])
    mismatches = [(c, g[0], w) for c, g, w in zip(comps, got, want) if g[0] != w]
    assert not mismatches, f"{len(mismatches)} mismatches, first: {mismatches[:5]}"
    # The corpus exercises both outcomes.
    assert 0 < sum(want) < len(want)


@pytest.mark.parametrize("max_len,cache", [(100, 20), (64, 64), (50, 1), (30, 7), (16, 0)])
def test_soft_overlong_matches_trl(max_len, cache):
    lengths = list(range(0, max_len + 6))
    samples = [{"completion": "", "completion_tokens": n} for n in lengths]
    if cache == 0:
        # TRL divides by the cache only in the ramp, which is empty for cache 0; tandem refuses cache 0 at
        # creation (a soft punishment needs a ramp), so compare TRL with the formula's hard limit instead.
        want = trl_rewards.get_soft_overlong_punishment(max_len, cache)(completion_ids=[[0] * n for n in lengths])
        assert want == [0.0 if n <= max_len else -1.0 for n in lengths]
        return
    got = score(["soft_overlong"], samples, max_completion_length=max_len, soft_punish_cache=cache)
    want = trl_rewards.get_soft_overlong_punishment(max_len, cache)(completion_ids=[[0] * n for n in lengths])
    assert [g[0] for g in got] == want  # bit-identical doubles


PATTERNS = [
    r"^<think>.*?</think>\s*<answer>.*?</answer>$",
    r"<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>",
    r"(?s)<think>.*?</think>.*",
    r"<answer>\d+</answer>",
    r"\\boxed\{\d+\}",
]


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("mode", ["full", "search"])
def test_regex_format_matches_python_re(pattern, mode):
    comps = completions(1500, seed=2) + ["<think>\nx\n</think>\n<answer>\n5\n</answer>", "<answer>12</answer>",
                                          "so \\boxed{12}", "<think>a</think> <answer>b</answer>\n"]
    got = score(["regex_format"], [{"completion": c, "completion_tokens": 1} for c in comps],
                format_regex=pattern, format_regex_search=(mode == "search"))
    rx = re.compile(pattern)
    want = [1.0 if (rx.fullmatch(c) if mode == "full" else rx.search(c)) else 0.0 for c in comps]
    mismatches = [(c, g[0], w) for c, g, w in zip(comps, got, want) if g[0] != w]
    assert not mismatches, f"{len(mismatches)} mismatches, first: {mismatches[:5]}"
