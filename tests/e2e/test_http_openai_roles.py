"""OpenAI surface gaps closed, driven by the official `openai` client, unmodified: GET /v1/models/{id} (and the 404 of
an unknown id, in OpenAI's error shape), the "developer" role (rendered as the system role), "tool" messages and
assistant "tool_calls" rendered by the model's own chat template: the prompt ids equal transformers'
apply_chat_template on the same folder, with tool-call arguments parsed into objects as vLLM hands them over, for the
tiny model's plain ChatML template and for a copy of it carrying Qwen2.5's tool-aware template.
"""
import copy
import json
import pathlib
import re
import shutil

import pytest

from server_fixtures import TandemServer, http_json, tiny_model_dir  # noqa: F401 (pytest fixture)

openai = pytest.importorskip("openai")

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Qwen2.5-Instruct's template as the chat-template reference test holds it (copied from the model's
# tokenizer_config.json there).
QWEN25 = re.search(r'QWEN25 = r"""(.*?)"""', (ROOT / "tests/reference/test_chat_template.py").read_text(),
                   re.S).group(1)

TOOL_CONVERSATION = [
    {"role": "developer", "content": "Answer with tools."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\":\"Rome\",\"days\":[1, 2.5],\"note\":\"caf\\u00e9\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "24 C"},
    {"role": "assistant", "content": "Paris 21 C, Rome 24 C."},
    {"role": "user", "content": "thanks"},
]


def as_transformers_sees_it(messages):
    """vLLM's hand-over to the template: developer is system, tool-call arguments are objects, null content is ""."""
    out = copy.deepcopy(messages)
    for m in out:
        if m["role"] == "developer":
            m["role"] = "system"
        if m.get("content") is None:
            m["content"] = ""
        for c in m.get("tool_calls", []):
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    return out


def tokenize_messages(server, messages, agp=True):
    status, out, _ = http_json("POST", server.url + "/tokenize", {"messages": messages, "add_generation_prompt": agp})
    assert status == 200, out
    return out["tokens"]


def reference_ids(folder, messages, agp=True):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(folder))
    ids = tok.apply_chat_template(as_transformers_sees_it(messages), add_generation_prompt=agp, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with TandemServer(tiny_model_dir, "--served-model-name", "tiny-test") as s:
        yield s
        assert s.alive(), s.log_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def qwen25_dir(tiny_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-qwen25-template") / "model"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = QWEN25
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def test_model_by_id(client):
    m = client.models.retrieve("tiny-test")
    assert m.id == "tiny-test" and m.object == "model" and m.owned_by == "tandem"
    with pytest.raises(openai.NotFoundError) as ei:
        client.models.retrieve("no-such-model")
    err = ei.value.response.json()["error"]
    assert ei.value.status_code == 404 and err["param"] == "model" and "no-such-model" in err["message"]
    assert set(err) == {"message", "type", "param", "code"}


def test_developer_role_is_system(server, client, tiny_model_dir):
    msgs = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "the quick fox?"}]
    assert tokenize_messages(server, msgs) == reference_ids(tiny_model_dir, msgs)
    as_system = [{"role": "system", "content": "be brief"}, msgs[1]]
    r1 = client.chat.completions.create(model="tiny-test", messages=msgs, max_tokens=6, temperature=0)
    r2 = client.chat.completions.create(model="tiny-test", messages=as_system, max_tokens=6, temperature=0)
    assert r1.choices[0].message.content == r2.choices[0].message.content
    assert r1.usage.prompt_tokens == r2.usage.prompt_tokens


def test_tool_messages_plain_chatml(server, client, tiny_model_dir):
    """The plain ChatML template writes a tool turn like any other and does not show tool calls."""
    for agp in (True, False):
        assert tokenize_messages(server, TOOL_CONVERSATION, agp) == reference_ids(tiny_model_dir, TOOL_CONVERSATION,
                                                                                   agp)
    r = client.chat.completions.create(model="tiny-test", messages=TOOL_CONVERSATION, max_tokens=4)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_tool_messages_qwen25_template(qwen25_dir):
    """Qwen2.5's template wraps tool results in <tool_response> and writes each call as <tool_call> JSON."""
    with TandemServer(qwen25_dir, "--served-model-name", "tiny-qwen") as s:
        for agp in (True, False):
            got = tokenize_messages(s, TOOL_CONVERSATION, agp)
            assert got == reference_ids(qwen25_dir, TOOL_CONVERSATION, agp)
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = client.chat.completions.create(model="tiny-qwen", messages=TOOL_CONVERSATION, max_tokens=4)
        assert r.choices[0].finish_reason in ("length", "stop")
        bad = copy.deepcopy(TOOL_CONVERSATION)
        bad[2]["tool_calls"][0]["function"]["arguments"] = "{not json"
        with pytest.raises(openai.BadRequestError) as ei:
            client.chat.completions.create(model="tiny-qwen", messages=bad, max_tokens=4)
        err = ei.value.response.json()["error"]
        assert err["param"] == "messages" and "arguments is not JSON" in err["message"]
        assert s.stop() == 0


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
# A tool call as Qwen2.5's template asks for it, forced through structured outputs (a random tiny model never writes one).
CALL_REGEX = '<tool_call>\n\\{"name": "get_weather", "arguments": \\{"city": "[a-z]{1,8}"\\}\\}\n</tool_call>'


def expect_forced_calls(client, model, msgs, want, regex, seeds, **kw):
    """Chat completions with TOOLS whose answer the regex forces into one get_weather call, one per seed: the prompt
    ids are want (transformers' rendering), the answer is a tool call with JSON arguments {"city": lowercase}."""
    for seed in range(seeds):
        r = client.chat.completions.create(model=model, messages=msgs, tools=TOOLS, max_tokens=80, seed=seed,
                                           extra_body={"return_token_ids": True, "structured_outputs": {"regex": regex}},
                                           **kw)
        assert r.model_extra["prompt_token_ids"] == want
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        (call,) = c.message.tool_calls
        args = json.loads(call.function.arguments)
        assert call.type == "function" and call.function.name == "get_weather" and call.id, call
        assert set(args) == {"city"} and re.fullmatch("[a-z]{1,8}", args["city"]), args


def test_tools_in_the_prompt_and_calls_in_the_answer(qwen25_dir):
    """OpenAI `tools`: written into the prompt as transformers' apply_chat_template(tools=...) writes them (the same
    ids), the answer's <tool_call> blocks returned as message.tool_calls (arguments as JSON text) with finish_reason
    tool_calls; tool_choice none keeps the text as content; what is not supported is a 400 naming the field."""
    from transformers import AutoTokenizer
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    with TandemServer(qwen25_dir, "--served-model-name", "tiny-qwen") as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        tok = AutoTokenizer.from_pretrained(str(qwen25_dir))
        want = tok.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True, tokenize=True)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        expect_forced_calls(client, "tiny-qwen", msgs, want, CALL_REGEX, 3, temperature=1.0)
        r = client.chat.completions.create(model="tiny-qwen", messages=msgs, tools=TOOLS, tool_choice="none",
                                           max_tokens=80, extra_body={"structured_outputs": {"regex": CALL_REGEX}})
        assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content
        for kw, field in ((dict(tools=TOOLS, tool_choice="required"), "tool_choice"),
                          (dict(tools=TOOLS, stream=True), "tools"),
                          (dict(tools=[{"type": "function"}]), "tools")):
            with pytest.raises(openai.BadRequestError) as ei:
                client.chat.completions.create(model="tiny-qwen", messages=msgs, max_tokens=4, **kw)
            assert ei.value.response.json()["error"]["param"] == field, kw
        with pytest.raises(openai.BadRequestError) as ei:
            client.completions.create(model="tiny-qwen", prompt="x", max_tokens=4, extra_body={"tools": TOOLS})
        assert ei.value.response.json()["error"]["param"] == "tools"
        assert s.stop() == 0


def _template_copy(tiny_model_dir, tmp_path, template):
    d = tmp_path / "model"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("family", ["llama3.1", "mistral-v0.3"])
def test_tool_calls_of_other_families(family, tiny_model_dir, tmp_path):
    """The answer's tool calls are read in the format of the model's family, as vLLM's llama3_json and mistral
    parsers read them: Llama 3.1 writes the call as a JSON object {"name", "parameters"}, Mistral v0.3 as
    [TOOL_CALLS] [{"name", "arguments"}]. The tools are in the prompt as transformers renders them."""
    import sys
    sys.path.insert(0, str(ROOT / "tests" / "reference"))
    from test_chat_template import LLAMA31, MISTRAL_V03
    from transformers import AutoTokenizer
    template, regex = {
        "llama3.1": (LLAMA31, '\\{"name": "get_weather", "parameters": \\{"city": "[a-z]{1,8}"\\}\\}'),
        "mistral-v0.3": (MISTRAL_V03,
                         '\\[TOOL_CALLS\\] \\[\\{"name": "get_weather", "arguments": \\{"city": "[a-z]{1,8}"\\}\\}\\]'),
    }[family]
    d = _template_copy(tiny_model_dir, tmp_path, template)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    with TandemServer(d, "--served-model-name", "tiny") as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        want = AutoTokenizer.from_pretrained(str(d)).apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True,
                                                                         tokenize=True)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        expect_forced_calls(client, "tiny", msgs, want, regex, 2)
        assert s.stop() == 0
