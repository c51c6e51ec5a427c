"""TRL >= 1.11's own `VLLMClient` (trl/generation/vllm_client.py, TRL 1.16 in the test venv), unmodified, against
tandem-serve: check_server and /v1/models (the constructor), get_world_size, generate with the arguments
GRPOTrainer passes (token-id prompts, n, repetition_penalty, temperature, top_p, top_k=0, min_p, max_tokens,
logprobs=0, structured_outputs_regex=None, generation_kwargs; it posts /v1/completions with return_token_ids and
return_tokens_as_token_ids and parses "token_id:<id>" logprob keys), chat (/v1/chat/completions), and
reset_prefix_cache. The answers are checked against tandem's own routes (TRL's old /generate/, /tokenize) for
the same seed. vLLM's /pause (abort | keep | wait) and /resume, which the client does not wrap, are called over
the client's own HTTP session, including a keep pause with a weight update made meanwhile over the control
channel (mode keep_kv: the request in flight keeps its K/V, checked against transformers). Weight sync: the
client's init_communicator stops at /server_info's weight_transfer_config null, and the weight-transfer routes
answer 501 naming tandem-train.

The import guard: TRL's vllm_client.py imports only when `vllm` is importable (is_vllm_available) and then
imports three names from it at module level (get_ip, trainer_init, packed_nccl_broadcast_producer), which only
init_communicator / update_named_params use. `vllm_client_module` below puts an import-guard package `vllm` (version
0.31.0, the newest TRL 1.16 supports, so the client takes its current code paths) with those three names, each
raising if called, into sys.modules for the import and the test's lifetime, after importing `trl.generation`
without it (so TRL's vLLM generation backend is not imported). No part of that package takes part in any request.
"""
import importlib.machinery
import json
import re
import sys
import threading
import time
import types

import pytest
import requests
import torch

from server_fixtures import TandemServer, build_tiny_model, http_json, metric, metrics, tiny_model_dir  # noqa: F401

torch.set_num_threads(1)
PROMPTS = ["the quick brown fox", "plus minus equals", "a lazy dog"]


def _weight_transfer_refused(*args, **kwargs):
    raise AssertionError("the test reached vLLM's own weight-transfer code, which the import-guard package does not have")


@pytest.fixture(scope="module")
def vllm_client_module():
    import trl.generation  # noqa: F401  (before the import-guard package: its __init__ imports vLLM's engine only when vllm exists)
    guard_modules = {
        "vllm": {}, "vllm.utils": {}, "vllm.distributed": {}, "vllm.distributed.weight_transfer": {},
        "vllm.utils.network_utils": {"get_ip": _weight_transfer_refused},
        "vllm.distributed.weight_transfer.nccl_common": {"trainer_init": _weight_transfer_refused},
        "vllm.distributed.weight_transfer.packed_tensor": {"packed_nccl_broadcast_producer": _weight_transfer_refused},
    }
    assert not any(name in sys.modules for name in guard_modules), "a real vllm is installed: import it instead of the import-guard package"
    for name, attrs in guard_modules.items():
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)
        m.__version__ = "0.31.0"
        for k, v in attrs.items():
            setattr(m, k, v)
        sys.modules[name] = m
    from trl.generation import vllm_client
    yield vllm_client
    for name in guard_modules:
        sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with TandemServer(tiny_model_dir) as s:
        yield s
        assert s.alive(), s.log_text()


@pytest.fixture(scope="module")
def client(vllm_client_module, server):
    return vllm_client_module.VLLMClient(base_url=server.url, connection_timeout=30)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


def grpo_generate(client, prompt_ids, n, max_tokens, seed, logprobs=0):
    """VLLMGeneration's server-mode call in GRPOTrainer (trl/generation/vllm_generation.py) at GRPOConfig's
    defaults, with the seed passed the way users pass it: through generation_kwargs."""
    return client.generate(prompts=prompt_ids, features=None, n=n, repetition_penalty=1.0, temperature=1.0,
                           top_p=1.0, top_k=0, min_p=0.0, max_tokens=max_tokens, logprobs=logprobs,
                           structured_outputs_regex=None, generation_kwargs={"seed": seed})


def old_trl_generate(url, prompts, n, max_tokens, seed, logprobs=0):
    status, body, _ = http_json("POST", url + "/generate/", {
        "prompts": prompts, "images": None, "n": n, "repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0,
        "top_k": -1, "min_p": 0.0, "max_tokens": max_tokens, "logprobs": logprobs, "structured_outputs_regex": None,
        "generation_kwargs": {"seed": seed}})
    assert status == 200, body
    return body


def test_constructor_model_and_world_size(client, server):
    assert client.model == http_json("GET", server.url + "/v1/models")[1]["data"][0]["id"]
    assert client.get_world_size() == 1
    client.check_server(total_timeout=5)


def test_world_size_of_tensor_parallel_server(vllm_client_module, tiny_model_dir):
    """A server of 2 tensor-parallel shards says so as vLLM does: TRL's world size is shards x engines."""
    with TandemServer(tiny_model_dir, "--tensor-parallel-size", 2) as srv:
        tp_client = vllm_client_module.VLLMClient(base_url=srv.url, connection_timeout=30)
        assert tp_client.get_world_size() == 2
        status, info, _ = http_json("GET", srv.url + "/server_info")
        assert status == 200 and info["vllm_config"]["parallel_config"] == {"tensor_parallel_size": 2,
                                                                            "data_parallel_size": 1}, info


def test_generate_as_grpo_equals_tandem_routes(client, server, tok):
    prompt_ids = [tok.encode(p).ids for p in PROMPTS]
    n, max_tokens = 3, 10
    out = grpo_generate(client, prompt_ids, n, max_tokens, seed=11)
    ref = old_trl_generate(server.url, prompt_ids, n, max_tokens, seed=11)
    assert out["prompt_ids"] == prompt_ids
    assert out["completion_ids"] == ref["completion_ids"]
    assert len(out["completion_ids"]) == len(PROMPTS) * n
    assert out["logprob_token_ids"] == ref["logprob_token_ids"]
    for ids, lids in zip(out["completion_ids"], out["logprob_token_ids"]):
        assert lids == [[t] for t in ids]  # logprobs=0: the sampled token only
    flat = lambda o: torch.tensor([x[0] for seq in o["logprobs"] for x in seq])  # noqa: E731
    assert torch.allclose(flat(out), flat(ref), atol=1e-5, rtol=0)


def test_generate_text_prompts_and_top_logprobs(client, server, tok):
    N = 3
    out = client.generate(PROMPTS[:2], n=2, max_tokens=8, logprobs=N, generation_kwargs={"seed": 7})
    assert out["prompt_ids"] == [tok.encode(p).ids for p in PROMPTS[:2]]
    ref = old_trl_generate(server.url, PROMPTS[:2], 2, 8, seed=7, logprobs=N)
    assert out["completion_ids"] == ref["completion_ids"]
    assert out["logprob_token_ids"] == ref["logprob_token_ids"]
    for ids, lps, lids in zip(out["completion_ids"], out["logprobs"], out["logprob_token_ids"]):
        for t, lp, li in zip(ids, lps, lids):
            assert N <= len(lp) <= N + 1 and t in li and lp == sorted(lp, reverse=True)


def test_generate_without_logprobs(client):
    out = client.generate(PROMPTS[:1], n=2, max_tokens=4, logprobs=None)
    assert out["logprobs"] is None and out["logprob_token_ids"] is None and len(out["completion_ids"]) == 2
    out = client.chat([[{"role": "user", "content": PROMPTS[0]}]], n=2, max_tokens=4, logprobs=None)
    assert out["logprobs"] is None and out["logprob_token_ids"] is None and len(out["completion_ids"]) == 2


def test_chat_equals_generate_on_the_rendered_prompt(client, server):
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS[:2]]
    out = client.chat(conversations, n=2, max_tokens=6, generation_kwargs={"seed": 5})
    for conv, prompt_ids in zip(conversations, out["prompt_ids"]):
        status, body, _ = http_json("POST", server.url + "/tokenize",
                                    {"messages": conv, "add_generation_prompt": True})
        assert status == 200 and body["tokens"] == prompt_ids
    same = grpo_generate(client, out["prompt_ids"], 2, 6, seed=5)
    assert out["completion_ids"] == same["completion_ids"]
    assert out["logprob_token_ids"] == same["logprob_token_ids"]


def test_reset_prefix_cache(client, tok):
    prompt_ids = [tok.encode(PROMPTS[0]).ids]
    before = grpo_generate(client, prompt_ids, 2, 6, seed=3)
    client.reset_prefix_cache()
    assert grpo_generate(client, prompt_ids, 2, 6, seed=3)["completion_ids"] == before["completion_ids"]


def test_structured_outputs_regex(client, server):
    """GRPOTrainer's vllm_structured_outputs_regex: every completion TRL gets back is a whole match (decoded by the
    model's tokenizer as TRL's trainer decodes it); a bad regex is a 400 naming structured_outputs."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(server.model_dir) + "/tokenizer.json")
    res = client.generate(PROMPTS[:2], n=4, max_tokens=24, temperature=1.0, structured_outputs_regex=r"[0-9]{2,4}!",
                          generation_kwargs={"seed": 3})
    texts = [tok.decode(ids, skip_special_tokens=True) for ids in res["completion_ids"]]
    assert len(texts) == 8 and all(re.fullmatch(r"[0-9]{2,4}!", t) for t in texts), texts


def test_unsupported_fields_are_refused_by_name(client):
    with pytest.raises(Exception, match=r"400.*structured_outputs"):
        client.generate(PROMPTS[:1], structured_outputs_regex="(a+")
    # min_tokens is served (test_http_token_masks.py checks its effect); beyond max_tokens it is refused by name.
    with pytest.raises(Exception, match=r"400.*min_tokens"):
        client.generate(PROMPTS[:1], max_tokens=4, generation_kwargs={"min_tokens": 5})
    out = client.generate(PROMPTS[:1], n=4, max_tokens=8, generation_kwargs={"min_tokens": 6, "seed": 2})
    assert all(len(ids) >= 6 for ids in out["completion_ids"]), out["completion_ids"]
    # TRL's default of 100 alternatives is past the server's 20 (vLLM's default --max-logprobs is 20 too).
    with pytest.raises(Exception, match=r"400.*prompt_logprobs"):
        client.get_sequence_logprobs([[5, 6, 7, 8]], [2])


def test_sequence_logprobs(client):
    """TRL's get_sequence_logprobs (prompt_logprobs on /v1/completions): per completion position the top 2 sorted by
    rank with their ids, and the actual token's logprob, which is the first entry where the token ranks first."""
    seqs = [[5, 6, 7, 8, 9], [17, 250, 3, 99]]
    out = client.get_sequence_logprobs(seqs, [2, 1], top_logprobs=2)
    assert [len(x) for x in out["logprobs"]] == [3, 3]
    for b, seq in enumerate(seqs):
        for j, pos in enumerate(range([2, 1][b], len(seq))):
            top, ids = out["logprobs"][b][j], out["logprob_token_ids"][b][j]
            actual = out["actual_logprobs"][b][j][0]
            assert len(top) == 2 and top[0] >= top[1] and out["actual_token_ids"][b][j] == [seq[pos]]
            assert actual <= top[0] + 1e-6 and (actual == top[0]) == (ids[0] == seq[pos]), (b, j, top, ids, actual)


def test_weight_transfer_refused_with_a_pointer_to_tandem_train(client, server):
    with pytest.raises(RuntimeError, match="no weight-transfer engine"):
        client.init_communicator(device="cuda")
    for route in ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                  "/finish_weight_update"):
        r = client.session.post(server.url + route, json={})
        err = r.json()["error"]
        assert r.status_code == 501 and err["type"] == "not_implemented_error", (route, r.text)
        assert "tandem-train" in err["message"], route
        assert metric(metrics(server.url), "tandem_http_requests_total", route=route, status="501") >= 1
    for route in ("/v1/chat/completions/render", "/inference/v1/generate"):  # image_features, generate(features=)
        r = client.session.post(server.url + route, json={})
        assert r.status_code == 501 and "text models" in r.json()["error"]["message"], (route, r.text)


# ---- /pause and /resume (vLLM's routes; the client has no wrapper, so its session posts them) ----------------

STREAM_BODY = {"prompt": PROMPTS[0], "max_tokens": 1000, "ignore_eos": True, "seed": 9, "stream": True,
               "return_token_ids": True}


def stream_events(url, body):
    """Yields the parsed SSE events of a streamed completion."""
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                yield json.loads(line[6:])


def running_and_generated(url):
    values = metrics(url)
    return metric(values, "tandem_requests_running"), metric(values, "tandem_generation_tokens_total")


def test_pause_keep_freezes_in_flight_and_resume_continues(client, server):
    whole = http_json("POST", server.url + "/v1/completions", {**STREAM_BODY, "stream": False})[1]
    for attempt in range(5):   # until the pause lands inside the stream (a stalled client may see it end first)
        tokens, inside = [], None
        for ev in stream_events(server.url, STREAM_BODY):
            c = ev["choices"][0]
            tokens += c.get("token_ids") or []
            if len(tokens) >= 5 and inside is None:
                r = client.session.post(server.url + "/pause", params={"mode": "keep"})
                assert r.status_code == 200 and r.json()["mode"] == "keep", r.text
                assert client.session.get(server.url + "/is_paused").json() == {"is_paused": True}
                running, generated = running_and_generated(server.url)
                inside = running == 1
                time.sleep(0.5)
                # Kept, not ended, and nothing generated while paused.
                assert running_and_generated(server.url) == (running, generated)
                assert client.session.post(server.url + "/resume").status_code == 200
            last = c["finish_reason"]
        assert last == "length" and tokens == whole["choices"][0]["token_ids"]
        assert client.session.get(server.url + "/is_paused").json() == {"is_paused": False}
        if inside:
            return
    pytest.fail("every stream ended before the pause landed")


def test_pause_abort_ends_in_flight_requests(client, server):
    for attempt in range(5):   # until the pause lands inside the stream
        reasons, paused = [], False
        for ev in stream_events(server.url, {**STREAM_BODY, "max_tokens": 3000}):
            c = ev["choices"][0]
            if c["finish_reason"]:
                reasons.append(c["finish_reason"])
            elif c.get("token_ids") and not paused:
                paused = True
                r = client.session.post(server.url + "/pause")  # vLLM's default mode: abort
                assert r.status_code == 200 and r.json()["mode"] == "abort", r.text
                assert running_and_generated(server.url)[0] == 0
        if reasons == ["abort"]:
            break
        assert reasons == ["length"], reasons
        client.session.post(server.url + "/resume")
    else:
        pytest.fail("every stream ended before the pause landed")
    client.session.post(server.url + "/resume")
    # Not streamed: the answer has what was generated, with finish_reason "abort" (vLLM's answer), not an error.
    for attempt in range(5):
        res = []
        t = threading.Thread(target=lambda: res.append(http_json("POST", server.url + "/v1/completions", {
            **STREAM_BODY, "stream": False, "max_tokens": 3000, "n": 2})))
        t.start()
        while running_and_generated(server.url)[0] == 0 and t.is_alive():
            time.sleep(0.01)
        assert client.session.post(server.url + "/pause", params={"mode": "abort"}).status_code == 200
        t.join(60)
        status, body, _ = res[0]
        assert status == 200, body
        if [c["finish_reason"] for c in body["choices"]] == ["abort", "abort"]:
            assert all(len(c["token_ids"]) < 3000 for c in body["choices"])
            break
        client.session.post(server.url + "/resume")
    else:
        pytest.fail("every request ended before the pause landed")
    # Paused: a new request waits in the queue; /resume lets it through.
    done = []
    t = threading.Thread(target=lambda: done.append(client.generate(PROMPTS[:1], max_tokens=3)))
    t.start()
    t.join(0.5)
    assert t.is_alive() and not done
    client.session.post(server.url + "/resume")
    t.join(60)
    assert done and len(done[0]["completion_ids"][0]) >= 1


def test_pause_wait_answers_after_in_flight_requests_finish(client, server):
    answered, tokens, reasons = [], [], []
    pause = threading.Thread(target=lambda: answered.append(
        client.session.post(server.url + "/pause", params={"mode": "wait", "clear_cache": "false"})))
    for ev in stream_events(server.url, {**STREAM_BODY, "max_tokens": 600}):
        c = ev["choices"][0]
        tokens += c.get("token_ids") or []
        if c["finish_reason"]:
            reasons.append(c["finish_reason"])
        if tokens and not pause.is_alive() and not answered and pause.ident is None:
            pause.start()
    pause.join(30)
    # The request in flight ran to its end (a keep pause would have frozen it), then the engine paused.
    assert reasons == ["length"] and len(tokens) == 600
    assert answered and answered[0].status_code == 200, answered
    assert client.session.get(server.url + "/is_paused").json() == {"is_paused": True}
    client.session.post(server.url + "/resume")


def test_pause_wait_given_up_by_its_client_pauses_nothing(client, server):
    for attempt in range(5):   # until the request outlasts the client's patience
        res = []
        t = threading.Thread(target=lambda: res.append(http_json("POST", server.url + "/v1/completions", {
            **STREAM_BODY, "stream": False, "max_tokens": 3000, "n": 2})))
        t.start()
        while running_and_generated(server.url)[0] == 0 and t.is_alive():
            time.sleep(0.01)
        try:
            requests.post(server.url + "/pause", params={"mode": "wait"}, timeout=0.1)
            gave_up = False
        except requests.exceptions.ReadTimeout:
            gave_up = t.is_alive()
        t.join(120)
        assert res[0][0] == 200 and {c["finish_reason"] for c in res[0][1]["choices"]} == {"length"}
        if gave_up:
            break
        client.session.post(server.url + "/resume")
    else:
        pytest.fail("every request ended before the client gave up")
    time.sleep(0.3)  # the handler notices the closed connection within a slice
    assert client.session.get(server.url + "/is_paused").json() == {"is_paused": False}


def test_pause_refuses_unknown_mode_and_parameters(client, server):
    r = client.session.post(server.url + "/pause", params={"mode": "later"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "mode"
    r = client.session.post(server.url + "/pause", params={"wait_for_inflight_requests": "true"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "wait_for_inflight_requests"
    assert client.session.get(server.url + "/is_paused").json() == {"is_paused": False}


# ---- a weight update made while paused with mode keep: the request in flight keeps its K/V ----------------------

@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    """The served model and an update of the same config (seeds 0 and 1), with a context long enough for a
    completion that outlasts an HTTP round trip."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    out = {}
    for name, seed in (("base", 0), ("update", 1)):
        d = tmp_path_factory.mktemp(f"tiny-{name}")
        build_tiny_model(d, seed=seed)
        out[name] = dict(dir=d, model=AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval(),
                         state=load_file(str(d / "model.safetensors")),
                         cfg=json.loads((d / "config.json").read_text()))
    return out


def test_pause_keep_then_keep_kv_update_then_resume(vllm_client_module, two_models):
    """/pause?mode=keep inside a greedy stream, a weight update over the control channel with mode keep_kv (what
    tandem-train sends), /resume: the stream goes on to its end; its tokens are the old model's up to the update
    and from there the new model's greedy tokens attending to the K/V the old model computed."""
    from test_zmq_control import Client, hf_greedy, pack_units, start_server
    from test_zmq_inflight_update import hf_greedy_on_old_kv, send_update
    K, prompt = 1000, [1, 17, 250, 3, 99, 42, 7]
    old, new = two_models["base"]["model"], two_models["update"]["model"]
    srv, endpoint = start_server(two_models["base"]["dir"])
    c = Client(endpoint)
    try:
        client = vllm_client_module.VLLMClient(base_url=srv.url, connection_timeout=30)
        lh = c.ask({"type": "hello", "id": 1})[0]["layout_hash"]
        body = {"prompt": prompt, "max_tokens": K, "temperature": 0, "ignore_eos": True, "stream": True,
                "return_token_ids": True}
        units = pack_units(two_models["update"]["state"], two_models["base"]["cfg"])
        for version in range(1, 6):   # until the update lands inside the stream; each attempt from the base model
            if version > 1:
                base = pack_units(two_models["base"]["state"], two_models["base"]["cfg"])
                assert send_update(c, base, 100 + version, lh, "keep", 20 * version)["type"] == "weights_end"
            toks, reasons, rep = [], [], None
            for ev in stream_events(srv.url, body):
                ch = ev["choices"][0]
                toks += ch.get("token_ids") or []
                if ch["finish_reason"]:
                    reasons.append(ch["finish_reason"])
                elif toks and rep is None:
                    assert client.session.post(srv.url + "/pause", params={"mode": "keep"}).status_code == 200
                    rep = send_update(c, units, 200 + version, lh, "keep_kv", 20 * version + 10)
                    assert client.session.get(srv.url + "/is_paused").json() == {"is_paused": True}
                    assert client.session.post(srv.url + "/resume").status_code == 200
            assert rep["type"] == "weights_end" and rep["sequences_requeued"] == 0, rep
            assert reasons == ["length"] and len(toks) == K
            if rep["sequences_kept"] == 1:
                break
        else:
            pytest.fail("every stream ended before the update landed")
        ref_old = hf_greedy(old, prompt, K)[0]
        m0 = next((i for i in range(K) if toks[i] != ref_old[i]), K)
        assert 1 <= m0 < K, f"the stream took {m0} tokens from the old model"
        # The update landed after token m (m <= m0; below m0 only if the new model happened to pick the old one's
        # tokens): from m on, the new model's greedy tokens over the old model's K/V of everything before.
        assert any(toks[m:] == hf_greedy_on_old_kv(old, new, prompt + toks[:m], m, K - m)[0]
                   for m in range(m0, max(0, m0 - 3), -1)), m0
    finally:
        c.close()
        srv.stop()
