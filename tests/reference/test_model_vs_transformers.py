"""tandem's model core (CPU backend, fp32) against PyTorch / transformers on tiny random models.

Tolerances (fp32 on both sides, different summation orders):
  logits, logprobs, loss: max |ours - ref| / max |ref| <= 1e-4
  parameter gradients: ||ours - ref||_2 / ||ref||_2 <= 1e-4, for every tensor
  10 AdamW steps: every step's loss within 1e-4 relative
  greedy decoding: identical token ids
"""
import json
import pathlib

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import tiny_models
from conftest import run_tool, tool

torch.set_num_threads(2)
ARCHS = list(tiny_models.SPECS)
# Three sequences of different lengths, packed without padding; one of length 1 has nothing to score.
SEQ_LENS = [9, 1, 14]


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    model = tiny_models.build(request.param, d)
    return request.param, d, model


def make_batch(vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in SEQ_LENS]


def reference_forward(model, seqs, temperature=1.0, entropy_weight=0.0):
    """Per-sequence forward (no padding): logits, per-token logprobs of the next token, mean CE loss (plus
    entropy_weight x the mean entropy of softmax(logits / T) over the scored positions), grads."""
    model.zero_grad()
    logits_all, lp_all, total, count, ent_total = [], [], 0.0, 0, 0.0
    for s in seqs:
        ids = torch.tensor([s])
        logits = model(input_ids=ids).logits[0]  # (T, V)
        logits_all.append(logits)
        lp = torch.log_softmax(logits / temperature, dim=-1)
        tgt = torch.tensor(s[1:] + [0])
        gathered = lp.gather(1, tgt[:, None])[:, 0]
        gathered = torch.cat([gathered[:-1], torch.zeros(1)])  # last position has no target
        lp_all.append(gathered)
        total = total - gathered[:-1].sum()
        ent_total = ent_total + (-(lp.exp() * lp).sum(-1))[:-1].sum()
        count += len(s) - 1
    loss = total / count + entropy_weight * ent_total / count
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return torch.cat(logits_all).detach(), torch.cat(lp_all).detach(), loss.item(), grads


def probe_forward(model_dir, seqs, out, temperature=1.0, checkpoint=False, entropy_weight=0.0):
    req = {"sequences": seqs, "temperature": temperature, "checkpoint": checkpoint, "entropy_weight": entropy_weight}
    run_tool([tool("model_probe"), "forward", str(model_dir), str(out)], stdin=json.dumps(req))
    return load_file(str(out))


def rel_max(ours, ref):
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def rel_l2(ours, ref):
    return ((ours - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("checkpoint", [False, True], ids=["saved-acts", "recompute"])
def test_logits_logprobs_loss_and_grads(tiny, tmp_path, checkpoint):
    name, model_dir, model = tiny
    seqs = make_batch(model.config.vocab_size)
    ref_logits, ref_lp, ref_loss, ref_grads = reference_forward(model, seqs)
    got = probe_forward(model_dir, seqs, tmp_path / "out.safetensors", checkpoint=checkpoint)
    assert rel_max(got["logits"], ref_logits) <= 1e-4
    assert rel_max(got["logprobs"], ref_lp) <= 1e-4
    assert abs(got["loss"].item() - ref_loss) / abs(ref_loss) <= 1e-4
    tied = model.config.tie_word_embeddings
    for pname, g in ref_grads.items():
        if tied and pname == "lm_head.weight":
            continue  # the same tensor as embed_tokens: its gradient is the embedding's
        key = "grad." + pname
        assert key in got, f"{name}: no gradient for {pname}"
        err = rel_l2(got[key], g)
        assert err <= 1e-4, f"{name}: gradient of {pname} off by {err:.2e}"


def test_entropy_term_gradients(tiny, tmp_path):
    """The GRPO entropy bonus: gradients of CE + 0.3 x mean entropy (at temperature 0.8) equal torch's."""
    name, model_dir, model = tiny
    seqs = make_batch(model.config.vocab_size, seed=7)
    _, _, ref_loss, ref_grads = reference_forward(model, seqs, temperature=0.8, entropy_weight=0.3)
    got = probe_forward(model_dir, seqs, tmp_path / "out.safetensors", temperature=0.8, entropy_weight=0.3)
    tied = model.config.tie_word_embeddings
    for pname, g in ref_grads.items():
        if tied and pname == "lm_head.weight":
            continue
        err = rel_l2(got["grad." + pname], g)
        assert err <= 1e-4, f"{name}: gradient of {pname} off by {err:.2e}"


def test_logprobs_with_temperature(tiny, tmp_path):
    name, model_dir, model = tiny
    seqs = make_batch(model.config.vocab_size, seed=3)
    _, ref_lp, _, _ = reference_forward(model, seqs, temperature=0.7)
    got = probe_forward(model_dir, seqs, tmp_path / "out.safetensors", temperature=0.7)
    assert rel_max(got["logprobs"], ref_lp) <= 1e-4


def test_adamw_ten_steps(tiny):
    name, model_dir, model = tiny
    seqs = make_batch(model.config.vocab_size, seed=5)
    hp = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(ref.parameters(), **hp, foreach=False)
    ref_losses = []
    for _ in range(10):
        _, _, loss, _ = reference_forward(ref, seqs)
        ref_losses.append(loss)
        opt.step()
    req = {"sequences": seqs, "steps": 10, "lr": hp["lr"], "beta1": hp["betas"][0], "beta2": hp["betas"][1],
           "eps": hp["eps"], "weight_decay": hp["weight_decay"]}
    got = json.loads(run_tool([tool("model_probe"), "adamw", str(model_dir)], stdin=json.dumps(req)))["losses"]
    assert len(got) == 10
    for step, (a, b) in enumerate(zip(got, ref_losses)):
        assert abs(a - b) / abs(b) <= 1e-4, f"{name}: step {step} loss {a} vs torch {b}"
    assert ref_losses[-1] < ref_losses[0]


def test_greedy_generation_matches_generate(tiny):
    name, model_dir, model = tiny
    prompts = [[5, 17, 33, 4], [100, 7], [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 21]]
    max_new = 20
    want = []
    for p in prompts:
        out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new,
                             eos_token_id=None, pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    req = {"prompts": prompts, "max_new_tokens": max_new}
    got = json.loads(run_tool([tool("model_probe"), "generate", str(model_dir)], stdin=json.dumps(req)))["tokens"]
    assert got == want


@pytest.mark.parametrize("variant", ["fp32", "bf16-sharded"])
def test_saved_model_loads_in_transformers(tiny, tmp_path, variant):
    name, model_dir, model = tiny
    out_dir = tmp_path / "saved"
    args = [tool("model_probe"), "save", str(model_dir), str(out_dir)]
    if variant == "bf16-sharded":
        args += ["--bf16", "--max-shard-bytes", "40000"]
    run_tool(args)
    if variant == "bf16-sharded":
        assert (out_dir / "model.safetensors.index.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    ids = torch.tensor([make_batch(model.config.vocab_size)[2]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
        if variant == "bf16-sharded":
            # Round the reference weights to bf16 the same way, then compare in fp32.
            ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            for p in ref.parameters():
                p.copy_(p.to(torch.bfloat16).to(torch.float32))
            want = ref(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    assert rel_max(got, want) <= 1e-5
