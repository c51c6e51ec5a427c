"""`tandem-train demo --task tools` end to end: a + b with 5-digit operands, answered through the built-in calculator
over multi-turn rollouts (SFT warm-up on tool-using transcripts, then GRPO with --tools calculator against a rollout
server), evaluated by greedy multi-turn episodes through the server's OpenAI API.

- The full default run (CPU, 2 threads, about a minute): held-out success before GRPO below 70 %, after above 90 %,
  GRPO stopped by its validation rule; every held-out episode called the calculator, the calculator's answer is in
  the trajectory as a tool turn, and a solved episode's final answer is exactly "=" and the sum; the
  training metrics carry the tool metrics; summary, metrics and SVG written as for the default demo.
- A small configuration that runs every phase in seconds: the data (chat prompts, SFT transcripts with the
  calculator call) and the trajectories of its evaluations (tool calls, the calculator's answers).
- The tools task's tokenizer and model load in Hugging Face tokenizers and transformers, and its chat template
  renders the SFT transcripts as the trajectories GRPO builds.
"""
import json
import re

import pytest

from test_demo import check_outputs, run_demo

SMALL = ["--task", "tools", "--train-size", 600, "--heldout-size", 20, "--validation-size", 20, "--sft-size", 600,
         "--sft-min-steps", 10, "--sft-check-every", 10, "--sft-max-steps", 20, "--prompts-per-step", 8,
         "--eval-every", 2]
CALL = re.compile(r'^<tool_call>\{"name": "calculator", "arguments": \{"expression": "([^"]*)"\}\}</tool_call>'
                  r'<\|im_end\|>\n<\|im_start\|>tool\n(.*?)<\|im_end\|>\n<\|im_start\|>assistant\n(.*?)(?:<\|im_end\|>)?$',
                  re.S)


def eval_rows(out, step):
    return [json.loads(line) for line in (out / "eval" / f"step-{step:04d}.jsonl").read_text().splitlines()]


def heldout(out):
    return [json.loads(line) for line in (out / "data" / "heldout.jsonl").read_text().splitlines()]


def test_full_tools_demo_learns_to_use_the_calculator(tmp_path):
    out = tmp_path / "demo"
    proc, wall = run_demo(out, "--task", "tools", timeout=1200)
    summary = json.loads((out / "demo_summary.json").read_text())
    before, after = summary["accuracy_before"], summary["accuracy_after"]
    print(f"tools demo: held-out success {before:.3f} -> {after:.3f} in {wall:.0f} s")
    assert before < 0.7, summary["evaluations"]
    assert after > 0.9, summary["evaluations"]
    assert summary["grpo"]["stopped_by"] == "validation target reached", summary["evaluations"]
    assert summary["task"].startswith("tools: ")
    check_outputs(out, summary)
    # Recount the last held-out evaluation from its trajectories: a calculator call with the problem's operands,
    # the calculator's exact sum as the tool turn, then the final answer; solved = the final answer is that sum.
    problems = heldout(out)
    rows = eval_rows(out, summary["grpo"]["steps"])
    assert len(rows) == len(problems)
    solved = copied = 0
    for r, p in zip(rows, problems):
        a, b = map(int, p["prompt"][0]["content"].split("+"))
        assert r["tool_calls"] >= 1, r   # every episode handed the problem to the calculator
        m = CALL.match(r["trajectory"])
        ok = bool(m) and m.group(3) == f"={a + b}"   # the final answer: "=" and the sum, nothing else
        assert ok == r["exact"], r
        if m and re.fullmatch(r"\d+\+\d+", m.group(1)):
            assert m.group(2) == str(eval(m.group(1))), r   # the calculator's answer, rendered as a tool turn
            copied += m.group(1) == f"{a}+{b}"              # the operands the policy copied into the call
        if ok:
            assert r["tool_failures"] == 0 and r["turns"] == 2 and m.group(1) == f"{a}+{b}", r
        solved += ok
    assert solved / len(problems) == pytest.approx(summary["exact_after"])
    assert summary["exact_after"] > 0.9 and after >= summary["exact_after"]   # answer_match counts these and more
    assert copied >= solved, (copied, solved)   # success comes from handing the problem over, not from guessing
    assert summary["calculator_calls_after"] >= 0.95
    # The training metrics: every GRPO step made calls, the tool turns out of the loss (lengths count the policy's
    # tokens only: a trajectory's whole completion is longer).
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(m["tools/call_frequency"] > 0.5 for m in metrics[-5:]), metrics[-1]
    assert metrics[-1]["tools/failure_frequency"] < 0.1 and metrics[-1]["tools/turns_mean"] > 1.5, metrics[-1]
    assert metrics[-1]["completions/max_length"] <= summary["grpo"]["max_completion_length"]
    assert "held-out accuracy" in proc.stdout.strip().splitlines()[-1]


def test_small_tools_configuration_runs_every_phase(tmp_path):
    out = tmp_path / "demo"
    run_demo(out, *SMALL, "--grpo-steps", 4, timeout=300)
    summary = json.loads((out / "demo_summary.json").read_text())
    assert [e["step"] for e in summary["evaluations"]] == [0, 2, 4]
    check_outputs(out, summary)
    data = {n: [json.loads(line) for line in (out / "data" / n).read_text().splitlines()]
            for n in ("train.jsonl", "validation.jsonl", "heldout.jsonl", "sft.jsonl")}
    for r in data["train.jsonl"] + data["heldout.jsonl"]:
        (msg,) = r["prompt"]
        a, b = map(int, msg["content"].split("+"))
        assert msg["role"] == "user" and 50000 <= a <= 99999 and 50000 <= b <= 99999 and r["answer"] == str(a + b)
    for r in data["sft.jsonl"]:
        call, tool, answer = r["completion"]
        expr = r["prompt"][0]["content"]
        assert call == {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": '
                        '{"expression": "' + expr + '"}}</tool_call>'}
        assert tool == {"role": "tool", "content": str(eval(expr))} and answer["content"] == "=" + tool["content"]
    # The evaluations ran multi-turn episodes: the trajectories that called the calculator hold its answer.
    rows = eval_rows(out, 4)
    called = [r for r in rows if r["tool_calls"] > r["tool_failures"]]
    assert summary["calculator_calls_after"] == pytest.approx(len(called) / len(rows))
    answered = 0
    for r in called:   # a tool answer that would pass the completion budget is dropped (as TRL drops it)
        expr = re.search(r'"expression": "([^"]*)"', r["trajectory"]).group(1)
        turn = re.search(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", r["trajectory"], re.S)
        if turn and re.fullmatch(r"\d+(\+\d+)?", expr):
            assert turn.group(1) == str(eval(expr)), r
            answered += 1
    assert answered > 0, rows


def test_tools_model_folder_loads_in_hf_and_renders_the_transcripts(tmp_path):
    """The SFT transcript rendered by transformers with the folder's chat template is the prompt + the trajectory
    GRPO builds (tool turn as tandem renders it for this plain ChatML template), token for token."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "demo"
    run_demo(out, *SMALL, "--grpo-steps", 1, "--eval-every", 1, timeout=300)
    hf = transformers.AutoTokenizer.from_pretrained(str(out / "model"))
    row = json.loads((out / "data" / "sft.jsonl").read_text().splitlines()[0])
    prompt = hf.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
    full = hf.apply_chat_template(row["prompt"] + row["completion"], tokenize=False)
    call, tool, answer = (m["content"] for m in row["completion"])
    assert full == prompt + call + "<|im_end|>\n<|im_start|>tool\n" + tool + "<|im_end|>\n<|im_start|>assistant\n" + \
        answer + "<|im_end|>\n"
    ids = hf(call, add_special_tokens=False).input_ids
    assert len(ids) == 2 * 5 + 1 + 4   # <tool_call>, the call's fixed prefix, a+b, its suffix, </tool_call>
    assert hf.eos_token == "<|im_end|>"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out / "model"))
    assert model.config.vocab_size == len(hf)
