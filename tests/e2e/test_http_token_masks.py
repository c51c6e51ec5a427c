"""vLLM's token-mask fields (min_tokens, allowed_token_ids, bad_words) and the fields tandem-serve refuses, sent the
way users send them: through the official `openai` client's extra_body, unmodified, against a real tandem-serve.

What is checked: with eos among three allowed ids, seeded completions that end within 4 tokens do not once
min_tokens = 5 (and eos is not among their first 5 ids); every sampled id lies in allowed_token_ids (completions and
chat); the ids of a bad word (with and without its leading space, as vLLM encodes it) never appear in the greedy
output that held them; and every refused field is a 400 whose OpenAI error names it.
"""
import pytest

from server_fixtures import EOS_TOKEN, TandemServer, http_json, tiny_model_dir  # noqa: F401 (pytest fixture)

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with TandemServer(tiny_model_dir, "--served-model-name", "tiny-test") as s:
        yield s
        assert s.alive(), s.log_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def token_ids(server, text):
    status, out, _ = http_json("POST", server.url + "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert status == 200, out
    return out["tokens"]


def eos_id(server):
    ids = token_ids(server, EOS_TOKEN)
    assert len(ids) == 1
    return ids[0]


def contains(seq, sub):
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_min_tokens_holds_back_eos(server, client):
    eos = eos_id(server)
    allowed = [eos] + token_ids(server, " fox")[:1] + token_ids(server, " box")[:1]
    assert len(set(allowed)) == 3

    def run(**extra):
        r = client.completions.create(model="tiny-test", prompt="the quick brown", max_tokens=30, temperature=1.0,
                                      n=12, seed=4,
                                      extra_body={"allowed_token_ids": allowed, "return_token_ids": True, **extra})
        return r.choices

    free = run()
    assert any(c.finish_reason == "stop" and len(c.token_ids) < 5 for c in free), \
        "no completion ends within 4 tokens without min_tokens: the test would not see min_tokens work"
    held = run(min_tokens=5)
    for c in held:
        assert len(c.token_ids) >= 5, c.token_ids
        assert eos not in c.token_ids[:5], c.token_ids
        assert set(c.token_ids) <= set(allowed)
    assert any(c.finish_reason == "stop" and c.token_ids[-1] == eos for c in held)


def test_allowed_token_ids_completions_and_chat(server, client):
    allowed = sorted({t for w in (" fox", " dog", " seven", " 3") for t in token_ids(server, w)})
    r = client.completions.create(model="tiny-test", prompt=["numbers 1 2", "a lazy"], max_tokens=16,
                                  temperature=1.2, n=3, seed=11, logprobs=2,
                                  extra_body={"allowed_token_ids": allowed, "return_token_ids": True,
                                              "ignore_eos": True})
    drawn = set()
    for c in r.choices:
        assert len(c.token_ids) == 16 and set(c.token_ids) <= set(allowed), c.token_ids
        drawn |= set(c.token_ids)
        # The logprob reported is the unmasked distribution's (vLLM's default raw logprobs): below 0 and finite.
        assert all(lp < 0 for lp in c.logprobs.token_logprobs)
    assert len(drawn) >= 3, drawn
    chat = client.chat.completions.create(model="tiny-test", messages=[{"role": "user", "content": "count"}],
                                          max_tokens=10, temperature=0,
                                          extra_body={"allowed_token_ids": allowed, "return_token_ids": True,
                                                      "ignore_eos": True})
    assert set(chat.choices[0].token_ids) <= set(allowed)


def bad_word_in(server, ids):
    """A word of printable ASCII that the greedy ids hold as a run of 2 (else 1) tokens, re-encoded the way vLLM
    encodes a bad word (without, else with, a leading space). The random model's output is mostly odd bytes."""
    for n in (2, 1):
        for i in range(len(ids) - n + 1):
            status, out, _ = http_json("POST", server.url + "/detokenize", {"tokens": ids[i:i + n]})
            assert status == 200, out
            text = out["prompt"].strip()
            if not text or not all(c.isalnum() for c in text):
                continue
            for form in (text, " " + text):
                if contains(ids, token_ids(server, form)):
                    return text
    return None


def test_bad_words_never_appear(server, client):
    def greedy(prompt, **extra):
        r = client.completions.create(model="tiny-test", prompt=prompt, max_tokens=24, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True, **extra})
        return r.choices[0]

    tried = 0
    for prompt in ("seven wizards", "the quick brown fox", "numbers 1 2 3", "a lazy dog while"):
        base = greedy(prompt)
        word = bad_word_in(server, base.token_ids)
        if word is None:
            continue
        tried += 1
        plain, spaced = token_ids(server, word), token_ids(server, " " + word)
        out = greedy(prompt, bad_words=[word])
        assert not contains(out.token_ids, plain), (word, plain, out.token_ids)
        # vLLM keeps the spaced form only when it starts with another id and has as many ids.
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            assert not contains(out.token_ids, spaced), (word, spaced, out.token_ids)
        assert out.token_ids != base.token_ids
    assert tried >= 2, "too few greedy outputs hold a clean word to ban"


REFUSED = [
    ({"truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
    ({"structured_outputs": {"grammar": "root ::= a"}}, "structured_outputs"),
    ({"guided_json": {"type": "object", "patternProperties": {}}}, "guided_json"),
    ({"guided_regex": "(?=a)"}, "structured_outputs"),   # served (test_structured_outputs.py); this one is refused
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "root ::= \"a\""}, "guided_grammar"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"min_tokens": 40}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, 300]}, "allowed_token_ids"),
    ({"bad_words": ["  "]}, "bad_words"),
    ({"bad_words": "fox"}, "bad_words"),
]


@pytest.mark.parametrize("extra,field", REFUSED, ids=[f for _, f in REFUSED])
def test_refused_fields_name_themselves(client, extra, field):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model="tiny-test", prompt="the quick", max_tokens=8, extra_body=extra)
    err = ei.value.response.json()["error"]
    assert ei.value.status_code == 400 and err["param"] == field and field in err["message"], err
    assert err["type"] == "invalid_request_error"


# json_schema is served (test_structured_outputs.py); a schema keyword it cannot hold is refused.
@pytest.mark.parametrize("fmt", [{"type": "json_object"},
                                 {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string",
                                                                                                 "format": "date"}}}])
def test_chat_response_format_refused(client, fmt):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model="tiny-test", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       response_format=fmt)
    assert ei.value.response.json()["error"]["param"] == "response_format"
    ok = client.chat.completions.create(model="tiny-test", messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=4, response_format={"type": "text"})
    assert ok.choices[0].finish_reason in ("length", "stop")
