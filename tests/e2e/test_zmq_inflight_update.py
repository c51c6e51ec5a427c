"""Weight updates that land while a tandem-serve is generating (issue 24, in-flight updates), over the ZeroMQ control
channel with a real server process and transformers as the reference (docs/protocol-zmq.md, "Updates while
generating").

Proves: with weights_end "mode": "keep", every completion in flight finishes with all its tokens; its result records
one version change (policy_version_changes) inside it; the tokens before it are the old model's greedy tokens and
the ones after it the new model's greedy continuation of the prompt plus that prefix, each logprob that of its own
version's model; the reply counts the completions carried across. With "mode": "abort" they start over: the
results are exactly a fresh generation under the new weights, one version, no change list. /metrics counts both.
With "mode": "keep_kv" the tokens after the change are the new model's greedy tokens attending to the K/V the old
model computed (transformers with the old model's cache).
Over HTTP in mode abort, a non-streamed TRL /generate/ request starts over too (its answer: the new model's tokens,
return_policy_versions all new), while a stream, which cannot take back what it sent, is kept.
"""
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from server_fixtures import http_json, metric, metrics
from test_zmq_control import Client, hf_greedy, hf_logprobs, models, pack_units, start_server  # noqa: F401 (fixture)

PROMPTS = [[1, 17, 250, 3, 99, 42, 7], [1, 5], [1, 200, 201, 202, 203, 204, 205, 206]]
K = 150   # tokens per completion: the update lands long before the end


def send_update(c, units, version, layout_hash, mode, first_id):
    """weights_begin, every unit as two f32 slices, weights_end with `mode`; returns the weights_end reply."""
    rep, _ = c.ask({"type": "weights_begin", "id": first_id, "version": version, "transport": "zmq",
                    "layout_hash": layout_hash})
    assert rep["type"] == "weights_begin", rep
    for u, flat in enumerate(units):
        half = flat.size // 2
        for off, cnt in ((0, half), (half, flat.size - half)):
            c.send(dict(type="weights_slice", id=first_id + 1, unit=u, offset=off, count=cnt, dtype="f32"),
                   flat[off:off + cnt].tobytes())
    rep, _ = c.ask({"type": "weights_end", "id": first_id + 2, "version": version, "mode": mode}, timeout=120)
    return rep


def reply(c, stash):
    """The next message that is not a generate result (results that come meanwhile go to stash)."""
    while True:
        h, frames = c.recv(60)
        if h["type"] != "result":
            return h
        stash.append((h, frames))


def ask(c, header, stash):
    c.send(header)
    return reply(c, stash)


def run_a_little(c, n_requests, stash):
    """Lets a paused engine, whose queue holds n_requests requests of one completion each, run until each has
    sampled a token (its first step admits them all and samples every first token), and pauses it again: then an
    update lands inside every completion. The tiny model runs a step in microseconds, so resume and pause go out
    together and the server's socket thread handles them back to back: the engine runs a few steps in between, often
    none (then again). Returns False when a request finished first (the machine stalled the socket thread long
    enough): the caller lets the engine finish and starts over."""
    tokens_before = ask(c, {"type": "stats", "id": 90}, stash)["generation_tokens_total"]
    for _ in range(2000):
        c.send({"type": "resume", "id": 91})
        c.send({"type": "pause", "id": 92})
        assert reply(c, stash)["type"] == "resume" and reply(c, stash)["type"] == "pause"
        st = ask(c, {"type": "stats", "id": 93}, stash)
        made = st["generation_tokens_total"] - tokens_before
        if made > 0 and st["requests_running"] < n_requests:
            return False
        if made >= n_requests:
            return True
    pytest.fail("the engine never ran a step")


def start_generating(c, gid, stash):
    """Queues one greedy generate of PROMPTS while paused and runs the engine a little (run_a_little), starting over
    with id gid + 1, ... while the generation ends first. Returns the id of the generate the update will land in."""
    for attempt in range(20):
        assert ask(c, {"type": "pause", "id": 94}, stash)["type"] == "pause"
        c.send(dict(type="generate", id=gid + attempt, n_prompts=len(PROMPTS), max_tokens=K, temperature=0,
                    ignore_eos=True), *[np.asarray(p, np.int32).tobytes() for p in PROMPTS])
        if run_a_little(c, len(PROMPTS), stash):
            return gid + attempt
        assert ask(c, {"type": "resume", "id": 95}, stash)["type"] == "resume"
        results(c, gid + attempt, stash)
    pytest.fail("every generation ended before the engine could be paused inside it")


def results(c, gid, stash):
    """The results of generate gid by prompt index: (header, tokens, logprobs); stashed ones first."""
    out = {}
    while len(out) < len(PROMPTS):
        h, frames = stash.pop(0) if stash else c.recv(120)
        assert h["type"] == "result" and h["id"] == gid, h
        assert len(frames) == 2
        out[h["prompt_index"]] = (h, list(map(int, np.frombuffer(frames[0], np.int32))),
                                  np.frombuffer(frames[1], np.float32))
    return out


@pytest.fixture
def served(models):
    srv, endpoint = start_server(models["base"]["dir"])
    c = Client(endpoint)
    try:
        yield srv, c
    finally:
        c.close()
        srv.stop()


def test_keep_carries_every_sequence_across_the_update(served, models):
    srv, c = served
    lh = c.ask({"type": "hello", "id": 1})[0]["layout_hash"]
    old, new = models["base"]["model"], models["upd_a"]["model"]
    stash = []
    gid = start_generating(c, 10, stash)
    rep = send_update(c, pack_units(models["upd_a"]["state"], models["base"]["cfg"]), 1, lh, "keep", 100)
    assert rep["type"] == "weights_end" and rep["version"] == 1, rep
    assert rep["sequences_kept"] == len(PROMPTS) and rep["sequences_requeued"] == 0, rep
    assert c.ask({"type": "resume", "id": 11})[0]["type"] == "resume"
    for i, (h, toks, lps) in results(c, gid, stash).items():
        p = PROMPTS[i]
        assert h["finish_reasons"] == ["length"] and len(toks) == K, h
        assert h["policy_versions"] == [0] and h["policy_versions_end"] == [1], h
        changes = h["policy_version_changes"]
        assert len(changes) == 1 and len(changes[0]) == 1 and changes[0][0][1] == 1, h
        m = changes[0][0][0]
        assert 0 < m < K, h
        assert toks[:m] == hf_greedy(old, p, m)[0], f"prompt {i}: tokens before the update are not the old model's"
        assert toks[m:] == hf_greedy(new, p + toks[:m], K - m)[0], \
            f"prompt {i}: tokens after the update (from {m}) are not the new model's continuation of the prefix"
        np.testing.assert_allclose(lps[:m], hf_logprobs(old, p, toks[:m], 1.0), atol=2e-4, rtol=0)
        np.testing.assert_allclose(lps[m:], hf_logprobs(new, p + toks[:m], toks[m:], 1.0), atol=2e-4, rtol=0)
    values = metrics(srv.url)
    assert metric(values, "tandem_weight_updates_total") == 1
    assert metric(values, "tandem_weight_update_sequences_kept_total") == len(PROMPTS)
    assert metric(values, "tandem_weight_update_pause_seconds_count") == 1


@torch.no_grad()
def hf_greedy_on_old_kv(old, new, ids, m, k):
    """What mode keep_kv computes: `old` has the K/V of ids[:-1] (the last sampled token is computed after the
    update), `new` then decodes greedily from ids[-1] attending to them: k tokens and their log-softmax."""
    pkv = old(torch.tensor([ids[:-1]]), use_cache=True).past_key_values
    tok, toks, lps = ids[-1], [], []
    for _ in range(k):
        out = new(torch.tensor([[tok]]), past_key_values=pkv, use_cache=True)
        pkv = out.past_key_values
        logits = out.logits[0, -1]
        tok = int(torch.argmax(logits))
        toks.append(tok)
        lps.append(float(torch.log_softmax(logits, -1)[tok]))
    return toks, np.array(lps, np.float32)


def test_keep_kv_goes_on_with_the_old_k_v(served, models):
    srv, c = served
    lh = c.ask({"type": "hello", "id": 1})[0]["layout_hash"]
    old, new = models["base"]["model"], models["upd_a"]["model"]
    stash = []
    gid = start_generating(c, 30, stash)
    rep = send_update(c, pack_units(models["upd_a"]["state"], models["base"]["cfg"]), 3, lh, "keep_kv", 300)
    assert rep["type"] == "weights_end" and rep["sequences_kept"] == len(PROMPTS), rep
    assert c.ask({"type": "resume", "id": 31})[0]["type"] == "resume"
    for i, (h, toks, lps) in results(c, gid, stash).items():
        p = PROMPTS[i]
        assert h["policy_versions"] == [0] and h["policy_versions_end"] == [3] and len(toks) == K, h
        m = h["policy_version_changes"][0][0][0]
        assert toks[:m] == hf_greedy(old, p, m)[0], f"prompt {i}: tokens before the update are not the old model's"
        ref_t, ref_lp = hf_greedy_on_old_kv(old, new, p + toks[:m], m, K - m)
        assert toks[m:] == ref_t, f"prompt {i}: from {m} on, not the new model's greedy tokens over the old K/V"
        np.testing.assert_allclose(lps[m:], ref_lp, atol=2e-4, rtol=0)


def test_abort_restarts_every_sequence_under_the_new_weights(served, models):
    srv, c = served
    lh = c.ask({"type": "hello", "id": 1})[0]["layout_hash"]
    new = models["upd_b"]["model"]
    stash = []
    gid = start_generating(c, 20, stash)
    rep = send_update(c, pack_units(models["upd_b"]["state"], models["base"]["cfg"]), 2, lh, "abort", 200)
    assert rep["type"] == "weights_end" and rep["version"] == 2, rep
    assert rep["sequences_requeued"] == len(PROMPTS) and rep["sequences_kept"] == 0, rep
    assert c.ask({"type": "resume", "id": 21})[0]["type"] == "resume"
    for i, (h, toks, lps) in results(c, gid, stash).items():
        assert h["finish_reasons"] == ["length"] and "policy_version_changes" not in h, h
        assert h["policy_versions"] == [2] and h["policy_versions_end"] == [2], h
        ref_t, ref_lp = hf_greedy(new, PROMPTS[i], K)
        assert toks == ref_t, f"prompt {i}: not a fresh generation under the new weights"
        np.testing.assert_allclose(lps, ref_lp, atol=2e-4, rtol=0)
    values = metrics(srv.url)
    assert metric(values, "tandem_weight_update_sequences_requeued_total") == len(PROMPTS)
    assert metric(values, "tandem_weight_update_sequences_kept_total") == 0


def test_a_bad_mode_is_refused_and_changes_nothing(served, models):
    _, c = served
    rep, _ = c.ask({"type": "weights_end", "id": 5, "version": 1, "mode": "drain"})
    assert rep["type"] == "error" and rep["code"] == "bad_message" and '"keep", "abort" or "keep_kv"' in rep["message"], rep
    assert c.ask({"type": "hello", "id": 6})[0]["policy_version"] == 0


def stream_token_ids(url, body):
    """A streamed /v1/completions: every token id its chunks carried, in order."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        raw = r.read().decode()
    ids = []
    for ev in raw.split("\n\n"):
        if ev.startswith("data: {"):
            for ch in json.loads(ev[6:])["choices"]:
                ids += ch.get("token_ids") or []
    return ids


def test_http_requests_across_an_abort_update(served, models):
    srv, c = served
    lh = c.ask({"type": "hello", "id": 1})[0]["layout_hash"]
    old, new = models["base"]["model"], models["upd_a"]["model"]
    trl_body = {"prompts": [PROMPTS[0]], "n": 1, "temperature": 0, "max_tokens": K, "logprobs": 0,
                "return_policy_versions": True, "generation_kwargs": {"ignore_eos": True}}
    stream_body = {"prompt": PROMPTS[2], "max_tokens": K, "temperature": 0, "ignore_eos": True, "stream": True,
                   "return_token_ids": True}
    stash = []
    with ThreadPoolExecutor(2) as pool:
        for _ in range(20):   # until the engine could be paused inside both requests (run_a_little)
            assert ask(c, {"type": "pause", "id": 2}, stash)["type"] == "pause"
            trl = pool.submit(http_json, "POST", srv.url + "/generate/", trl_body, None, 120)
            stream = pool.submit(stream_token_ids, srv.url, stream_body)
            deadline = time.time() + 60
            while ask(c, {"type": "stats", "id": 3}, stash)["requests_waiting"] < 2:   # both reached the engine
                assert time.time() < deadline, "the HTTP requests never reached the engine"
                time.sleep(0.01)
            if run_a_little(c, 2, stash):
                break
            assert ask(c, {"type": "resume", "id": 4}, stash)["type"] == "resume"
            trl.result(timeout=120)
            stream.result(timeout=120)
        else:
            pytest.fail("every pair of requests ended before the engine could be paused inside them")
        rep = send_update(c, pack_units(models["upd_a"]["state"], models["base"]["cfg"]), 1, lh, "abort", 100)
        assert rep["type"] == "weights_end" and rep["sequences_requeued"] == 1 and rep["sequences_kept"] == 1, rep
        assert c.ask({"type": "resume", "id": 11})[0]["type"] == "resume"
        status, out, _ = trl.result(timeout=120)
        toks = stream.result(timeout=120)
    # Not streamed: started over, the new model's greedy tokens, each of version 1.
    assert status == 200, out
    assert out["completion_ids"] == [hf_greedy(new, PROMPTS[0], K)[0]] and out["policy_versions"] == [[1] * K], out
    np.testing.assert_allclose(np.array(out["logprobs"])[0, :, 0], hf_greedy(new, PROMPTS[0], K)[1], atol=2e-4, rtol=0)
    # Streamed: kept. Its tokens follow the old model up to some m >= 1, then the new one's continuation of that
    # prefix (m0, the longest prefix the old model shares, is such an m: from the update on, the tokens are the new
    # model's greedy continuation, so they stay that from any later point too).
    p = PROMPTS[2]
    assert len(toks) == K
    ref_old = hf_greedy(old, p, K)[0]
    m0 = next((i for i in range(K) if toks[i] != ref_old[i]), K)
    assert 1 <= m0 < K, f"the stream took {m0} tokens from the old model"
    assert toks[m0:] == hf_greedy(new, p + toks[:m0], K - m0)[0]
