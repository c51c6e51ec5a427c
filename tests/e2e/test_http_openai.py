"""tandem-serve's OpenAI-compatible routes driven by the official `openai` Python client, unmodified.

What is checked: completions (text, list of texts, token ids, lists of token ids), n > 1, logprobs objects
(shape and consistency with the sampled tokens), echo, stop strings and stop ids, seeds, streaming (chunks
concatenate to the whole answer, end with [DONE], usage chunk), chat (the rendered prompt equals
transformers' apply_chat_template; the answer equals a completion of that prompt; streaming deltas; logprobs
with top_logprobs), /v1/models, /tokenize, /detokenize, and greedy output equal to transformers' generate.
"""
import json
import urllib.request

import pytest
import torch

from server_fixtures import TandemServer, http_json, tiny_model_dir  # noqa: F401 (pytest fixture)

openai = pytest.importorskip("openai")
torch.set_num_threads(1)

PROMPTS = ["the quick brown fox", "seven wizards box", "numbers 1 2 3"]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with TandemServer(tiny_model_dir, "--served-model-name", "tiny-test") as s:
        yield s
        assert s.alive(), s.log_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def greedy(client, prompt, max_tokens=12, **extra):
    r = client.completions.create(model="tiny-test", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                  extra_body={"return_token_ids": True, **extra})
    return r


def tokenize(server, **body):
    status, out, _ = http_json("POST", server.url + "/tokenize", body)
    assert status == 200, out
    return out


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-test"]
    assert models.data[0].owned_by == "tandem"


def test_greedy_equals_transformers_generate(server, tiny_model_dir):
    """Token ids via return_token_ids equal transformers' greedy generate on the same folder."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    status, _, _ = http_json("GET", server.url + "/health")
    assert status == 200
    for prompt in PROMPTS:
        ids = tokenize(server, prompt=prompt)["tokens"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=20,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        ref = out[0, len(ids):].tolist()
        status, got, _ = http_json("POST", server.url + "/v1/completions",
                                   {"prompt": ids, "max_tokens": 20, "temperature": 0, "return_token_ids": True})
        assert status == 200, got
        choice = got["choices"][0]
        assert choice["prompt_token_ids"] == ids
        assert choice["token_ids"] == ref, (prompt, choice["token_ids"], ref)
        # transformers stops after eos (keeping it); tandem reports the same ids and says why it stopped.
        assert choice["finish_reason"] == ("stop" if ref[-1] == model.config.eos_token_id else "length")


def test_completion_text_and_usage(server, client):
    r = greedy(client, PROMPTS[0], max_tokens=10, ignore_eos=True)
    assert r.object == "text_completion" and r.model == "tiny-test" and r.id.startswith("cmpl-")
    c = r.choices[0]
    assert c.finish_reason == "length" and c.index == 0
    assert len(c.token_ids) == 10
    assert r.usage.completion_tokens == 10
    assert r.usage.prompt_tokens == tokenize(server, prompt=PROMPTS[0])["count"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + 10
    # The text is the decoding of the ids.
    status, de, _ = http_json("POST", server.url + "/detokenize", {"tokens": c.token_ids})
    assert status == 200 and de["prompt"] == c.text


def test_prompt_forms_and_n(client, server):
    """Text list, token ids, list of token-id lists; choices are prompt-major with n per prompt."""
    singles = [greedy(client, p).choices[0] for p in PROMPTS]
    r = client.completions.create(model="tiny-test", prompt=PROMPTS, n=2, max_tokens=12, temperature=0)
    assert [c.index for c in r.choices] == list(range(6))
    for k, c in enumerate(r.choices):
        assert c.text == singles[k // 2].text
    ids = [tokenize(server, prompt=p)["tokens"] for p in PROMPTS]
    r = client.completions.create(model="tiny-test", prompt=ids[1], max_tokens=12, temperature=0)
    assert r.choices[0].text == singles[1].text
    r = client.completions.create(model="tiny-test", prompt=ids, max_tokens=12, temperature=0)
    assert [c.text for c in r.choices] == [s.text for s in singles]


def test_sampling_seed_and_n(client):
    kw = dict(model="tiny-test", prompt=PROMPTS[0], max_tokens=12, temperature=1.0, seed=1234, n=4,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1, "4 samples at temperature 1 should not all be equal"
    c = client.completions.create(**{**kw, "seed": 99})
    assert [x.text for x in c.choices] != [x.text for x in a.choices]


def test_logprobs_object(client):
    r = client.completions.create(model="tiny-test", prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=3,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    c = r.choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    if not any("\ufffd" in t for t in lp.tokens):  # a token holding part of a character shows U+FFFD alone
        assert "".join(lp.tokens) == c.text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert tlp <= 0
        assert 1 <= len(top) <= 4 and tok in top
        # Greedy: the sampled token is the most likely one.
        assert abs(max(top.values()) - tlp) < 1e-5


def test_echo_and_stop(client):
    base = greedy(client, PROMPTS[2], max_tokens=16, ignore_eos=True).choices[0]
    r = client.completions.create(model="tiny-test", prompt=PROMPTS[2], max_tokens=16, temperature=0, echo=True,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == PROMPTS[2] + base.text
    # A stop string taken from the middle of the greedy text cuts it there.
    text = base.text
    k = max(1, len(text) // 2)
    stop = text[k:k + 2]
    cut = text.find(stop)
    assert cut >= 0
    r = greedy(client, PROMPTS[2], max_tokens=16, ignore_eos=True, stop=[stop])
    c = r.choices[0]
    assert c.text == text[:cut] and c.finish_reason == "stop" and c.stop_reason == stop
    # A stop token id ends the completion at its first occurrence; the id is reported, its text is not.
    ids = base.token_ids
    j = 3
    stop_id = ids[j]
    first = ids.index(stop_id)
    r = greedy(client, PROMPTS[2], max_tokens=16, ignore_eos=True, stop_token_ids=[stop_id])
    c = r.choices[0]
    assert c.token_ids == ids[:first + 1] and c.finish_reason == "stop" and c.stop_reason == stop_id


def test_streaming_completions(client):
    whole = client.completions.create(model="tiny-test", prompt=PROMPTS, max_tokens=14, temperature=0,
                                      extra_body={"ignore_eos": True})
    stream = client.completions.create(model="tiny-test", prompt=PROMPTS, max_tokens=14, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    texts, finish, usage = {}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert [texts[i] for i in range(3)] == [c.text for c in whole.choices]
    assert finish == {0: "length", 1: "length", 2: "length"}
    assert usage is not None and usage.completion_tokens == 3 * 14
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_streaming_wire_format(server):
    """Raw SSE: every event is 'data: <json>' followed by a blank line, and the last is [DONE]."""
    body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 5, "stream": True, "logprobs": 1}).encode()
    req = urllib.request.Request(server.url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    n_tokens = 0
    for ev in events[:-2]:
        assert ev.startswith("data: ")
        obj = json.loads(ev[6:])
        assert obj["object"] == "text_completion"
        for c in obj["choices"]:
            n_tokens += len(c["logprobs"]["tokens"])
    assert 1 <= n_tokens <= 5


def test_chat_prompt_matches_transformers(server, tiny_model_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick fox?"},
            {"role": "assistant", "content": "jumps"}, {"role": "user", "content": "and the dog"}]
    for agp in (True, False):
        ref = tok.apply_chat_template(msgs, add_generation_prompt=agp, tokenize=True)
        ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
        got = tokenize(server, messages=msgs, add_generation_prompt=agp)
        assert got["tokens"] == list(ref)


def test_chat_completion(server, client):
    msgs = [{"role": "user", "content": "the quick brown fox"}]
    r = client.chat.completions.create(model="tiny-test", messages=msgs, max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    c = r.choices[0]
    assert c.message.role == "assistant" and c.finish_reason == "length"
    # Same as a completion of the rendered prompt.
    ids = tokenize(server, messages=msgs)["tokens"]
    ref = greedy(client, ids, max_tokens=10, ignore_eos=True).choices[0]
    assert c.message.content == ref.text and c.token_ids == ref.token_ids
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 10
    # n > 1 and logprobs with alternatives.
    r = client.chat.completions.create(model="tiny-test", messages=msgs, max_tokens=6, temperature=0.8, seed=5, n=3,
                                       logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    assert [x.index for x in r.choices] == [0, 1, 2]
    for x in r.choices:
        content = x.logprobs.content
        assert len(content) == 6
        if not any("\ufffd" in t.token for t in content):
            assert "".join(t.token for t in content) == x.message.content
        for t in content:
            assert t.logprob <= 0 and len(t.top_logprobs) == 2
            assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
            assert bytes(t.bytes) == t.token.encode()


def test_chat_streaming(client):
    msgs = [{"role": "user", "content": "numbers 4 5 6"}]
    whole = client.chat.completions.create(model="tiny-test", messages=msgs, max_tokens=12, temperature=0, n=2)
    stream = client.chat.completions.create(model="tiny-test", messages=msgs, max_tokens=12, temperature=0, n=2,
                                            stream=True)
    content, roles, finish = {}, {}, {}
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        for c in chunk.choices:
            if c.delta.role:
                roles[c.index] = c.delta.role
            content[c.index] = content.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert roles == {0: "assistant", 1: "assistant"}
    assert [content[0], content[1]] == [c.message.content for c in whole.choices]
    assert finish == {0: whole.choices[0].finish_reason, 1: whole.choices[1].finish_reason}


def test_tokenize_detokenize(server, tiny_model_dir):
    from tokenizers import Tokenizer
    ref = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    text = "the lazy dog hums 42 times"
    got = tokenize(server, prompt=text, return_token_strs=True)
    assert got["tokens"] == ref.encode(text).ids and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == 4096
    assert got["token_strs"] == [ref.id_to_token(i) for i in got["tokens"]]
    status, de, _ = http_json("POST", server.url + "/detokenize", {"tokens": got["tokens"]})
    assert status == 200 and de == {"prompt": text}
