"""Tool-call parsing (shared/tool_calls.c) against what TRL parses: transformers' tokenizer.parse_response with
TRL's response templates (trl.chat_template_utils.qwen3_template for Hermes/Qwen <tool_call>, llama3_template for
Llama 3.1 JSON calls), called through TRL's own parse_response. The texts are what the real chat templates render
for assistant messages with tool_calls (apply_chat_template). Mistral [TOOL_CALLS] has no parser in TRL 1.16 or
transformers 5.23, so it is covered by the C unit test only.

Difference kept on purpose: for a call TRL cannot parse, TRL falls back to plain text (no call, the episode ends);
tandem reports the broken call as an error the policy reads as the tool's answer. Both run no call for it."""
import json
import subprocess

import pytest
from conftest import tool
from transformers import AutoTokenizer
from trl.chat_template_utils import llama3_template, parse_response, qwen3_template

from test_chat_template import LLAMA31, QWEN25
from test_tokenizer_support import build_family


def fn(name, args):
    return {"type": "function", "function": {"name": name, "arguments": args}}


CONVERSATIONS = [  # (content, tool_calls)
    ("", [fn("get_weather", {"city": "Paris", "days": 3})]),
    ("Let me compute that.", [fn("calculator", {"expression": "123456789 * 987654321"})]),
    ("", [fn("lookup", {"key": "capital of France"}), fn("calculator", {"expression": "(2+3)*4.5"})]),
    ("", [fn("nested", {"a": [1, 2, {"b": None, "c": True}], "s": "quote \" and \\ and ünïcode"})]),
    ("", [fn("no_args", {})]),
]

CASES = {
    "hermes": (QWEN25, "qwen2", None, "<|im_end|>", qwen3_template),
    "llama3": (LLAMA31, "llama3", "<|begin_of_text|>", "<|eot_id|>", llama3_template),
}


@pytest.fixture(scope="module")
def cli():
    proc = subprocess.Popen([tool("tool_calls_cli")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            encoding="utf-8")

    def ask(fmt, text):
        proc.stdin.write(json.dumps({"format": fmt, "text": text}) + "\n")
        proc.stdin.flush()
        answer = json.loads(proc.stdout.readline())
        assert "failure" not in answer, answer
        return answer
    yield ask
    proc.stdin.close()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    out = {}
    for fmt, (template, family, bos, eos, response_template) in CASES.items():
        d = tmp_path_factory.mktemp(fmt)
        build_family(family, d)
        (d / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
            "chat_template": template}))
        tok = AutoTokenizer.from_pretrained(str(d))
        tok.response_template = response_template
        out[fmt] = tok
    return out


def assistant_turn(tok, content, calls):
    """The assistant turn as the real template renders it, and the prompt ids before it."""
    user = [{"role": "user", "content": "What is it?"}]
    prefix = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template(user + [{"role": "assistant", "content": content, "tool_calls": calls}],
                                   tokenize=False)
    assert full.startswith(prefix)
    return full[len(prefix):], tok(prefix, add_special_tokens=False)["input_ids"]


def trl_parse(tok, text, prefix_ids):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return parse_response(tok, ids, prefix=prefix_ids)


def calls_of(parsed):
    return [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.get("tool_calls") or []]


@pytest.mark.parametrize("fmt", list(CASES))
def test_calls_equal_trl(fmt, tokenizers, cli):
    tok = tokenizers[fmt]
    checked = 0
    for content, calls in CONVERSATIONS:
        if fmt == "llama3" and (len(calls) != 1 or content):
            continue  # Llama 3.1's template raises for several calls and writes no content beside a call
        text, prefix_ids = assistant_turn(tok, content, calls)
        want = trl_parse(tok, text, prefix_ids)
        got = cli(fmt, text)
        assert got["error"] is None, (text, got)
        assert [(c["name"], c["arguments"]) for c in got["tool_calls"]] == calls_of(want), text
        assert calls_of(want) == [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
        assert got["content"] == want["content"].strip(), text
        checked += 1
    assert checked >= 2


@pytest.mark.parametrize("fmt", list(CASES))
def test_plain_answers_equal_trl(fmt, tokenizers, cli):
    tok = tokenizers[fmt]
    for content in ["The answer is 42.", "Two lines\nof text."]:
        user = [{"role": "user", "content": "q"}]
        prefix = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template(user + [{"role": "assistant", "content": content}], tokenize=False)
        text = full[len(prefix):]
        want = trl_parse(tok, text, tok(prefix, add_special_tokens=False)["input_ids"])
        got = cli(fmt, text)
        assert got["tool_calls"] == [] and not want.get("tool_calls")
        assert got["content"] == want["content"].strip() == content


BROKEN = {
    "hermes": ['<tool_call>\n{"name": "calculator", "arguments": {"expression": 2+2}}\n</tool_call><|im_end|>',
               '<tool_call>\n{"arguments": {"x": 1}}\n</tool_call><|im_end|>',
               '<tool_call>\n{"name": "calculator", "argu'],
    "llama3": ['{"name": "calculator", "parameters": {"expression": 2+2}}<|eot_id|>',
               '{"name": "calculator", "parameters": {"expression": "1+'],
}


@pytest.mark.parametrize("fmt", list(CASES))
def test_broken_calls_run_nothing(fmt, tokenizers, cli):
    """TRL runs no call for these (it falls back to text); tandem runs none either and says why."""
    tok = tokenizers[fmt]
    user = [{"role": "user", "content": "q"}]
    prefix = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    prefix_ids = tok(prefix, add_special_tokens=False)["input_ids"]
    for text in BROKEN[fmt]:
        want = trl_parse(tok, text, prefix_ids)
        got = cli(fmt, text)
        assert not want.get("tool_calls"), (text, want)
        assert got["tool_calls"] == [], (text, got)
        assert got["error"] and "tool call 1" in got["error"], got
