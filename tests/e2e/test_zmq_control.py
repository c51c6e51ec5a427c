"""tandem-serve's ZeroMQ control channel, end to end: a pyzmq DEALER client against a real server process.

Proves (docs/protocol-zmq.md): hello reports the layout hash of the model's unit layout (recomputed here in Python
from config.json); greedy generate equals transformers, the HTTP API and the model core's greedy decode, with the
right logprobs; n > 1 groups with seeds equal separate requests with seed + i and their logprobs are
log-softmax(logits / T); many generates in flight at once; pause holds generation until resume; every malformed
message gets an error and the server keeps serving; a weight update of a different model (saved by transformers)
sent as f32 and as bf16 slices, split and shuffled, makes the outputs exactly those of the new weights with the
new policy version; an update abandoned midway changes nothing; shutdown exits 0.
"""
import copy
import json
import mmap
import pathlib
import random
import socket
import struct
import subprocess

import numpy as np
import pytest
import torch
import zmq
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from server_fixtures import BUILD, TandemServer, build_tiny_model, free_port, http_json, serve_binary

PROBE = BUILD / "tests" / "model_probe"
LAYOUT_ALIGN = 64
MAX_POS = 256   # a small context, so that "too long" is easy to ask for


# ---- model folders --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Three models of one config: the served one (seed 0) and two updates (seeds 1, 2), each saved by
    transformers and read back from its safetensors file, so the tests use exactly the bytes on disk."""
    serve_binary()   # skips when tandem-serve is not built
    torch.set_num_threads(1)   # tiny matrices: extra threads only fight the server for the cores
    root = tmp_path_factory.mktemp("zmq_models")
    out = {}
    for name, seed in (("base", 0), ("upd_a", 1), ("upd_b", 2)):
        d = root / f"tiny-llama-{name}"
        build_tiny_model(d, seed=seed, max_position_embeddings=MAX_POS)
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        cfg = json.loads((d / "config.json").read_text())
        out[name] = dict(dir=d, model=model, state=load_file(str(d / "model.safetensors")), cfg=cfg)
    assert out["base"]["cfg"] == out["upd_a"]["cfg"] == out["upd_b"]["cfg"]
    return out


# ---- unit layout (docs/layout.md), recomputed independently of the C code --------------------------------

def unit_layout(cfg):
    """Returns (tensors [(name, unit, offset, shape)], unit_numel [..], FNV-1a hash) as shared/layout.c defines."""
    C, I, V, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    Hq = cfg["num_attention_heads"]
    Hkv = cfg.get("num_key_value_heads") or Hq
    D = cfg.get("head_dim") or C // Hq
    tensors, unit_numel = [], []
    state = {"unit": 0, "cursor": 0}

    def add(name, shape):
        off = state["cursor"]
        tensors.append((name, state["unit"], off, shape))
        n = int(np.prod(shape))
        state["cursor"] = (off + n + LAYOUT_ALIGN - 1) // LAYOUT_ALIGN * LAYOUT_ALIGN
        return off

    def end_unit():
        unit_numel.append(state["cursor"])
        state["unit"] += 1
        state["cursor"] = 0

    add("model.embed_tokens.weight", (V, C))
    end_unit()
    for l in range(L):
        p = f"model.layers.{l}."
        add(p + "input_layernorm.weight", (C,))
        add(p + "self_attn.q_proj.weight", (Hq * D, C))
        add(p + "self_attn.k_proj.weight", (Hkv * D, C))
        add(p + "self_attn.v_proj.weight", (Hkv * D, C))
        if cfg.get("attention_bias"):
            add(p + "self_attn.q_proj.bias", (Hq * D,))
            add(p + "self_attn.k_proj.bias", (Hkv * D,))
            add(p + "self_attn.v_proj.bias", (Hkv * D,))
        add(p + "self_attn.o_proj.weight", (C, Hq * D))
        add(p + "post_attention_layernorm.weight", (C,))
        gate = add(p + "mlp.gate_proj.weight", (I, C))
        state["cursor"] = gate + I * C          # up_proj directly after gate_proj: one fused (2I, C) matrix
        add(p + "mlp.up_proj.weight", (I, C))
        add(p + "mlp.down_proj.weight", (C, I))
        end_unit()
    add("model.norm.weight", (C,))
    if not cfg.get("tie_word_embeddings"):
        add("lm_head.weight", (V, C))
    end_unit()
    h = 1469598103934665603
    for name, unit, off, shape in tensors:
        rec = name.encode() + b"\0" + struct.pack("<5q", unit, off, len(shape), shape[0],
                                                   shape[1] if len(shape) == 2 else 1)
        for byte in rec:
            h = ((h ^ byte) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return tensors, unit_numel, h


def pack_units(state, cfg):
    """HF state dict -> list of flat float32 units (padding zero)."""
    tensors, unit_numel, _ = unit_layout(cfg)
    assert {t[0] for t in tensors} == set(state), "the saved tensors and the layout disagree"
    units = [np.zeros(n, np.float32) for n in unit_numel]
    for name, unit, off, shape in tensors:
        t = state[name].to(torch.float32).numpy().reshape(-1)
        assert t.size == int(np.prod(shape)), name
        units[unit][off:off + t.size] = t
    return units


def bf16_bytes(flat):
    return torch.from_numpy(np.ascontiguousarray(flat)).to(torch.bfloat16).view(torch.int16).numpy().tobytes()


def bf16_rounded(model):
    """The model as the server holds it after a bf16 update: each weight rounded to bf16, computed in fp32."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    return m.eval()


# ---- references ---------------------------------------------------------------------------------------

_GREEDY = {}


@torch.no_grad()
def hf_greedy(model, prompt, k):
    """Greedy continuation (no eos) and each chosen token's log-softmax, recomputing the sequence every step
    (memoised: the same references are asked for again after each weight update)."""
    key = (model, tuple(prompt), k)   # the model itself, not id(): a freed model's id can be reused
    if key not in _GREEDY:
        _GREEDY[key] = _hf_greedy(model, prompt, k)
    return _GREEDY[key]


def _hf_greedy(model, prompt, k):
    ids = list(prompt)
    toks, lps = [], []
    for _ in range(k):
        logits = model(torch.tensor([ids])).logits[0, -1]
        t = int(torch.argmax(logits))
        toks.append(t)
        lps.append(float(torch.log_softmax(logits, -1)[t]))
        ids.append(t)
    return toks, np.array(lps, np.float32)


@torch.no_grad()
def hf_logprobs(model, prompt, completion, temperature):
    """log-softmax(logits / T) of each completion token given the prompt and the tokens before it."""
    ids = torch.tensor([list(prompt) + list(completion)])
    logits = model(ids).logits[0, len(prompt) - 1:-1] / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion).view(-1, 1)).view(-1).numpy()


# ---- server process and client ---------------------------------------------------------------------------

def start_server(model_dir):
    """A tandem-serve with --control on a free port; returns (server, endpoint)."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    return TandemServer(model_dir, "--control", endpoint, "--drain-timeout", "5"), endpoint


class Client:
    def __init__(self, endpoint):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, header, *frames):
        h = header if isinstance(header, bytes) else json.dumps(header).encode()
        self.sock.send_multipart([h] + [bytes(f) for f in frames])

    def recv(self, timeout=60.0):
        if not self.sock.poll(int(timeout * 1000)):
            raise TimeoutError("no message from the server")
        parts = self.sock.recv_multipart()
        return json.loads(parts[0]), parts[1:]

    def ask(self, header, *frames, timeout=60.0):
        self.send(header, *frames)
        return self.recv(timeout)

    def generate(self, gid, prompts, timeout=120.0, **sampling):
        """Sends one generate and returns its results by prompt index: (header, [tokens], [logprobs])."""
        self.send(dict(type="generate", id=gid, n_prompts=len(prompts), **sampling),
                  *[np.asarray(p, np.int32).tobytes() for p in prompts])
        out = {}
        while len(out) < len(prompts):
            h, frames = self.recv(timeout)
            assert h["type"] == "result" and h["id"] == gid, h
            out[h["prompt_index"]] = split_result(h, frames)
        return out

    def close(self):
        self.sock.close(0)


def split_result(h, frames):
    assert len(frames) == 2
    tok = np.frombuffer(frames[0], np.int32)
    lp = np.frombuffer(frames[1], np.float32)
    cuts = np.cumsum(h["completion_lens"])[:-1]
    return h, [list(map(int, t)) for t in np.split(tok, cuts)], np.split(lp, cuts)


@pytest.fixture(scope="module")
def server(models):
    srv, endpoint = start_server(models["base"]["dir"])
    srv.endpoint = endpoint
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    c = Client(server.endpoint)
    yield c
    c.close()


PROMPTS = [[1, 17, 250, 3, 99, 42, 7], [1, 5], [1, 200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 210, 211,
                                               212, 213, 214, 215, 216, 217, 218]]


def expect_greedy(c, model, gid, prompts=PROMPTS, k=12, version=0):
    res = c.generate(gid, prompts, max_tokens=k, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        h, toks, lps = res[i]
        ref_t, ref_lp = hf_greedy(model, p, k)
        assert toks == [ref_t], f"prompt {i}: server {toks[0]} vs transformers {ref_t}"
        np.testing.assert_allclose(lps[0], ref_lp, atol=2e-4, rtol=0)
        assert h["finish_reasons"] == ["length"] and h["prompt_tokens"] == len(p)
        assert h["policy_versions"] == [version] and h["policy_versions_end"] == [version]
    return res


# ---- tests ----------------------------------------------------------------------------------------------

def test_hello_reports_the_model_layout(client, models):
    cfg = models["base"]["cfg"]
    _, unit_numel, h = unit_layout(cfg)
    rep, frames = client.ask({"type": "hello", "id": 11, "protocol_version": 1})
    assert frames == []
    assert rep["type"] == "hello" and rep["id"] == 11 and rep["protocol_version"] == 1
    assert rep["layout_hash"] == f"{h:016x}"
    assert rep["n_units"] == cfg["num_hidden_layers"] + 2 and rep["unit_numel"] == unit_numel
    assert rep["policy_version"] == 0 and rep["max_seq_len"] == MAX_POS and rep["vocab_size"] == cfg["vocab_size"]
    assert rep["model_id"] == models["base"]["dir"].name
    rep, _ = client.ask({"type": "hello", "id": 12, "protocol_version": 2})
    assert rep["type"] == "error" and rep["id"] == 12 and rep["code"] == "unsupported_version", rep


def test_greedy_equals_transformers_http_and_model_core(client, server, models):
    k = 12
    res = expect_greedy(client, models["base"]["model"], 20, k=k)
    # The HTTP API of the same server.
    for i, p in enumerate(PROMPTS):
        status, body, _ = http_json("POST", server.url + "/v1/completions",
                                    {"prompt": p, "max_tokens": k, "temperature": 0, "ignore_eos": True,
                                     "return_token_ids": True})
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == res[i][1][0]
    # The model core's plain greedy decode (model_generate_greedy), when the probe tool is built.
    if PROBE.exists():
        out = subprocess.run([str(PROBE), "generate", str(models["base"]["dir"])], capture_output=True, text=True,
                             input=json.dumps({"prompts": PROMPTS, "max_new_tokens": k}), timeout=120)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["tokens"] == [res[i][1][0] for i in range(len(PROMPTS))]


def test_groups_with_seeds_and_temperature_logprobs(client, models):
    model = models["base"]["model"]
    T, k, n, seed = 0.8, 10, 4, 1234
    res = client.generate(30, PROMPTS[:2], n=n, max_tokens=k, temperature=T, seed=seed, ignore_eos=True)
    for i, p in enumerate(PROMPTS[:2]):
        h, toks, lps = res[i]
        assert h["n"] == n and h["completion_lens"] == [k] * n and h["n_prompts"] == 2
        assert h["finish_reasons"] == ["length"] * n and h["policy_versions"] == [0] * n
        assert len({tuple(t) for t in toks}) > 1, "four samples at T=0.8 came out identical"
        for t, lp in zip(toks, lps):
            assert all(0 <= x < models["base"]["cfg"]["vocab_size"] for x in t)
            np.testing.assert_allclose(lp, hf_logprobs(model, p, t, T), atol=2e-4, rtol=0)
    # Completion j of a group samples from seed + j: a lone request with that seed gives the same tokens.
    for j in (0, 3):
        alone = client.generate(31 + j, [PROMPTS[0]], n=1, max_tokens=k, temperature=T, seed=seed + j,
                                ignore_eos=True)
        assert alone[0][1][0] == res[0][1][j]


def test_many_generates_in_flight(client, models):
    model = models["base"]["model"]
    msgs = {100 + m: [PROMPTS[m % 3], PROMPTS[(m + 1) % 3]] for m in range(6)}
    for gid, prompts in msgs.items():   # all sent before anything is read
        client.send(dict(type="generate", id=gid, n_prompts=2, max_tokens=4 + gid % 5, temperature=0,
                         ignore_eos=True), *[np.asarray(p, np.int32).tobytes() for p in prompts])
    seen = {}
    while len(seen) < 12:
        h, frames = client.recv(120)
        assert h["type"] == "result", h
        key = (h["id"], h["prompt_index"])
        assert key not in seen
        seen[key] = split_result(h, frames)[1][0]
    for (gid, pi), toks in seen.items():
        assert toks == hf_greedy(model, msgs[gid][pi], 4 + gid % 5)[0]


def test_pause_holds_generation_until_resume(client, models):
    rep, _ = client.ask({"type": "pause", "id": 40})
    assert rep == {"type": "pause", "id": 40}
    st, _ = client.ask({"type": "stats", "id": 41})
    assert st["paused"] is True
    client.send(dict(type="generate", id=42, n_prompts=1, max_tokens=6, temperature=0, ignore_eos=True),
                np.asarray(PROMPTS[0], np.int32).tobytes())
    assert not client.sock.poll(1500), "a result arrived while the engine was paused"
    st, _ = client.ask({"type": "stats", "id": 43})
    assert st["prompts_in_flight"] == 1 and st["paused"] is True
    rep, _ = client.ask({"type": "resume", "id": 44})
    assert rep == {"type": "resume", "id": 44}
    h, frames = client.recv(60)
    assert h["type"] == "result" and h["id"] == 42
    assert split_result(h, frames)[1][0] == hf_greedy(models["base"]["model"], PROMPTS[0], 6)[0]
    st, _ = client.ask({"type": "stats", "id": 45})
    assert st["paused"] is False and st["prompts_in_flight"] == 0 and st["generation_tokens_total"] > 0
    assert st["kv_blocks_total"] > 0
    rep, _ = client.ask({"type": "reset_cache", "id": 46})
    assert rep == {"type": "reset_cache", "id": 46}


def test_malformed_messages_get_errors_and_the_server_keeps_serving(client, models):
    _, unit_numel, h = unit_layout(models["base"]["cfg"])
    good_hash = f"{h:016x}"
    p = np.asarray(PROMPTS[0], np.int32).tobytes()
    cases = [
        # (header bytes or dict, frames, expected code, expected id, words that the message must contain)
        (b"{not json", [], "bad_message", None, ["not valid JSON"]),
        (b"", [], "bad_message", None, ["not valid JSON"]),
        (b"[1, 2]", [], "bad_message", None, ["JSON object"]),
        ({"type": "frobnicate", "id": 3}, [], "bad_message", 3, ["unknown message type", "frobnicate"]),
        ({"type": "result", "id": 4}, [], "bad_message", 4, ["not valid as a request"]),
        ({"type": "hello"}, [], "bad_message", None, ["\"id\" is missing"]),
        ({"type": "hello", "id": 5}, [b"x"], "bad_message", 5, ["expected 1 frame"]),
        ({"type": "generate", "id": 6, "n_prompts": 1}, [p[:7]], "bad_message", 6, ["frame 1", "7 bytes"]),
        ({"type": "generate", "id": 7, "n_prompts": 2}, [p], "bad_message", 7, ["3 frames are expected, got 2"]),
        ({"type": "generate", "id": 8, "n_prompts": 1, "max_token": 5}, [p], "bad_message", 8,
         ["unknown field", "max_token"]),
        ({"type": "generate", "id": 9, "n_prompts": 1, "top_p": 1.5}, [p], "bad_message", 9, ["top_p"]),
        ({"type": "generate", "id": 10, "n_prompts": 1, "n": "4"}, [p], "bad_message", 10, ["\"n\"", "integer"]),
        ({"type": "generate", "id": 11, "n_prompts": 1}, [np.asarray([1, 5000], np.int32).tobytes()], "invalid",
         11, ["prompt 0"]),
        ({"type": "generate", "id": 12, "n_prompts": 1, "max_tokens": 1000}, [p], "too_long", 12, ["prompt 0"]),
        ({"type": "weights_slice", "id": 13, "unit": 0, "offset": 0, "count": 2, "dtype": "f32"}, [b"\0" * 8],
         "bad_slice", 13, ["no weight update is open"]),
        ({"type": "weights_begin", "id": 14, "version": 9, "transport": "zmq", "layout_hash": "0123456789abcdef"},
         [], "layout_mismatch", 14, ["0123456789abcdef", good_hash]),
        ({"type": "weights_begin", "id": 15, "version": 9, "transport": "nccl", "layout_hash": good_hash}, [],
         "bad_message", 15, ["trainer_ranks"]),
        ({"type": "weights_begin", "id": 15, "version": 9, "transport": "nccl", "layout_hash": good_hash,
          "trainer_ranks": 1, "nccl_world": 2, "nccl_rank": 0, "nccl_id": "ab" * 128}, [],
         "bad_message", 15, ["nccl_rank"]),
        ({"type": "weights_begin", "id": 15, "version": 9, "transport": "nccl", "layout_hash": good_hash,
          "trainer_ranks": 1, "nccl_world": 2, "nccl_rank": 1, "nccl_id": "AB" * 128}, [],
         "bad_message", 15, ["nccl_id"]),
        # A CPU server cannot take NCCL: it says so, and the trainer's `auto` falls back to zmq.
        ({"type": "weights_begin", "id": 15, "version": 9, "transport": "nccl", "layout_hash": good_hash,
          "trainer_ranks": 1, "nccl_world": 2, "nccl_rank": 1, "nccl_id": "ab" * 128}, [],
         "unsupported", 15, ["CPU", "transport \"zmq\""]),
        # transport nccl's CPU twin (the host communicator): a backend name it does not know, shards that do not fit
        # the communicator, and a trainer that cut the units for 2 shards when this server runs 1.
        ({"type": "weights_begin", "id": 15, "version": 9, "transport": "nccl", "layout_hash": good_hash,
          "trainer_ranks": 1, "nccl_world": 2, "nccl_rank": 1, "nccl_id": "ab" * 128, "comm_backend": "tcp"}, [],
         "bad_message", 15, ["comm_backend", "tcp"]),
        ({"type": "weights_begin", "id": 15, "version": 9, "transport": "nccl", "layout_hash": good_hash,
          "trainer_ranks": 1, "nccl_world": 2, "nccl_rank": 1, "nccl_id": "ab" * 128, "comm_backend": "host",
          "tensor_parallel_size": 2}, [], "bad_message", 15, ["tensor_parallel_size", "nccl_world 2"]),
        ({"type": "weights_begin", "id": 15, "version": 9, "transport": "nccl", "layout_hash": good_hash,
          "trainer_ranks": 1, "nccl_world": 3, "nccl_rank": 1, "nccl_id": "ab" * 128, "comm_backend": "host",
          "tensor_parallel_size": 2}, [], "layout_mismatch", 15, ["2 tensor-parallel shard(s)", "this server runs 1"]),
        # Transport ipc: the sender's host is required and checked, the fields belong to it alone, the shard count
        # must match, and adapters do not go this way.
        ({"type": "weights_begin", "id": 15, "version": 9, "transport": "ipc", "layout_hash": good_hash}, [],
         "bad_message", 15, ["ipc_host"]),
        ({"type": "weights_begin", "id": 15, "version": 9, "transport": "ipc", "layout_hash": good_hash,
          "ipc_host": ""}, [], "bad_message", 15, ["ipc_host", "1 to 63 bytes"]),
        ({"type": "weights_begin", "id": 15, "version": 9, "transport": "ipc", "layout_hash": good_hash,
          "ipc_host": 7}, [], "bad_message", 15, ["ipc_host"]),
        ({"type": "weights_begin", "id": 15, "version": 9, "transport": "zmq", "layout_hash": good_hash,
          "ipc_host": boot_id()}, [], "bad_message", 15, ["ipc_host", "belongs to transport \"ipc\""]),
        ({"type": "weights_begin", "id": 15, "version": 9, "transport": "ipc", "layout_hash": good_hash,
          "ipc_host": boot_id(), "tensor_parallel_size": 0}, [], "bad_message", 15, ["tensor_parallel_size"]),
        ({"type": "weights_begin", "id": 15, "version": 9, "transport": "shm", "layout_hash": good_hash}, [],
         "bad_message", 15, ["transport", "\"ipc\""]),
        ({"type": "weights_begin", "id": 15, "version": 9, "transport": "ipc", "layout_hash": good_hash,
          "ipc_host": "another-machine"}, [], "unsupported", 15,
         ["this server's host", "another-machine", "transport \"nccl\" or \"zmq\""]),
        ({"type": "weights_begin", "id": 15, "version": 9, "transport": "ipc", "layout_hash": good_hash,
          "ipc_host": boot_id(), "tensor_parallel_size": 2}, [], "layout_mismatch", 15,
         ["2 tensor-parallel shard(s)", "this server runs 1"]),
        ({"type": "weights_begin", "id": 15, "version": 9, "transport": "ipc", "layout_hash": good_hash,
          "ipc_host": boot_id(), "adapter": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}}, [],
         "unsupported", 15, ["adapter updates over transport \"ipc\"", "--lora-sync merged"]),
        ({"type": "weights_slice", "id": 16, "unit": 0, "offset": 0, "count": 2, "dtype": "f32"}, [b"\0" * 6],
         "bad_message", 16, ["6 bytes, expected 8"]),
        ({"type": "generate", "id": 17, "n_prompts": 4097}, [p] * 4097, "bad_message", None,
         ["more than 4097 frames"]),
    ]
    for header, frames, code, mid, words in cases:
        rep, extra = client.ask(header, *frames)
        assert rep["type"] == "error" and rep["code"] == code and rep["id"] == mid and extra == [], (header, rep)
        for w in words:
            assert w in rep["message"], (header, rep)
        alive, _ = client.ask({"type": "hello", "id": 99})
        assert alive["type"] == "hello", (header, alive)
    # Inside an open update: slices outside the layout, and weights_end before every unit is complete.
    rep, _ = client.ask({"type": "weights_begin", "id": 50, "version": 9, "transport": "zmq", "layout_hash": good_hash})
    assert rep == {"type": "weights_begin", "id": 50, "version": 9}
    last = len(unit_numel) - 1
    for hdr, words in [
        ({"unit": len(unit_numel), "offset": 0, "count": 2}, [f"unit {len(unit_numel)} out of range"]),
        ({"unit": last, "offset": unit_numel[last] - 1, "count": 2}, [f"outside unit {last}"]),
    ]:
        rep, _ = client.ask(dict(type="weights_slice", id=51, dtype="f32", **hdr), b"\0" * 8)
        assert rep["type"] == "error" and rep["code"] == "bad_slice", rep
        assert all(w in rep["message"] for w in words), rep
    client.send(dict(type="weights_slice", id=52, unit=1, offset=0, count=4, dtype="f32"), b"\0" * 16)
    rep, _ = client.ask({"type": "weights_end", "id": 53, "version": 9})
    assert rep["type"] == "error" and rep["code"] == "weights_incomplete" and "unit 0 is incomplete" in rep["message"]
    rep, _ = client.ask({"type": "weights_end", "id": 54, "version": 8})
    assert rep["code"] == "weights_incomplete" and "version 8 does not match" in rep["message"]
    # Nothing of that reached the live weights: the outputs and the version are the original ones.
    expect_greedy(client, models["base"]["model"], 55, k=8, version=0)
    hello, _ = client.ask({"type": "hello", "id": 56})
    assert hello["policy_version"] == 0


def boot_id():
    return pathlib.Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def send_update(c, units, version, layout_hash, dtype, rng, first_id, slices_per_unit=3, stop_after=None):
    """weights_begin, every unit cut at random points into slices sent in shuffled order, weights_end.
    stop_after=k sends only k slices and returns without weights_end. Returns the weights_end reply."""
    rep, _ = c.ask({"type": "weights_begin", "id": first_id, "version": version, "transport": "zmq",
                    "layout_hash": layout_hash})
    assert rep == {"type": "weights_begin", "id": first_id, "version": version}, rep
    slices = []
    for u, flat in enumerate(units):
        cuts = sorted(rng.sample(range(1, flat.size), slices_per_unit - 1))
        bounds = [0] + cuts + [flat.size]
        slices += [(u, a, b - a) for a, b in zip(bounds, bounds[1:])]
    rng.shuffle(slices)
    for i, (u, off, cnt) in enumerate(slices[:stop_after]):
        chunk = units[u][off:off + cnt]
        data = chunk.tobytes() if dtype == "f32" else bf16_bytes(chunk)
        c.send(dict(type="weights_slice", id=first_id + 1 + i, unit=u, offset=off, count=cnt, dtype=dtype), data)
    if stop_after is not None:
        return None
    rep, _ = c.ask({"type": "weights_end", "id": first_id + 1000, "version": version}, timeout=120)
    return rep   # slices are answered only on error: the first reply after them is weights_end's


def ipc_begin(c, units, version, layout_hash, msg_id):
    """weights_begin with transport ipc; checks the reply's staging against this model. Returns its "ipc"."""
    rep, _ = c.ask({"type": "weights_begin", "id": msg_id, "version": version, "transport": "ipc",
                    "layout_hash": layout_hash, "ipc_host": boot_id()})
    assert rep["type"] == "weights_begin" and rep["version"] == version, rep
    ipc = rep["ipc"]
    assert ipc["memory"] == "shm" and ipc["host"] == boot_id() and len(ipc["shards"]) == 1, ipc
    offsets = np.cumsum([0] + [(u.size * 4 + 255) // 256 * 256 for u in units])
    shard = ipc["shards"][0]
    assert shard["bytes"] == offsets[-1] and shard["handle"].startswith(f"/tandem-ipc-{ipc['pid']}-s0"), ipc
    return ipc


def ipc_write(ipc, units):
    """What a trainer rank on this host does: the units (fp32, the CPU server's storage dtype) straight into the shared
    memory the reply names, each at its 256-byte-aligned offset."""
    offsets = np.cumsum([0] + [(u.size * 4 + 255) // 256 * 256 for u in units])
    shard = ipc["shards"][0]
    with open("/dev/shm" + shard["handle"], "r+b") as f, mmap.mmap(f.fileno(), shard["bytes"]) as mem:
        for u, at in zip(units, offsets):
            mem[at:at + u.size * 4] = u.astype("<f4").tobytes()


def ipc_update(c, units, version, layout_hash, first_id):
    """weights_begin, the units written, weights_end. Returns (the weights_begin reply's "ipc", the weights_end
    reply)."""
    ipc = ipc_begin(c, units, version, layout_hash, first_id)
    ipc_write(ipc, units)
    end, _ = c.ask({"type": "weights_end", "id": first_id + 1, "version": version})
    return ipc, end


def test_weight_update_over_ipc_shared_memory(models):
    srv, endpoint = start_server(models["base"]["dir"])
    cfg = models["base"]["cfg"]
    try:
        c = Client(endpoint)
        lh = c.ask({"type": "hello", "id": 1})[0]["layout_hash"]
        units_a, units_b = pack_units(models["upd_a"]["state"], cfg), pack_units(models["upd_b"]["state"], cfg)
        first, rep = ipc_update(c, units_a, 1, lh, 10)
        assert rep["type"] == "weights_end" and rep["version"] == 1, rep
        expect_greedy(c, models["upd_a"]["model"], 12, version=1)
        # The update became the live weights where it was written: the next one goes into a second region, the one
        # after into the first again (the live weights and the staging take turns), under the same staging id.
        second, rep = ipc_update(c, units_b, 2, lh, 20)
        assert rep["type"] == "weights_end" and rep["version"] == 2, rep
        assert second["staging_id"] == first["staging_id"] and second["shards"] != first["shards"], (second, first)
        expect_greedy(c, models["upd_b"]["model"], 22, version=2)
        # weights_end for another version than the open one is refused and leaves the update open.
        assert ipc_begin(c, units_a, 3, lh, 30) == first
        rep, _ = c.ask({"type": "weights_end", "id": 31, "version": 4})
        assert rep["code"] == "internal" and "open ipc update is another version" in rep["message"], rep
        ipc_write(first, units_a)
        rep, _ = c.ask({"type": "weights_end", "id": 32, "version": 3})
        assert rep["type"] == "weights_end" and rep["version"] == 3, rep
        expect_greedy(c, models["upd_a"]["model"], 33, version=3)
        # A zmq weights_begin abandons an open ipc update (its weights_end then belongs to the incomplete zmq one).
        assert ipc_begin(c, units_b, 4, lh, 40) == second
        ipc_write(second, units_b)
        rep, _ = c.ask({"type": "weights_begin", "id": 41, "version": 5, "transport": "zmq", "layout_hash": lh})
        assert rep == {"type": "weights_begin", "id": 41, "version": 5}, rep
        rep, _ = c.ask({"type": "weights_end", "id": 42, "version": 4})
        assert rep["code"] == "weights_incomplete", rep
        expect_greedy(c, models["upd_a"]["model"], 43, version=3)
        # A clean shutdown removes the shared memory.
        names = [pathlib.Path("/dev/shm" + x["shards"][0]["handle"]) for x in (first, second)]
        assert all(n.exists() for n in names)
        rep, _ = c.ask({"type": "shutdown", "id": 50})
        assert srv.proc.wait(60) == 0, srv.log_text()
        assert not any(n.exists() for n in names)
        c.close()
    finally:
        srv.stop()


def test_an_oversized_frame_disconnects_its_sender_only(server, client):
    """A frame past the server's cap (64 MiB: ZMQ_MAXMSGSIZE) is not buffered whole: its sender is disconnected
    unanswered, and every other client is served as before."""
    big = Client(server.endpoint)
    try:
        big.send({"type": "hello", "id": 1}, b"\0" * (80 << 20))
        with pytest.raises(TimeoutError):
            big.recv(timeout=3)
    finally:
        big.close()
    rep, _ = client.ask({"type": "hello", "id": 2, "protocol_version": 1})
    assert rep["type"] == "hello" and rep["id"] == 2, rep
    assert server.alive()


def test_a_control_port_in_use_is_a_clear_startup_error(models):
    """Another process holding the --control port: tandem-serve exits 1 at start-up, naming the port and the fix."""
    holder = socket.socket()
    port = free_port()
    holder.bind(("127.0.0.1", port))
    holder.listen(1)
    try:
        out = subprocess.run([serve_binary(), "--model", models["base"]["dir"], "--port", "0", "--kv-cache-memory",
                              "64M", "--control", f"tcp://127.0.0.1:{port}"], capture_output=True, text=True,
                             timeout=120)
    finally:
        holder.close()
    log = out.stdout + out.stderr
    assert out.returncode == 1, log
    assert f"cannot bind tcp://127.0.0.1:{port}" in log and "another process holds that port" in log, log


def test_weight_update_over_zmq(models):
    srv, endpoint = start_server(models["base"]["dir"])
    cfg = models["base"]["cfg"]
    try:
        c = Client(endpoint)
        hello, _ = c.ask({"type": "hello", "id": 1})
        lh = hello["layout_hash"]
        rng = random.Random(7)
        base = models["base"]["model"]
        expect_greedy(c, base, 2, version=0)

        # fp32 slices of model A -> exactly model A's outputs, policy version 1.
        units_a = pack_units(models["upd_a"]["state"], cfg)
        assert [u.size for u in units_a] == hello["unit_numel"]
        rep = send_update(c, units_a, 1, lh, "f32", rng, 1000)
        assert rep["type"] == "weights_end" and rep["version"] == 1, rep
        assert rep["seconds"] >= rep["commit_seconds"] >= 0
        res_a = expect_greedy(c, models["upd_a"]["model"], 3, version=1)
        assert [res_a[i][1][0] for i in range(len(PROMPTS))] != [hf_greedy(base, p, 12)[0] for p in PROMPTS]
        assert c.ask({"type": "hello", "id": 4})[0]["policy_version"] == 1

        # bf16 slices of model B -> model B rounded to bf16, policy version 2.
        units_b = pack_units(models["upd_b"]["state"], cfg)
        rep = send_update(c, units_b, 2, lh, "bf16", rng, 2000, slices_per_unit=4)
        assert rep["type"] == "weights_end" and rep["version"] == 2, rep
        model_b16 = bf16_rounded(models["upd_b"]["model"])
        expect_greedy(c, model_b16, 5, version=2)

        # An update abandoned midway (half the slices, then the client goes away) changes nothing.
        send_update(c, units_a, 3, lh, "f32", rng, 3000, stop_after=len(units_a) * 3 // 2)
        c.close()
        c = Client(endpoint)
        expect_greedy(c, model_b16, 6, version=2)
        assert c.ask({"type": "hello", "id": 7})[0]["policy_version"] == 2
        rep, _ = c.ask({"type": "weights_end", "id": 8, "version": 3})
        assert rep["type"] == "error" and rep["code"] == "weights_incomplete" and "another peer" in rep["message"]
        expect_greedy(c, model_b16, 9, version=2)

        # A fresh, complete update from the new client lands again.
        rep = send_update(c, units_a, 4, lh, "f32", rng, 4000, slices_per_unit=2)
        assert rep["type"] == "weights_end" and rep["version"] == 4, rep
        expect_greedy(c, models["upd_a"]["model"], 10, version=4)
        st, _ = c.ask({"type": "stats", "id": 11})
        assert st["policy_version"] == 4

        # shutdown: acknowledged, then the process exits 0.
        rep, _ = c.ask({"type": "shutdown", "id": 12})
        assert rep == {"type": "shutdown", "id": 12}
        assert srv.proc.wait(60) == 0, srv.log_text()
        c.close()
    finally:
        srv.stop()
