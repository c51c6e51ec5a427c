"""tandem-train GRPO over multi-turn tool-use trajectories, end to end on CPU: one rollout server, one or two trainer
ranks, the built-in calculator (--tools calculator), the tiny test model.

A random tiny model never writes a tool call, so the test first teaches it (a few hundred Adam steps in PyTorch on
the exact token sequences) to answer "What is A * B?" with a calculator call, and, after the tool's answer, with
"The answer is N." Then GRPO runs with answer_match on the final answer. Checked: the run exits 0; metrics carry
TRL's tool metrics (tools/call_frequency, tools/failure_frequency) and tandem's (tools/turns_mean,
tools/environment_time); completions.jsonl rows are whole trajectories whose tool turns are the calculator's
rendered answers with tool_mask 0 and whose assistant tokens have tool_mask 1 and their sampling logprobs;
completions/mean_length counts only the policy's tokens (as TRL counts them); the final-answer reward is high.
"""
import json
import sys
import pathlib

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from server_fixtures import TandemServer, build_tiny_model, free_port  # noqa: E402
from test_train_grpo import launch, train_binary  # noqa: E402

QUESTIONS = [(123456789, 987654321), (4321, 8765), (99991, 77773), (2024, 1111)]


def call(a, b):
    return "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": f"{a} * {b}"}}) + \
        "\n</tool_call>"


def teach_tool_use(model_dir):
    """Overfits the tiny model on the trajectories of QUESTIONS (loss on the assistant turns only)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    seqs = []
    for a, b in QUESTIONS:
        prompt = tok.apply_chat_template([{"role": "user", "content": f"What is {a} * {b}?"}],
                                         add_generation_prompt=True, tokenize=True, return_dict=False)
        turn1 = tok(call(a, b), add_special_tokens=False)["input_ids"] + [eos]
        # the tool turn as tandem renders it for this plain ChatML template (trainer/tool_turn_render.c)
        tool = tok(f"\n<|im_start|>tool\n{a * b}<|im_end|>\n<|im_start|>assistant\n",
                   add_special_tokens=False)["input_ids"]
        turn2 = tok(f"The answer is {a * b}.", add_special_tokens=False)["input_ids"] + [eos]
        ids = prompt + turn1 + tool + turn2
        labels = [-100] * len(prompt) + turn1 + [-100] * len(tool) + turn2
        seqs.append((ids, labels))
    width = max(len(i) for i, _ in seqs)
    ids = torch.tensor([i + [0] * (width - len(i)) for i, _ in seqs])
    labels = torch.tensor([l + [-100] * (width - len(l)) for _, l in seqs])
    attn = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in seqs])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for _ in range(400):
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.02:
            break
    assert loss.item() < 0.1, f"the tiny model did not learn the tool calls (loss {loss.item():.3f})"
    model.save_pretrained(str(model_dir), safe_serialization=True)


@pytest.mark.parametrize("world", [1, 2])
def test_grpo_with_calculator(tmp_path, world):
    model_dir = tmp_path / "model"
    build_tiny_model(model_dir)
    teach_tool_use(model_dir)
    data = tmp_path / "train.jsonl"
    with open(data, "w") as f:
        for i in range(16):
            a, b = QUESTIONS[i % len(QUESTIONS)]
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"What is {a} * {b}?"}],
                                "answer": str(a * b)}) + "\n")
    out_dir = tmp_path / "run"
    control = f"tcp://127.0.0.1:{free_port()}"
    args = ["--model", str(model_dir), "--train-file", str(data), "--output-dir", str(out_dir),
            "--rollout-servers", control, "--rewards", "answer_match", "--tools", "calculator",
            "--max-tool-calling-iterations", "2", "--num-generations", "4", "--per-device-train-batch-size", "4",
            "--gradient-accumulation-steps", "1", "--max-completion-length", "256", "--max-prompt-length", "64",
            "--learning-rate", "1e-4", "--max-steps", "3", "--logging-steps", "1", "--save-steps", "0",
            "--log-completions", "true", "--seed", "3", "--init-timeout", "60", "--comm-timeout", "20",
            "--rollout-timeout", "60", "--temperature", "0.7"]
    with TandemServer(model_dir, "--control", control):
        procs = launch(args, world, free_port(), tmp_path)
        codes = [p.wait(timeout=600) for p, _ in procs]
        for _, log in procs:
            log.close()
    logs = "\n".join((tmp_path / f"rank{r}.log").read_text() for r in range(world))
    assert codes == [0] * world, logs
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for r in rows:
        for key in ("tools/call_frequency", "tools/failure_frequency", "tools/turns_mean", "tools/environment_time"):
            assert key in r, key
    assert sum(r["tools/call_frequency"] for r in rows) / 3 > 0.5, rows
    assert sum(r["tools/turns_mean"] for r in rows) / 3 > 1.5, rows
    assert sum(r["reward"] for r in rows) / 3 > 0.5, rows

    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    comps = [json.loads(line) for line in (out_dir / "completions.jsonl").read_text().splitlines()]
    assert len(comps) == 3 * 4   # rank 0's completions
    with_tools = 0
    for c in comps:
        ids, mask, lps = c["completion_ids"], c["tool_mask"], c["sampling_logps"]
        assert len(ids) == len(mask) == len(lps)
        tool_ids = [i for i, m in zip(ids, mask) if m == 0]
        assert all(lp == 0 for lp, m in zip(lps, mask) if m == 0)
        assert all(lp <= 0 for lp in lps)
        if c["turns"] >= 2:   # a tool turn: the calculator's answer, or the error of an unreadable call
            with_tools += 1
            text = tok.decode(tool_ids)
            assert text.startswith("\n<|im_start|>tool\n") and "<|im_start|>assistant\n" in text, text
            prompt = tok.decode(c["prompt_ids"])
            a, b = next((a, b) for a, b in QUESTIONS if f"{a} * {b}" in prompt)
            if "error" not in text:
                assert f"tool\n{a * b}<|im_end|>" in text
            assert c["tool_calls"] >= 1 and 0 in mask and mask[0] == 1
        else:
            assert all(m == 1 for m in mask)
    assert with_tools >= 6
    # completions/mean_length: the policy's tokens only (tool turns are not counted), per step (one rank: its rows
    # are the whole batch)
    for step, r in enumerate(rows if world == 1 else [], start=1):
        mine = [sum(c["tool_mask"]) for c in comps if c["step"] == step]
        assert r["completions/mean_length"] == pytest.approx(sum(mine) / len(mine))


def test_grpo_with_environment_service(tmp_path):
    """The same task through the example environment service (examples/environments/arithmetic_env.py, its own
    process): its calculator answers the calls, its reward on the final answer is the only reward function
    ("environment", as TRL logs an environment's get_reward under its own name)."""
    import re
    import subprocess
    model_dir = tmp_path / "model"
    build_tiny_model(model_dir)
    teach_tool_use(model_dir)
    data = tmp_path / "train.jsonl"
    with open(data, "w") as f:
        for i in range(8):
            a, b = QUESTIONS[i % len(QUESTIONS)]
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"What is {a} * {b}?"}],
                                "answer": str(a * b)}) + "\n")
    example = pathlib.Path(__file__).resolve().parents[2] / "examples" / "environments" / "arithmetic_env.py"
    env_proc = subprocess.Popen([sys.executable, str(example), "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        env_url = re.search(r"http://\S+", env_proc.stdout.readline()).group(0)
        out_dir = tmp_path / "run"
        control = f"tcp://127.0.0.1:{free_port()}"
        args = ["--model", str(model_dir), "--train-file", str(data), "--output-dir", str(out_dir),
                "--rollout-servers", control, "--env-url", env_url, "--env-timeout", "10",
                "--num-generations", "4", "--per-device-train-batch-size", "4", "--gradient-accumulation-steps", "1",
                "--max-completion-length", "256", "--max-prompt-length", "64", "--learning-rate", "1e-4",
                "--max-steps", "2", "--logging-steps", "1", "--save-steps", "0", "--seed", "5",
                "--init-timeout", "60", "--comm-timeout", "20", "--rollout-timeout", "60", "--temperature", "0.7"]
        with TandemServer(model_dir, "--control", control):
            procs = launch(args, 1, free_port(), tmp_path)
            code = procs[0][0].wait(timeout=600)
            procs[0][1].close()
    finally:
        env_proc.terminate()
        env_proc.wait(timeout=10)
    log = (tmp_path / "rank0.log").read_text()
    assert code == 0, log
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert r["rewards/environment/mean"] == pytest.approx(r["reward"])
    assert sum(r["reward"] for r in rows) / 2 > 0.5, rows
    assert sum(r["tools/call_frequency"] for r in rows) / 2 > 0.5, rows
