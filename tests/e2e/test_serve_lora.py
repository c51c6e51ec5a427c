"""tandem-serve --lora NAME=DIR: PEFT adapters served beside the base model (vLLM's multi-LoRA), end to end through a
real server process and the official `openai` client, against PEFT on transformers.

Two adapters made and saved by PEFT itself on the tiny Llama: "every" (all-linear, r 8, alpha 16) and "qv" (q_proj
and v_proj, r 4, rsLoRA), each with a random B (PEFT's init leaves B = 0, which would make any adapter look right).
- GET /v1/models lists the served model and both adapters (parent: the served model), as vLLM does.
- A greedy completion with "model": "every" / "qv" gives PEFT's greedy tokens and, for each token, PEFT's
  log_softmax within 1e-4 (fp32: the adapter as two more GEMMs vs PEFT's); "model" the served name gives the base.
- The same requests sent all at once (adapters and base mixed in the server's steps) give the same tokens and the
  same logprobs to the bit as one at a time: a request's numbers do not depend on the adapters it is batched with.
- An unknown model is a 404 naming it; a broken adapter folder stops the server at start with a message naming the
  --lora option and what is wrong; a name equal to the served model's is refused.
"""
import concurrent.futures
import json
import pathlib
import subprocess

import pytest
import torch

from server_fixtures import TandemServer, build_tiny_model, serve_binary

openai = pytest.importorskip("openai")
torch.set_num_threads(2)

# The last prompt spans two full KV blocks: with prefix caching (on), a request through another adapter (or none)
# must not reuse them.
PROMPTS = [[1, 17, 250, 3, 99, 42, 7], [1, 5], [4, 4, 4, 4, 9, 9], [33], [(7 * i + 3) % 290 for i in range(40)]]
MAX_TOKENS = 12
ADAPTERS = {
    "every": dict(r=8, lora_alpha=16, target_modules="all-linear"),
    "qv": dict(r=4, lora_alpha=6, target_modules=["q_proj", "v_proj"], use_rslora=True),
}


def make_adapter(base_dir, out_dir, seed, **cfg):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(lora_dropout=0.0, **cfg))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    peft.save_pretrained(out_dir)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    base = d / "model"
    build_tiny_model(base)
    dirs = {}
    for i, (name, cfg) in enumerate(ADAPTERS.items()):
        dirs[name] = d / name
        make_adapter(base, dirs[name], 100 + i, **cfg)
    args = [a for name, p in dirs.items() for a in ("--lora", f"{name}={p}")]
    srv = TandemServer(base, "--served-model-name", "tiny", *args)
    try:
        yield base, dirs, srv
    finally:
        assert srv.stop() == 0, srv.log_text()


def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def complete(srv, model, prompt):
    out = client(srv).completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=1,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
    c = out.choices[0]
    assert out.model == model
    return c.token_ids, c.logprobs.token_logprobs


def peft_greedy(model, prompt):
    """Greedy tokens and each token's log_softmax, one token at a time over the whole sequence."""
    ids, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(torch.tensor([ids])).logits[0, -1].double()
            tok = int(torch.argmax(logits))
            lps.append(float(torch.log_softmax(logits, -1)[tok]))
            ids.append(tok)
    return ids[len(prompt):], lps


def test_models_lists_the_adapters(setup):
    _, _, srv = setup
    data = client(srv).models.list().data
    assert [m.id for m in data] == ["tiny", "every", "qv"]
    assert [getattr(m, "parent", None) for m in data] == [None, "tiny", "tiny"]
    assert client(srv).models.retrieve("qv").id == "qv"
    with pytest.raises(openai.NotFoundError):
        client(srv).models.retrieve("nope")


def test_adapters_equal_peft(setup):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base_dir, dirs, srv = setup
    refs = {"tiny": AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()}
    for name, p in dirs.items():
        refs[name] = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                               p).eval()
    outputs = {}
    for name, ref in refs.items():
        for prompt in PROMPTS:
            want_ids, want_lp = peft_greedy(ref, prompt)
            ids, lp = complete(srv, name, prompt)
            # Up to the first near-tie of the reference (another summation order may pick the other token there).
            assert ids == want_ids, (name, prompt, ids, want_ids)
            assert max(abs(a - b) for a, b in zip(lp, want_lp)) < 1e-4, (name, prompt, lp, want_lp)
            outputs[name, tuple(prompt)] = (ids, lp)
    distinct = {tuple(outputs[name, tuple(PROMPTS[0])][0]) for name in refs}
    assert len(distinct) == 3, "the adapters do not change the greedy output: the comparison says nothing"

    # Everything at once: the base's and both adapters' requests share the server's steps.
    jobs = [(name, p) for name in refs for p in PROMPTS] * 2
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda j: complete(srv, *j), jobs))
    for (name, p), (ids, lp) in zip(jobs, got):
        assert (ids, lp) == outputs[name, tuple(p)], (name, p)


def test_unknown_model_is_404(setup):
    _, _, srv = setup
    with pytest.raises(openai.NotFoundError) as e:
        client(srv).completions.create(model="every2", prompt=[1, 2], max_tokens=2)
    assert "every2" in str(e.value)


def start_fails(base, *args):
    p = subprocess.run([serve_binary(), "--model", str(base), "--port", "0", "--kv-cache-memory", "16M", *args],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    return p.stderr + p.stdout


def test_bad_adapters_stop_the_start(setup, tmp_path):
    base, dirs, _ = setup
    assert "expected NAME=DIR" in start_fails(base, "--lora", str(dirs["qv"]))
    msg = start_fails(base, "--lora", f"x={tmp_path / 'missing'}")
    assert "--lora x=" in msg and "adapter_config.json" in msg, msg
    # A tensor of the wrong shape: the message names the adapter and the tensor.
    broken = tmp_path / "broken"
    broken.mkdir()
    cfg = json.loads((dirs["qv"] / "adapter_config.json").read_text())
    cfg["r"] = 5
    (broken / "adapter_config.json").write_text(json.dumps(cfg))
    (broken / "adapter_model.safetensors").write_bytes((dirs["qv"] / "adapter_model.safetensors").read_bytes())
    msg = start_fails(base, "--lora", f"bad={broken}")
    assert "--lora bad=" in msg and "lora_A" in msg, msg
    # A truncated weights file.
    (broken / "adapter_config.json").write_text((dirs["qv"] / "adapter_config.json").read_text())
    data = (dirs["qv"] / "adapter_model.safetensors").read_bytes()
    (broken / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    assert "--lora bad=" in start_fails(base, "--lora", f"bad={broken}")
    msg = start_fails(base, "--served-model-name", "same", "--lora", f"same={dirs['qv']}")
    assert "served model" in msg, msg
    msg = start_fails(base, "--lora", f"a={dirs['qv']}", "--lora", f"a={dirs['every']}")
    assert "second adapter" in msg, msg
