"""Adapter-only weight updates on the ZeroMQ control channel (docs/protocol-zmq.md, weights_begin with "adapter"):
the trainer of a LoRA policy (tandem-train --use-peft, lora_sync adapter) sends the A and B matrices alone, and the
server runs them beside its base weights.

Against PEFT on transformers (adapters made by PEFT itself, B random), with the server's --adapter-update-mode merge
(the default: merged into the served weights from a kept copy of the base) and lowrank (a low-rank path beside the
base weights), and once with a --lora adapter served too (adapter updates then run low-rank, and the --lora
adapter still applies to the base alone):
- an adapter update (fp32 slices of the adapter units, cut at random and shuffled) -> the server's greedy tokens are
  PEFT's, logprobs within 2e-4, policy version 1; a second one of another config (rank, targets, rsLoRA) replaces it,
  and a third of the second's config (the server then reuses its buffers) replaces that;
- a whole-weights update afterwards drops the adapter: the server is exactly the new weights;
- refused, with the server serving on unchanged: transport nccl (a CPU server), an unknown module, another base
  layout, a slice past the adapter units, weights_end before every slice came.
"""
import random

import numpy as np
import pytest
import torch

from server_fixtures import TandemServer, free_port
from test_zmq_control import Client, expect_greedy, models, pack_units, send_update  # noqa: F401

from transformers import AutoModelForCausalLM

from test_zmq_control import PROMPTS

ALIGN = 64
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_model(base_dir, seed, **cfg):
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                           LoraConfig(lora_dropout=0.0, **cfg))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


def adapter_units(model, n_layers):
    """One fp32 unit per decoder layer, as docs/protocol-zmq.md lays an adapter unit out: each targeted module in
    the order q, k, v, o, gate, up, down, its A (r, in) then its B (out, r), each starting at a multiple of 64."""
    sd = model.state_dict()
    units = []
    for layer in range(n_layers):
        parts, off = [], 0
        for mod in MODULES:
            block = "self_attn" if mod in MODULES[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{mod}.lora_%s.default.weight"
            if key % "A" not in sd:
                continue
            for ab in "AB":
                t = sd[key % ab].float().numpy().ravel()
                parts.append(t)
                off += t.size
                pad = -off % ALIGN
                parts.append(np.zeros(pad, np.float32))
                off += pad
        units.append(np.concatenate(parts).astype(np.float32))
    return units


def begin(c, rid, version, layout_hash, adapter, transport="zmq"):
    h = {"type": "weights_begin", "id": rid, "version": version, "transport": transport, "layout_hash": layout_hash,
         "adapter": adapter}
    if transport == "nccl":
        h.update(nccl_id="ab" * 128, nccl_world=2, nccl_rank=1, trainer_ranks=1)
    return c.ask(h)[0]


def send_adapter(c, units, version, layout_hash, adapter, rng, first_id):
    rep = begin(c, first_id, version, layout_hash, adapter)
    assert rep == {"type": "weights_begin", "id": first_id, "version": version}, rep
    slices = []
    for u, flat in enumerate(units):
        cuts = sorted(rng.sample(range(1, flat.size), 2))
        b = [0] + cuts + [flat.size]
        slices += [(u, x, y - x) for x, y in zip(b, b[1:])]
    rng.shuffle(slices)
    for i, (u, off, cnt) in enumerate(slices):
        c.send(dict(type="weights_slice", id=first_id + 1 + i, unit=u, offset=off, count=cnt, dtype="f32"),
               units[u][off:off + cnt].tobytes())
    return c.ask({"type": "weights_end", "id": first_id + 1000, "version": version}, timeout=120)[0]


@pytest.mark.parametrize("mode", ["merge", "lowrank", "merge+lora"])
def test_adapter_updates(models, mode, tmp_path):
    base_dir, cfg = models["base"]["dir"], models["base"]["cfg"]
    L = cfg["num_hidden_layers"]
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    extra = ["--adapter-update-mode", mode.split("+")[0]]
    if mode.endswith("+lora"):
        served = peft_model(base_dir, 13, r=2, lora_alpha=4, target_modules=["o_proj", "up_proj"])
        served.save_pretrained(tmp_path / "served")
        extra += ["--lora", f"served={tmp_path / 'served'}"]
    srv = TandemServer(base_dir, "--control", endpoint, "--drain-timeout", "5", *extra)
    try:
        c = Client(endpoint)
        lh = c.ask({"type": "hello", "id": 1})[0]["layout_hash"]
        rng = random.Random(3)

        one = peft_model(base_dir, 11, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
        desc1 = {"r": 4, "lora_alpha": 8, "use_rslora": False, "target_modules": ["q_proj", "v_proj", "down_proj"]}
        rep = send_adapter(c, adapter_units(one, L), 1, lh, desc1, rng, 100)
        assert rep["type"] == "weights_end" and rep["version"] == 1, rep
        res = expect_greedy(c, one, 2, version=1)
        if mode.endswith("+lora"):   # the --lora adapter applies to the base, not to base + the policy's adapter
            import openai
            oc = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
            for p in PROMPTS:
                out = oc.completions.create(model="served", prompt=p, max_tokens=12, temperature=0,
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
                with torch.no_grad():
                    want = served.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                           eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                assert out.choices[0].token_ids == want, p

        two = peft_model(base_dir, 12, r=2, lora_alpha=3, target_modules="all-linear", use_rslora=True)
        desc2 = {"r": 2, "lora_alpha": 3, "use_rslora": True, "target_modules": MODULES}
        rep = send_adapter(c, adapter_units(two, L), 2, lh, desc2, rng, 200)
        assert rep["type"] == "weights_end" and rep["version"] == 2, rep
        res2 = expect_greedy(c, two, 5, version=2)
        assert [r[1] for r in res.values()] != [r[1] for r in res2.values()], "the two adapters answer alike"
        # A third of the second's shape, other values: the server reuses what it made for the second (lowrank: the
        # serving copy rebuilt in place, its graphs replayed as they are; merge: the layout and scratch).
        three = peft_model(base_dir, 14, r=2, lora_alpha=3, target_modules="all-linear", use_rslora=True)
        rep = send_adapter(c, adapter_units(three, L), 3, lh, desc2, rng, 250)
        assert rep["type"] == "weights_end" and rep["version"] == 3, rep
        res3 = expect_greedy(c, three, 6, version=3)
        assert [r[1] for r in res2.values()] != [r[1] for r in res3.values()], "the update did not change the answers"

        # Whole weights: the adapter goes, the server is the new model alone.
        rep = send_update(c, pack_units(models["upd_a"]["state"], cfg), 4, lh, "f32", rng, 300)
        assert rep["type"] == "weights_end" and rep["version"] == 4, rep
        expect_greedy(c, models["upd_a"]["model"], 4, version=4)

        # Refusals; the server keeps serving version 4.
        units1 = adapter_units(one, L)
        rep = begin(c, 500, 5, lh, desc1, transport="nccl")
        assert rep["type"] == "error" and rep["code"] == "unsupported" and "CPU" in rep["message"], rep
        rep = begin(c, 501, 5, lh, dict(desc1, target_modules=["lm_head"]))
        assert rep["type"] == "error" and rep["code"] == "bad_message" and "lm_head" in rep["message"], rep
        rep = begin(c, 502, 5, "0123456789abcdef", desc1)
        assert rep["type"] == "error" and rep["code"] == "layout_mismatch", rep
        rep = begin(c, 503, 5, lh, dict(desc1, r=0))
        assert rep["type"] == "error" and rep["code"] == "bad_message" and "r" in rep["message"], rep
        rep = begin(c, 504, 5, lh, desc1)
        assert rep["type"] == "weights_begin", rep
        rep = c.ask(dict(type="weights_slice", id=505, unit=L, offset=0, count=4, dtype="f32"),
                    np.zeros(4, np.float32).tobytes())[0]
        assert rep["type"] == "error" and rep["code"] == "bad_slice", rep
        rep = c.ask(dict(type="weights_slice", id=506, unit=0, offset=units1[0].size - 2, count=4, dtype="f32"),
                    np.zeros(4, np.float32).tobytes())[0]
        assert rep["type"] == "error" and rep["code"] == "bad_slice", rep
        c.send(dict(type="weights_slice", id=507, unit=0, offset=0, count=units1[0].size, dtype="f32"),
               units1[0].tobytes())
        rep = c.ask({"type": "weights_end", "id": 508, "version": 5})[0]
        assert rep["type"] == "error" and rep["code"] == "weights_incomplete", rep
        expect_greedy(c, models["upd_a"]["model"], 9, version=4)
        c.close()
    finally:
        srv.stop()
