"""Multi-turn trajectories sampled by real tandem-serve processes (trainer/trajectory_rollout.c over the ZeroMQ
control channel), with the built-in calculator on the tiny test model. A random tiny model never calls a tool by
itself, so the first turn is a scripted calculator call and the second turn is the server's sampled tokens
followed by another scripted call; the third turn is the server's alone. Checked:
  * each server turn was asked to continue exactly the trajectory so far, as ids (prompt, assistant ids as
    sampled, tool turns rendered through the chat template), and the tool answers are the calculator's;
  * KV reuse across turns gives the same tokens as re-prefilling the whole history: the same greedy trajectory
    from a server with prefix caching (which reports cache hits on the history) and from one with
    --no-prefix-caching (which prefills everything every turn): equal ids, logprobs within 1e-4;
  * masks: 1 on every assistant token, 0 on tool-turn tokens; server tokens keep the server's logprobs."""
import json
import os
import pathlib
import subprocess

import pytest
import zmq
from transformers import AutoTokenizer

from server_fixtures import BUILD, TandemServer, build_tiny_model, free_port, metric, metrics


def tool_path():
    path = BUILD / "tests" / "trainer_trajectory_serve_tool"
    if not path.exists():
        pytest.skip(f"{path} is not built")
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-trajectory")
    build_tiny_model(d)
    return d


def layout_hash(endpoint):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send_multipart([json.dumps({"type": "hello", "id": 1, "protocol_version": 1}).encode()])
    assert sock.poll(30000), "no hello answer"
    rep = json.loads(sock.recv_multipart()[0])
    sock.close()
    return rep["layout_hash"]


def start(model_dir, *extra):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    return TandemServer(model_dir, "--control", endpoint, "--drain-timeout", "5", *extra), endpoint


def call(expression):
    return "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + \
        "\n</tool_call>"


def run(endpoint, model_dir, script):
    proc = subprocess.run([tool_path(), endpoint, layout_hash(endpoint), str(model_dir)], input=json.dumps(script),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["episodes"]


def test_trajectories_from_servers_reuse_kv(model_dir):
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    eos = [tok.convert_tokens_to_ids("<|im_end|>")]
    questions = [("What is 123456789 * 987654321?", "123456789 * 987654321", "121932631112635269"),
                 ("What is 2 ** 64 - 1?", "2 ** 64 - 1", "18446744073709551615")]
    episodes = []
    for question, expr, _ in questions:
        prompt = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
        episodes.append({"prompt_ids": prompt, "script": {
            "1": {"replace": tok(call(expr), add_special_tokens=False)["input_ids"] + eos},
            "2": {"append": tok(call("1 + 1"), add_special_tokens=False)["input_ids"] + eos,
                  "server_max_tokens": 12}}})
    script = {"format": "hermes", "max_completion_length": 400, "temperature": 0.0, "seed": 5, "episodes": episodes}

    cached, cached_ep = start(model_dir)
    fresh, fresh_ep = start(model_dir, "--no-prefix-caching")
    try:
        first = run(cached_ep, model_dir, script)
        again = run(cached_ep, model_dir, script)
        reprefilled = run(fresh_ep, model_dir, script)
        hits_cached = metric(metrics(cached.url), "vllm:prefix_cache_hits_total")
        hits_fresh = metric(metrics(fresh.url), "vllm:prefix_cache_hits_total")
    finally:
        cached.stop()
        fresh.stop()

    for e, (ep, (_, _, answer)) in enumerate(zip(first, questions)):
        prompt = episodes[e]["prompt_ids"]
        ids, mask = ep["completion_ids"], ep["mask"]
        assert len(ids) == len(mask) == len(ep["logprobs"]) == len(ep["versions"])
        assert [t["turn"] for t in ep["turns"]] == [1, 2, 3] and ep["n_tool_calls"] == 2
        # Every turn continued the trajectory as it stood, as ids.
        full = prompt + ids
        for t in ep["turns"]:
            assert full[:len(t["history"])] == t["history"]
        # Tool turns: rendered answers of the calculator, masked out; everything else is the assistant's.
        tool_text = tok.decode([i for i, m in zip(ids, mask) if m == 0])
        # (the tiny model's plain ChatML template renders the tool role as it renders any role)
        assert f"<|im_start|>tool\n{answer}<|im_end|>\n<|im_start|>assistant\n" in tool_text
        assert "<|im_start|>tool\n2<|im_end|>" in tool_text
        assert 0 < mask.count(0) < len(mask)
        # Server tokens sit in the trajectory with the server's logprobs, and a real policy version.
        for t in ep["turns"][1:]:
            start_at = len(t["history"]) - len(prompt)
            n = len(t["server_ids"])
            assert ids[start_at:start_at + n] == t["server_ids"]
            assert ep["logprobs"][start_at:start_at + n] == pytest.approx(t["server_logprobs"], abs=1e-6)
            assert all(m == 1 for m in mask[start_at:start_at + n])
            assert all(v >= 0 for v in ep["versions"][start_at:start_at + n])
        assert len(ep["turns"][2]["server_ids"]) > 0
        # The same trajectory when the history's KV came from the cache and when it was prefilled again.
        for other in (again[e], reprefilled[e]):
            assert other["completion_ids"] == ids and other["mask"] == mask
            assert other["logprobs"] == pytest.approx(ep["logprobs"], abs=1e-4)
    assert hits_cached > 0 and hits_fresh == 0
