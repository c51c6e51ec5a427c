"""Structured outputs (vLLM's `structured_outputs` regex / choice, and the older `guided_regex` / `guided_choice`)
against a real tandem-serve, through the official `openai` client (TRL's `VLLMClient` with structured_outputs_regex:
test_http_vllm_client.py): every completion, over
many seeds and temperatures, is a whole match of the regex by Python's `re.fullmatch` (or one of the choices), and
it ends by the end-of-sequence id where the regex allows nothing more; refusals (syntax, unsupported constructs,
JSON schemas, two constraints at once) are 400s naming `structured_outputs` or the field."""
import re

import openai
import pytest

from server_fixtures import TandemServer, tiny_model_dir  # noqa: F401 (fixture)

PATTERNS = [r"[0-9]{3}-[a-z]+", r"(yes|no)(, because [a-z ]{3,12})?", r"-?(0|[1-9][0-9]*)(\.[0-9]+)?",
            r'\{"name": "[a-z ]{1,10}", "age": [1-9][0-9]?\}', r"(?:ab|cd)+x?"]


@pytest.fixture(scope="module")
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


@pytest.mark.parametrize("body,field,why", [
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "missing ')'"),
    ({"structured_outputs": {"regex": "(?<=a)b"}}, "structured_outputs", "only (?:...) groups"),
    ({"structured_outputs": {"json": {"type": "object"}}}, "structured_outputs", "json is not supported"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "one of regex and choice"),
    ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "guided_regex", "cannot be given"),
    ({"guided_choice": []}, "guided_choice", "list of 1 to 4096"),
    ({"guided_regex": "[0-9]", "allowed_token_ids": [5]}, "guided_regex", "allowed_token_ids"),
    ({"guided_json": {"type": "object"}}, "guided_json", ""),
])
def test_refusals(server, body, field, why):
    with pytest.raises(openai.BadRequestError) as e:
        client(server).completions.create(model=model_id(server), prompt="x", max_tokens=4, extra_body=body)
    err = e.value.body
    assert err["param"] == field and why in err["message"], err
