"""LoRA adapters in tandem's model core (CPU, fp32) against PEFT on transformers, on tiny random models.

PEFT builds the adapter (LoraConfig, random nonzero A and B so that every path carries signal) and saves it with
save_pretrained; tandem loads that folder onto the frozen base and runs forward and backward of the mean
next-token cross-entropy. Compared:
  logits, logprobs, loss: max |ours - ref| / max |ref| <= 1e-4
  adapter gradients: ||ours - ref||_2 / ||ref||_2 <= 1e-4 for every lora_A / lora_B tensor
tandem's own adapter folders (its init) load in PeftModel.from_pretrained, and PEFT's logits on them equal tandem's.
"""
import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import tiny_models
from conftest import run_tool, tool

torch.set_num_threads(2)
SEQ_LENS = [9, 1, 14]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# (architecture, target modules, r, alpha, rsLoRA): every module on each architecture, subsets that leave holes in
# the fused q|k|v and gate|up outputs, and rsLoRA's scale.
CASES = [
    ("llama_gqa_llama3rope", ALL, 8, 16, False),
    ("llama_tied", ["q_proj", "v_proj"], 4, 8, False),
    ("qwen2_bias", ALL, 8, 32, True),
    ("qwen2_bias", ["k_proj", "up_proj", "down_proj"], 6, 12, False),
    ("qwen3_qknorm", "all-linear", 8, 16, False),   # PEFT saves it as every module's full name
    ("mistral", ["o_proj", "gate_proj"], 4, 4, False),
]


def make_batch(vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in SEQ_LENS]


def rel_max(ours, ref):
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def rel_l2(ours, ref):
    return ((ours - ref).norm() / ref.norm()).item()


def peft_model(base_dir, targets, r, alpha, rslora, seed=0):
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, use_rslora=rslora,
                     task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(seed + 11)
    # B is zero by default: random nonzero A and B exercise both gradients. Their size keeps scale * B A near the
    # base weights' (larger adapters saturate the tiny model's attention and leave gradients that are mostly
    # cancellation).
    std = 0.3 / (alpha / (r ** 0.5 if rslora else r)) ** 0.5
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(std * torch.randn(p.shape, generator=g))
    model.eval()
    return model


def reference(model, seqs):
    model.zero_grad()
    logits_all, lp_all, total, count = [], [], 0.0, 0
    for s in seqs:
        logits = model(input_ids=torch.tensor([s])).logits[0]
        lp = torch.log_softmax(logits, dim=-1)
        gathered = lp.gather(1, torch.tensor(s[1:] + [0])[:, None])[:, 0]
        gathered = torch.cat([gathered[:-1], torch.zeros(1)])
        logits_all.append(logits)
        lp_all.append(gathered)
        total = total - gathered[:-1].sum()
        count += len(s) - 1
    loss = total / count
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if "lora_" in name:
            assert p.grad is not None
            grads[name.replace(".default.", ".")] = p.grad.detach().clone()
        else:
            assert p.grad is None, f"base parameter {name} got a gradient"
    return torch.cat(logits_all).detach(), torch.cat(lp_all).detach(), loss.item(), grads


def probe(base_dir, adapter_dir, seqs, out, checkpoint=False):
    req = {"sequences": seqs, "checkpoint": checkpoint}
    run_tool([tool("lora_probe"), "forward", str(base_dir), str(adapter_dir), str(out)], stdin=json.dumps(req))
    return load_file(str(out))


@pytest.mark.parametrize("checkpoint", [False, True], ids=["saved-acts", "recompute"])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1] if isinstance(c[1], str) else '+'.join(m[:-5] for m in c[1])}"
                                             f"-r{c[2]}{'-rs' if c[4] else ''}" for c in CASES])
def test_forward_backward_equal_peft(case, checkpoint, tmp_path):
    arch, targets, r, alpha, rslora = case
    base_dir = tmp_path / "base"
    tiny_models.build(arch, base_dir)
    model = peft_model(base_dir, targets, r, alpha, rslora)
    adapter_dir = tmp_path / "adapter"
    model.save_pretrained(adapter_dir)
    seqs = make_batch(model.config.vocab_size)
    ref_logits, ref_lp, ref_loss, ref_grads = reference(model, seqs)
    got = probe(base_dir, adapter_dir, seqs, tmp_path / "out.safetensors", checkpoint)
    assert rel_max(got["logits"], ref_logits) <= 1e-4
    assert rel_max(got["logprobs"], ref_lp) <= 1e-4
    assert abs(got["loss"].item() - ref_loss) / abs(ref_loss) <= 1e-4
    n_modules = len(ALL) if targets == "all-linear" else len(targets)
    assert len(ref_grads) == 2 * n_modules * model.config.num_hidden_layers
    worst = 0.0
    for name, g in ref_grads.items():
        key = "grad." + name
        assert key in got, f"no gradient for {name}"
        err = rel_l2(got[key], g)
        worst = max(worst, err)
        assert err <= 1e-4, f"{arch}: gradient of {name} off by {err:.2e}"
    print(f"{arch} {targets} r={r}: logits {rel_max(got['logits'], ref_logits):.2e}, worst adapter grad {worst:.2e}")


@pytest.mark.parametrize("init", ["default", "gaussian"])
def test_tandem_init_loads_in_peft(init, tmp_path):
    """tandem's adapter folder (its init, B = 0 as PEFT's) loads in PeftModel.from_pretrained; A follows PEFT's
    distribution (U(-1/sqrt(in), 1/sqrt(in)) or N(0, 1/r)); with B = 0 the logits are the base model's."""
    base_dir = tmp_path / "base"
    base = tiny_models.build("qwen2_bias", base_dir)
    out = tmp_path / "adapter"
    r = 8
    req = {"r": r, "lora_alpha": 16, "target_modules": "all-linear", "init": init, "seed": 3}
    run_tool([tool("lora_probe"), "init", str(base_dir), str(out)], stdin=json.dumps(req))
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == r and cfg["lora_alpha"] == 16
    assert sorted(cfg["target_modules"]) == sorted(ALL)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), out)
    ids = torch.tensor([make_batch(base.config.vocab_size)[2]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, base(input_ids=ids).logits)
    weights = load_file(str(out / "adapter_model.safetensors"))
    a_vals = torch.cat([t.flatten() for k, t in weights.items() if "lora_A" in k and "mlp.down_proj" not in k])
    for k, t in weights.items():
        if "lora_B" in k:
            assert torch.count_nonzero(t) == 0
    C = base.config.hidden_size
    if init == "default":
        assert a_vals.abs().max() <= 1 / C ** 0.5
        assert abs(a_vals.std().item() - (1 / C ** 0.5) / 3 ** 0.5) < 0.1 * (1 / C ** 0.5)
    else:
        assert abs(a_vals.std().item() - 1 / r) < 0.05 / r
    assert abs(a_vals.mean().item()) < 0.05 * a_vals.std().item() * 10


@pytest.mark.parametrize("kind,needle", [
    ("dora", '"use_dora" is set'),
    ("one-layer", "an adapter on some layers only is not supported"),
    ("bias", '"bias" is set'),
])
def test_unsupported_peft_adapters_are_refused(kind, needle, tmp_path):
    """What tandem cannot run is refused at load, naming the key or the missing tensor."""
    base_dir = tmp_path / "base"
    tiny_models.build("llama_tied", base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    kw = {"dora": dict(target_modules=["q_proj"], use_dora=True),
          "one-layer": dict(target_modules=["model.layers.0.self_attn.q_proj"]),
          "bias": dict(target_modules=["q_proj"], bias="lora_only")}[kind]
    get_peft_model(base, LoraConfig(r=4, lora_alpha=8, **kw)).save_pretrained(tmp_path / "adapter")
    req = json.dumps({"sequences": [[1, 2, 3]]})
    with pytest.raises(AssertionError, match=needle):
        run_tool([tool("lora_probe"), "forward", str(base_dir), str(tmp_path / "adapter"), str(tmp_path / "o")],
                 stdin=req)


M64 = (1 << 64) - 1


def _mix(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def dropout_mask(seed, layer, module, rows, cols, p):
    """ops_dropout's keep mask (rows, cols) of module `module` of `layer` for a micro-batch seed (kernels/ops.h,
    shared/model_lora.h lora_module_dropout_seed), computed with Python integers."""
    mseed = _mix((seed + (layer * 7 + module + 1) * 0xD1B54A32D192ED03) & M64)
    threshold = round(p * 2 ** 24)
    keep = [(_mix((mseed + (e + 1) * 0x9E3779B97F4A7C15) & M64) >> 40) >= threshold for e in range(rows * cols)]
    return torch.tensor(keep, dtype=torch.float32).reshape(rows, cols)


class MaskDropout(torch.nn.Module):
    """Stands in for PEFT's lora_dropout: tandem's mask for this module, rows of the sequence being run."""

    def __init__(self, mask, p, where):
        super().__init__()
        self.mask, self.p, self.where = mask, p, where

    def forward(self, x):
        lo, hi = self.where["rows"]
        return x * self.mask[lo:hi] / (1 - self.p)


@pytest.mark.parametrize("checkpoint", [False, True], ids=["saved-acts", "recompute"])
@pytest.mark.parametrize("arch", ["qwen2_bias", "qwen3_qknorm"])
def test_dropout_equals_peft_with_the_same_masks(arch, checkpoint, tmp_path):
    """lora_dropout 0.25: PEFT with its dropout modules applying tandem's masks (same seed formula, recomputed here
    from the documented hash) gives tandem's logits, loss and adapter gradients (1e-4); the checkpoint recompute
    regenerates the same masks."""
    base_dir = tmp_path / "base"
    tiny_models.build(arch, base_dir)
    model = peft_model(base_dir, ALL, 8, 16, False)
    adapter_dir = tmp_path / "adapter"
    model.save_pretrained(adapter_dir)
    seqs = make_batch(model.config.vocab_size)
    p, seed = 0.25, 987654321
    N = sum(len(s) for s in seqs)
    where = {"rows": (0, 0)}
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    for layer_idx, layer in enumerate(model.base_model.model.model.layers):
        for i, name in enumerate(names):
            mod = getattr(layer.self_attn if i <= 3 else layer.mlp, name)
            mask = dropout_mask(seed, layer_idx, i, N, mod.in_features, p)
            mod.lora_dropout["default"] = MaskDropout(mask, p, where)
    model.zero_grad()
    logits_all, total, count, row = [], 0.0, 0, 0
    for s in seqs:
        where["rows"] = (row, row + len(s))
        row += len(s)
        logits = model(input_ids=torch.tensor([s])).logits[0]
        lp = torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(s[1:])[:, None])[:, 0]
        logits_all.append(logits)
        total = total - lp.sum()
        count += len(s) - 1
    loss = total / count
    loss.backward()
    ref_grads = {n.replace(".default.", "."): p_.grad for n, p_ in model.named_parameters() if "lora_" in n}
    ref_logits = torch.cat(logits_all).detach()
    req = {"sequences": seqs, "checkpoint": checkpoint, "dropout": p, "dropout_seed": seed}
    run_tool([tool("lora_probe"), "forward", str(base_dir), str(adapter_dir), str(tmp_path / "out")],
             stdin=json.dumps(req))
    got = load_file(str(tmp_path / "out"))
    assert rel_max(got["logits"], ref_logits) <= 1e-4
    assert abs(got["loss"].item() - loss.item()) / loss.item() <= 1e-4
    worst = max(rel_l2(got["grad." + n], g) for n, g in ref_grads.items())
    assert worst <= 1e-4, worst
    print(f"{arch} dropout {p}: logits {rel_max(got['logits'], ref_logits):.2e}, worst adapter grad {worst:.2e}")
    # Without the masks the numbers differ: the dropout is really applied.
    no_drop = dict(req, dropout=0.0)
    run_tool([tool("lora_probe"), "forward", str(base_dir), str(adapter_dir), str(tmp_path / "plain")],
             stdin=json.dumps(no_drop))
    assert rel_max(load_file(str(tmp_path / "plain"))["logits"], ref_logits) > 1e-3
