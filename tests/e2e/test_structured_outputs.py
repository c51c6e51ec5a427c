"""Structured outputs (vLLM's `structured_outputs` regex / choice, and the older `guided_regex` / `guided_choice`)
against a real tandem-serve, through the official `openai` client (TRL's `VLLMClient` with structured_outputs_regex:
test_http_vllm_client.py): every completion, over
many seeds and temperatures, is a whole match of the regex by Python's `re.fullmatch` (or one of the choices), and
it ends by the end-of-sequence id where the regex allows nothing more; refusals (syntax, unsupported constructs,
JSON schemas, two constraints at once) are 400s naming `structured_outputs` or the field."""
import json
import re
import sys
import tempfile

from server_fixtures import TandemServer, build_tiny_model, http_json

try:
    import pytest
except ImportError:   # the GPU machine: run as a script (see the end)
    pytest = None

if pytest is not None and __name__ != "__main__":
    import jsonschema
    import openai
    from server_fixtures import tiny_model_dir  # noqa: F401 (fixture)

PATTERNS = [r"[0-9]{3}-[a-z]+", r"(yes|no)(, because [a-z ]{3,12})?", r"-?(0|[1-9][0-9]*)(\.[0-9]+)?",
            r'\{"name": "[a-z ]{1,10}", "age": [1-9][0-9]?\}', r"(?:ab|cd)+x?"]


def fixture(fn):
    return pytest.fixture(scope="module")(fn) if pytest is not None else fn


@fixture
def server(tiny_model_dir):
    srv = TandemServer(tiny_model_dir)
    yield srv
    assert srv.stop() == 0, srv.log_text()


def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def model_id(srv):
    return client(srv).models.list().data[0].id


def test_completions_fullmatch_the_regex(server):
    c = client(server)
    for pattern in PATTERNS:
        for seed, temperature in ((1, 1.0), (2, 1.5), (3, 0.0)):
            out = c.completions.create(model=model_id(server), prompt="the quick brown fox", n=4, max_tokens=48,
                                       temperature=temperature, seed=seed,
                                       extra_body={"structured_outputs": {"regex": pattern}})
            for ch in out.choices:
                if ch.finish_reason == "stop":   # a whole match, ended by the end-of-sequence id
                    assert re.fullmatch(pattern, ch.text), (pattern, ch.text)
                else:                            # cut by max_tokens: a prefix of a match
                    assert ch.finish_reason == "length", ch
    # Where the regex allows nothing more the completion must end: "[0-9]{3}" stops after three digits.
    out = c.completions.create(model=model_id(server), prompt="numbers", n=8, max_tokens=20, temperature=1.0,
                               seed=5, extra_body={"guided_regex": "[0-9]{3}"})
    assert all(ch.finish_reason == "stop" and re.fullmatch("[0-9]{3}", ch.text) for ch in out.choices), out.choices


def test_choice_chat_and_trl_client(server):
    c = client(server)
    choices = ["yes", "no", "maybe so", "it (depends)"]
    for seed in range(4):
        out = c.chat.completions.create(model=model_id(server), messages=[{"role": "user", "content": "ok?"}],
                                        n=4, max_tokens=16, temperature=1.2, seed=seed,
                                        extra_body={"structured_outputs": {"choice": choices}})
        assert all(ch.message.content in choices and ch.finish_reason == "stop" for ch in out.choices), out.choices
    out = c.completions.create(model=model_id(server), prompt="x", n=4, max_tokens=16, temperature=1.0, seed=9,
                               extra_body={"guided_choice": choices})
    assert all(ch.text in choices for ch in out.choices)


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"},
                                      "ok": {"type": "boolean"}}, "required": ["name", "age"]},
    {"type": "array", "items": {"enum": ["red", "green", 3, None]}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                                      "tags": {"type": "array", "items": {"type": "string", "minLength": 1,
                                                                          "maxLength": 4}, "maxItems": 2},
                                      "score": {"type": "number"}, "kind": {"const": "a\"b"}}},
]


def test_json_schema(server):
    """structured_outputs json, guided_json (a schema as text) and OpenAI's response_format json_schema on chat: every
    completion that ends is JSON that validates against the schema."""
    c = client(server)
    for i, schema in enumerate(SCHEMAS):
        for extra in ({"structured_outputs": {"json": schema}}, {"guided_json": json.dumps(schema)}):
            out = c.completions.create(model=model_id(server), prompt="json:", n=4, max_tokens=80, temperature=1.0,
                                       seed=i, extra_body=extra)
            done = [ch.text for ch in out.choices if ch.finish_reason == "stop"]
            assert done, [ch.text for ch in out.choices]
            for text in done:
                jsonschema.validate(json.loads(text), schema)
        out = c.chat.completions.create(model=model_id(server), messages=[{"role": "user", "content": "json"}], n=3,
                                        max_tokens=80, temperature=1.0, seed=i,
                                        response_format={"type": "json_schema",
                                                         "json_schema": {"name": "x", "schema": schema}})
        for ch in out.choices:
            if ch.finish_reason == "stop":
                jsonschema.validate(json.loads(ch.message.content), schema)


REFUSALS = [
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "missing ')'"),
    ({"structured_outputs": {"regex": "(?<=a)b"}}, "structured_outputs", "only (?:...) groups"),
    ({"structured_outputs": {"json": {"type": "integer", "minimum": 3}}}, "structured_outputs", "'minimum'"),
    ({"structured_outputs": {"json": {"$ref": "#/x"}}}, "structured_outputs", "'$ref'"),
    ({"guided_json": "{not json"}, "guided_json", "not JSON"),
    ({"structured_outputs": {"grammar": "root ::= a"}}, "structured_outputs", "grammar is not supported"),
    ({"response_format": {"type": "json_object"}}, "response_format", "json_object is not"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "one of regex, choice and json"),
    ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "guided_regex", "cannot be given"),
    ({"guided_choice": []}, "guided_choice", "list of 1 to 4096"),
    ({"guided_regex": "[0-9]", "allowed_token_ids": [5]}, "guided_regex", "allowed_token_ids"),
]


def parametrize_refusals(fn):
    return pytest.mark.parametrize("body,field,why", REFUSALS)(fn) if pytest is not None else fn


@parametrize_refusals
def test_refusals(server, body, field, why):
    with pytest.raises(openai.BadRequestError) as e:
        client(server).completions.create(model=model_id(server), prompt="x", max_tokens=4, extra_body=body)
    err = e.value.body
    assert err["param"] == field and why in err["message"], err


def gpu_check():
    """On cuda:0 (bf16): regex, choice and json-schema completions over seeds are whole matches / valid JSON."""
    d = tempfile.mkdtemp(prefix="tandem-structured-")
    build_tiny_model(d)
    srv = TandemServer(d, "--device", "cuda:0")
    try:
        n = 0
        for seed in range(3):
            for pattern in PATTERNS:
                status, out, _ = http_json("POST", srv.url + "/v1/completions",
                                           {"prompt": "the quick", "n": 4, "max_tokens": 48, "temperature": 1.0,
                                            "seed": seed, "structured_outputs": {"regex": pattern}})
                assert status == 200, out
                for ch in out["choices"]:
                    assert ch["finish_reason"] == "length" or re.fullmatch(pattern, ch["text"]), (pattern, ch)
                    n += ch["finish_reason"] == "stop"
            status, out, _ = http_json("POST", srv.url + "/v1/completions",
                                       {"prompt": "x", "n": 4, "max_tokens": 80, "temperature": 1.0, "seed": seed,
                                        "structured_outputs": {"json": SCHEMAS[0]}})
            assert status == 200, out
            for ch in out["choices"]:
                if ch["finish_reason"] == "stop":
                    v = json.loads(ch["text"])
                    assert isinstance(v["name"], str) and isinstance(v["age"], int), v
                    n += 1
    finally:
        assert srv.stop() == 0, srv.log_text()
    return f"{n} completed structured outputs on cuda:0 all whole matches / valid JSON"


if __name__ == "__main__":
    if "--gpu" not in sys.argv:
        sys.exit("usage: python3 tests/e2e/test_structured_outputs.py --gpu   (the CPU tests run under pytest)")
    print(f"summary: PASS: {gpu_check()}")
