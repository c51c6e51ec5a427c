"""The tools' definitions in the prompt of a multi-turn run (trainer/tool_prompt.h), against what TRL renders when
GRPOTrainer is given tools=[...]: transformers' apply_chat_template(prompt, tools=<the Python functions>,
add_generation_prompt=True), which turns each function into its JSON schema with get_json_schema.

Checked: the built-in tools' schemas (trainer/tool_builtin.c) are exactly (keys in order) what get_json_schema
derives from equivalent typed Python functions with Google-style docstrings; a row's prompt ids, rendered and
tokenized by the trainer's own data path (data_parse_row with the tool prompt's render options), equal
apply_chat_template(..., tools=[calculator, lookup]) for Qwen2.5, Qwen3, Llama 3.1 and Mistral v0.3 templates;
a template without a `tools` block renders the prompt without them, as transformers does; an environment service's
definitions (POST <url>/tools) are used, its absence (404) means none, and a malformed answer is an error naming
the field."""
import json

import pytest
from transformers import AutoTokenizer
from transformers.utils import get_json_schema

from test_chat_template import CASES, build_folders
from test_env_service import EnvTool, Server, send


def calculator(expression: str) -> str:
    """
    Evaluates an arithmetic expression exactly.

    Args:
        expression: The expression: integers or decimals with + - * / % // ^ ** and parentheses, e.g. "123456789 * 987654321".

    Returns:
        The exact result (integers up to 38 digits), or {"error": ...} when it cannot be computed.
    """


def lookup(key: str) -> str:
    """
    Returns the value stored under a key in a small table.

    Args:
        key: The key to look up.

    Returns:
        The value, or {"error": ...} naming known keys.
    """


def test_builtin_schemas_are_what_transformers_derives():
    env = EnvTool("builtin")   # the tool's builtin box has the lookup table, so both tools
    got = env.ask(op="tools")["tools"]
    want = [get_json_schema(calculator), get_json_schema(lookup)]
    assert json.dumps(got) == json.dumps(want)   # keys in the same order: the templates' tojson writes them so
    env.close()


PROMPTS = [
    [{"role": "user", "content": "What is 123456789 * 987654321?"}],
    [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 12 + 30?"}],
]
WRITTEN = {"qwen2.5", "qwen3", "llama3.1", "mistral-v0.3"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return build_folders(tmp_path_factory, sorted(WRITTEN | {"chatml", "llama3"}))


@pytest.mark.parametrize("case", sorted(WRITTEN | {"chatml", "llama3"}))
def test_prompt_ids_equal_apply_chat_template_with_tools(folders, case):
    auto = AutoTokenizer.from_pretrained(str(folders[case]))
    env = EnvTool("builtin")
    for msgs in PROMPTS:
        got = env.ask(op="prompt", model=str(folders[case]), row={"prompt": msgs, "answer": "1"})
        assert "error" not in got, got
        want = auto.apply_chat_template(msgs, tools=[calculator, lookup], add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
        assert got["ids"] == list(want), f"{case}\n{got['text']}\n---\n{auto.decode(want)}"
        assert got["written"] == (case in WRITTEN)
        if case in WRITTEN:   # the definitions are in the prompt: the names and the argument's description
            assert "calculator" in got["text"] and "The key to look up." in got["text"]
        else:                 # a template without a `tools` block: the same prompt as without tools
            assert got["ids"] == list(auto.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                               return_dict=False))
    env.close()


SERVICE_TOOLS = [{"type": "function", "function": {
    "name": "guess", "description": "Checks a guess of the secret number.",
    "parameters": {"type": "object", "properties": {"n": {"type": "integer", "description": "The guess."}},
                   "required": ["n"]}}}]


def test_service_tool_definitions(folders):
    seen = []

    def respond(h, path, body, n):
        seen.append((path, body))
        if path.endswith("/tools"):
            send(h, {"tools": SERVICE_TOOLS})
        else:
            send(h, {"error": "not here"}, 404)

    server = Server(respond)
    env = EnvTool(server.url)
    assert env.ask(op="tools") == {"tools": SERVICE_TOOLS}
    assert seen[-1] == ("/env/tools", {})
    msgs = PROMPTS[0]
    for case in ("qwen2.5", "llama3.1"):
        got = env.ask(op="prompt", model=str(folders[case]), row={"prompt": msgs})
        auto = AutoTokenizer.from_pretrained(str(folders[case]))
        assert got["ids"] == list(auto.apply_chat_template(msgs, tools=SERVICE_TOOLS, add_generation_prompt=True,
                                                           tokenize=True, return_dict=False))
    env.close()
    server.close()


def test_service_without_tools_call_gives_none(folders):
    server = Server(lambda h, path, body, n: send(h, {"error": f"no such call {path}"}, 404))
    env = EnvTool(server.url)
    assert env.ask(op="tools") == {"tools": None}
    got = env.ask(op="prompt", model=str(folders["qwen2.5"]), row={"prompt": PROMPTS[0]})
    auto = AutoTokenizer.from_pretrained(str(folders["qwen2.5"]))
    assert got["written"] is False
    assert got["ids"] == list(auto.apply_chat_template(PROMPTS[0], add_generation_prompt=True, tokenize=True,
                                                       return_dict=False))
    env.close()
    server.close()


@pytest.mark.parametrize("answer, field", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, '"tools"[0].function.name'),
    ({"tools": [{"type": "tool", "function": {"name": "x"}}]}, '"tools"[0].type'),
    ({"tools": [SERVICE_TOOLS[0], {"type": "function", "function": {"name": "x", "parameters": [1]}}]},
     '"tools"[1].function.parameters'),
    ({"tools": {"name": "x"}}, '{"tools": [{"type": "function"'),
    (b"not json", "not valid JSON"),
])
def test_lying_tools_answer_is_an_error_naming_the_field(answer, field):
    server = Server(lambda h, path, body, n: send(h, answer))
    env = EnvTool(server.url)
    got = env.ask(op="tools")
    assert "error" in got and server.url + "/tools" in got["error"] and field in got["error"], got
    env.close()
    server.close()


def test_failing_tools_call_is_retried_then_reported():
    server = Server(lambda h, path, body, n: send(h, b"trouble", 503))
    env = EnvTool(server.url, retries=1, backoff_s=0.05)
    got = env.ask(op="tools")
    assert "tools failed after 2 attempt(s)" in got["error"] and "503" in got["error"], got
    env.close()
    server.close()
