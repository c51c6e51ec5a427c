"""safetensors and config.json interoperability between tandem and the Hugging Face libraries.

Drives tests/reference/tools/st_tool.c (tandem's reader, writer and config parser) and checks:
  * files written by `safetensors` / transformers' save_pretrained (bf16, fp16, fp32; single and sharded) read in
    tandem exactly: same names, dtypes, shapes, and values bit for bit after conversion to fp32;
  * files tandem writes (F32, BF16, F16; single and sharded) load in `safetensors.torch.load_file` and in
    transformers' from_pretrained with identical values, BF16/F16 rounded exactly as torch rounds;
  * tandem's config parsing agrees with transformers' config classes (including their defaults), the config
    tandem writes loads back in transformers as the same config, and the rotary inv_freq tandem computes matches
    transformers' rope init functions.
"""
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

BUILD = Path(os.environ.get("TANDEM_BUILD_DIR", Path(__file__).resolve().parents[2] / "build"))
TOOL = BUILD / "tests" / "st_tool"


@pytest.fixture(scope="module")
def tool():
    if not TOOL.exists():
        pytest.skip(f"{TOOL} not built (set TANDEM_BUILD_DIR to a configured build folder)")
    return str(TOOL)


def run(tool, *args):
    res = subprocess.run([tool, *map(str, args)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"st_tool {' '.join(map(str, args))} failed: {res.stderr}"
    return res.stdout


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two same-dtype tensors (NaN payloads included)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def sample_tensors(dtype: torch.dtype) -> dict:
    """Random tensors of several ranks plus the special values conversions get wrong."""
    g = torch.Generator().manual_seed(1234)
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -3e-39, 65504.0,
                             6e-8, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 3.4e38], dtype=torch.float32)
    t = {
        "model.embed_tokens.weight": torch.randn(17, 8, generator=g),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(24, generator=g) * 1e-3,
        "three_d": torch.randn(2, 3, 5, generator=g) * 100,
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "specials": specials,
    }
    return {k: v.to(dtype) for k, v in t.items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_hf_written_file_reads_identically(tool, tmp_path, dtype):
    tensors = sample_tensors(dtype)
    src = tmp_path / "src"
    src.mkdir()
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})

    listing = json.loads(run(tool, "list", src))
    name = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}[dtype]
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        assert sorted(listing) == sorted(f.keys())
        for k in f.keys():
            assert listing[k]["dtype"] == name
            assert listing[k]["shape"] == list(f.get_slice(k).get_shape())
            assert listing[k]["file"] == "model.safetensors"

    run(tool, "dump", src, tmp_path / "out")
    ours = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(ours) == sorted(tensors)
    for k, v in tensors.items():
        # widening bf16/fp16 -> fp32 is exact: tandem's values must equal torch's bit for bit, NaNs included
        assert bits_equal(ours[k], v.float()), k


@pytest.mark.parametrize("out_dtype", ["BF16", "F16"])
def test_tandem_rounding_matches_torch(tool, tmp_path, out_dtype):
    g = torch.Generator().manual_seed(7)
    # random fp32 bit patterns cover every exponent; the explicit ties check round-half-to-even
    raw = torch.randint(-(2**31), 2**31 - 1, (4096,), generator=g, dtype=torch.int64).to(torch.int32)
    rand_bits = raw.view(torch.float32)
    ties = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 1.0 + 2**-11, 1.0 + 3 * 2**-11,
                         2**-25, 3 * 2**-25, 65519.0, 65520.0, -65520.0], dtype=torch.float32)
    src = tmp_path / "src"
    src.mkdir()
    save_file({"random_bits": rand_bits, "ties": ties}, str(src / "model.safetensors"), metadata={"format": "pt"})
    run(tool, "dump", src, tmp_path / "out", out_dtype)
    ours = load_file(str(tmp_path / "out" / "model.safetensors"))
    torch_dtype = {"BF16": torch.bfloat16, "F16": torch.float16}[out_dtype]
    for k, v in {"random_bits": rand_bits, "ties": ties}.items():
        want = v.to(torch_dtype)
        got = ours[k]
        assert got.dtype == torch_dtype
        nan = torch.isnan(v)
        assert torch.equal(torch.isnan(got), nan), k           # NaN stays NaN (payload may differ from torch's)
        assert bits_equal(got[~nan], want[~nan]), k


def tiny_model(arch: str, dtype: torch.dtype):
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32})
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(cfg)
    return model.to(dtype)


def hf_tensors(folder: Path) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("qwen2", torch.bfloat16)])
def test_transformers_sharded_checkpoint_round_trip(tool, tmp_path, arch, dtype):
    import transformers

    model = tiny_model(arch, dtype)
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir, max_shard_size="20KB")
    assert (hf_dir / "model.safetensors.index.json").exists()
    assert len(list(hf_dir.glob("model-*-of-*.safetensors"))) > 1
    reference = hf_tensors(hf_dir)

    # HF shards -> tandem reader -> tandem writer (fp32, sharded itself) -> safetensors / transformers
    ours_dir = tmp_path / "ours"
    run(tool, "dump", hf_dir, ours_dir, "F32", 16000)
    index = json.loads((ours_dir / "model.safetensors.index.json").read_text())
    shards = sorted(ours_dir.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == {s.name for s in shards}
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in reference.values())
    ours = hf_tensors(ours_dir)
    assert sorted(ours) == sorted(reference)
    for k, v in reference.items():
        assert bits_equal(ours[k], v.float()), k

    # and written in the checkpoint's own dtype, transformers loads the folder back to the same state dict
    back_dir = tmp_path / "back"
    run(tool, "dump", hf_dir, back_dir, {torch.float32: "F32", torch.bfloat16: "BF16"}[dtype], 16000)
    shutil.copy(hf_dir / "config.json", back_dir / "config.json")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(back_dir, dtype=dtype)
    want = model.state_dict()
    got = loaded.state_dict()
    assert sorted(got) == sorted(want)
    for k in want:
        assert bits_equal(got[k], want[k]), k


# ---- config.json ---------------------------------------------------------------------------------------------

def config_cases():
    import transformers

    common = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8)
    return {
        "llama3": transformers.LlamaConfig(**common, num_key_value_heads=2, max_position_embeddings=131072,
                                           rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=5,
                                           eos_token_id=[6, 7], rope_parameters={
                                               "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 8192}),
        "llama_linear": transformers.LlamaConfig(**common, attention_bias=True, rope_parameters={
            "rope_type": "linear", "rope_theta": 20000.0, "factor": 2.5}),
        "qwen2_window": transformers.Qwen2Config(**common, num_key_value_heads=4, use_sliding_window=True,
                                                 sliding_window=48, max_window_layers=1, rope_parameters={
                                                     "rope_type": "default", "rope_theta": 1000000.0}),
        "qwen2": transformers.Qwen2Config(**common, num_key_value_heads=2, eos_token_id=9),
        "qwen3": transformers.Qwen3Config(**common, num_key_value_heads=4, head_dim=16, attention_bias=True),
        "mistral": transformers.MistralConfig(**common, num_key_value_heads=2, head_dim=16, sliding_window=None),
        "mistral_window": transformers.MistralConfig(**common, num_key_value_heads=8),
    }


# What tandem reads and writes; the other keys (initializer_range, use_cache, ...) do not change the model.
COMPARED_KEYS = ["model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
                 "hidden_act", "tie_word_embeddings", "attention_bias", "mlp_bias", "rope_parameters",
                 "sliding_window", "use_sliding_window", "max_window_layers", "layer_types", "bos_token_id",
                 "eos_token_id", "dtype"]


def model_keys(cfg) -> dict:
    d = cfg.to_dict()
    return {k: d.get(k) for k in COMPARED_KEYS}


def check_parsed(parsed: dict, cfg):
    """tandem's parsed fields against the attributes of transformers' config object."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert parsed["vocab_size"] == cfg.vocab_size
    assert parsed["hidden_size"] == cfg.hidden_size
    assert parsed["num_layers"] == cfg.num_hidden_layers
    assert parsed["num_heads"] == cfg.num_attention_heads
    assert parsed["num_kv_heads"] == cfg.num_key_value_heads
    assert parsed["head_dim"] == head_dim
    assert parsed["max_position_embeddings"] == cfg.max_position_embeddings
    assert parsed["rms_norm_eps"] == pytest.approx(cfg.rms_norm_eps, rel=1e-7)
    assert parsed["tie_word_embeddings"] == bool(cfg.tie_word_embeddings)
    rp = cfg.rope_parameters
    assert parsed["rope_type"] == rp["rope_type"]
    assert parsed["rope_theta"] == pytest.approx(rp["rope_theta"], rel=1e-7)
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    uses_window = window is not None and (layer_types is None or "sliding_attention" in layer_types)
    assert parsed["sliding_window"] == (window if uses_window else 0)
    want_len = min(cfg.max_position_embeddings, window) if uses_window else cfg.max_position_embeddings
    assert parsed["max_seq_len"] == want_len
    eos = cfg.eos_token_id
    assert parsed["eos_token_ids"] == ([] if eos is None else [eos] if isinstance(eos, int) else list(eos))


@pytest.mark.parametrize("case", ["llama3", "llama_linear", "qwen2_window", "qwen2", "qwen3", "mistral",
                                  "mistral_window"])
def test_config_round_trip_through_transformers(tool, tmp_path, case):
    import transformers

    cfg = config_cases()[case]
    cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
    cfg.dtype = torch.bfloat16
    src = tmp_path / "src"
    cfg.save_pretrained(src)
    original = transformers.AutoConfig.from_pretrained(src)
    check_parsed(json.loads(run(tool, "parsed", src)), original)

    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text(run(tool, "config", src))
    reloaded = transformers.AutoConfig.from_pretrained(out)
    assert type(reloaded) is type(original)
    assert reloaded.architectures == original.architectures
    assert model_keys(reloaded) == model_keys(original)


def test_config_defaults_match_transformers(tool, tmp_path):
    """Minimal files (only the required keys) take transformers' per-class defaults."""
    import transformers

    for arch, model_type, kv in [("LlamaForCausalLM", "llama", None), ("Qwen2ForCausalLM", "qwen2", 32),
                                 ("Qwen3ForCausalLM", "qwen3", 32), ("MistralForCausalLM", "mistral", 8)]:
        d = tmp_path / arch
        d.mkdir()
        body = {"architectures": [arch], "model_type": model_type, "vocab_size": 100, "hidden_size": 256, "intermediate_size": 64,
                "num_hidden_layers": 2, "num_attention_heads": 64}
        (d / "config.json").write_text(json.dumps(body))
        cfg = transformers.AutoConfig.from_pretrained(d)
        parsed = json.loads(run(tool, "parsed", d))
        check_parsed(parsed, cfg)
        assert parsed["num_kv_heads"] == (kv or 64)
        assert parsed["attention_bias"] == (arch == "Qwen2ForCausalLM")
        assert parsed["qk_norm"] == (arch == "Qwen3ForCausalLM")
        assert parsed["bos_token_id"] == (-1 if cfg.bos_token_id is None else cfg.bos_token_id)


def test_config_transformers4_keys(tool, tmp_path):
    """A transformers 4.x file (rope_theta + rope_scaling with "type", torch_dtype) means the same to both."""
    import transformers

    body = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128, "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 4096, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
            "rope_scaling": {"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 1024}}
    (tmp_path / "config.json").write_text(json.dumps(body))
    original = transformers.AutoConfig.from_pretrained(tmp_path)
    parsed = json.loads(run(tool, "parsed", tmp_path))
    check_parsed(parsed, original)
    assert parsed["rope_original_max_position"] == 1024 and parsed["torch_dtype"] == "bfloat16"
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text(run(tool, "config", tmp_path))
    want = model_keys(original)
    del want["rope_parameters"]["type"]   # the 4.x alias transformers keeps next to the rope_type it derives from it
    assert model_keys(transformers.AutoConfig.from_pretrained(out)) == want


def rope_cases():
    """Head size 128 (64 frequencies) so that llama3's three wavelength bands are all populated."""
    import transformers

    big = dict(vocab_size=16, hidden_size=1024, intermediate_size=16, num_hidden_layers=1, num_attention_heads=8,
               num_key_value_heads=8)
    return {
        "llama3": transformers.LlamaConfig(**big, max_position_embeddings=131072, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
        "llama3_odd": transformers.LlamaConfig(**big, max_position_embeddings=32768, rope_parameters={
            "rope_type": "llama3", "rope_theta": 123456.7, "factor": 3.3, "low_freq_factor": 1.7,
            "high_freq_factor": 5.9, "original_max_position_embeddings": 3000}),
        "linear": transformers.LlamaConfig(**big, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                                   "factor": 4.0}),
        "qwen2": transformers.Qwen2Config(**big, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        "qwen3": transformers.Qwen3Config(**big, head_dim=96),
        "mistral": transformers.MistralConfig(**big, rope_parameters={"rope_type": "default",
                                                                      "rope_theta": 1000000.0}),
    }


@pytest.mark.parametrize("case", ["llama3", "llama3_odd", "linear", "qwen2", "qwen3", "mistral"])
def test_rope_inv_freq_matches_transformers(tool, tmp_path, case):
    import importlib

    cfg = rope_cases()[case]
    name = type(cfg).__name__.replace("Config", "")
    cfg.architectures = [name + "ForCausalLM"]
    cfg.save_pretrained(tmp_path)
    ours = torch.tensor(json.loads(run(tool, "parsed", tmp_path))["inv_freq"], dtype=torch.float64)
    # the model's own rotary module, exactly as transformers builds it
    module = importlib.import_module(f"transformers.models.{cfg.model_type}.modeling_{cfg.model_type}")
    want = getattr(module, name + "RotaryEmbedding")(config=cfg).inv_freq
    assert want.dtype == torch.float32 and want.shape == ours.shape
    rel = ((ours - want.double()).abs() / want.double().abs()).max().item()
    # transformers computes in float32 tensors and tandem replays the same float32 steps; what differences remain
    # come from pow's last-bit rounding: at most one float32 ulp (6e-8..1.2e-7 relative).
    print(f"{case}: max relative difference {rel:.3g}, {int((ours != want.double()).sum())} of {len(want)} differ")
    assert rel <= 1.25e-7, rel
