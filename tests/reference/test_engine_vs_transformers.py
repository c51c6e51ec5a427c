"""The rollout server's generation engine (CPU backend, fp32) against transformers, through
tests/reference/tools/engine_probe, on the tiny random models of tiny_models.py (every supported architecture).

What is proven:
  - greedy generation through the engine (paged KV cache of 4-token blocks, chunked prefill with a 16-token
    step budget, several prompts batched together) gives exactly transformers' generate tokens;
  - every reported logprob is log_softmax(logits / T) of the token under transformers' own forward (teacher
    forcing), before repetition penalty and filters — what the GRPO trainer computes (tolerance 1e-4 absolute:
    fp32 on both sides, different summation orders); top logprobs are transformers' top-k of that distribution;
  - every sampled token lies in the support that a torch implementation of the filters (repetition penalty,
    temperature, min-p, top-k, top-p, in vLLM's order) keeps;
  - with a real byte-level BPE tokenizer: event text = tokenizers' decode of the tokens, and stop strings cut
    the text at their first occurrence (optionally keeping it).
"""
import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM

import tiny_models
from conftest import run_tool, tool

torch.set_num_threads(2)


@pytest.fixture(scope="module", params=list(tiny_models.SPECS))
def tiny(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    model = tiny_models.build(request.param, d)
    return request.param, d, model


def probe(model_dir, requests, **engine):
    out = run_tool([tool("engine_probe"), str(model_dir)], stdin=json.dumps(dict(engine, requests=requests)))
    return json.loads(out)


def prompts_for(vocab, lens, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def teacher_logprobs(model, prompt, tokens, temperature):
    """log_softmax(logits / T) rows (len(tokens), V) that predicted each generated token, and the tokens' values."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0]
    rows = torch.log_softmax(logits[len(prompt) - 1:len(prompt) - 1 + len(tokens)] / temperature, dim=-1)
    return rows, rows.gather(1, torch.tensor(tokens)[:, None])[:, 0], logits[len(prompt) - 1:]


def test_greedy_equals_generate(tiny):
    name, model_dir, model = tiny
    prompts = prompts_for(model.config.vocab_size, [1, 4, 17, 40], seed=2)
    max_new = 24
    want = []
    for p in prompts:
        out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new, eos_token_id=None,
                             pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    reqs = [{"prompt": p, "max_tokens": max_new, "temperature": 0, "ignore_eos": True, "logprobs": 2} for p in prompts]
    got = probe(model_dir, reqs, block_size=4, max_num_batched_tokens=16, max_num_seqs=4, kv_tokens=512)["results"]
    for p, w, r in zip(prompts, want, got):
        c = r["completions"][0]
        assert c["tokens"] == w, f"{name}: prompt of {len(p)} tokens"
        assert c["finish"] == "length"
        rows, lp, _ = teacher_logprobs(model, p, c["tokens"], 1.0)
        assert (torch.tensor(c["logprobs"]) - lp).abs().max().item() <= 1e-4
        for t, lpt, top in zip(c["tokens"], c["logprobs"], c["top"]):
            assert top[0][0] == t and abs(top[0][1] - lpt) <= 1e-6, "the greedy token is the best alternative"
        top_ids = [[pair[0] for pair in row] for row in c["top"]]
        assert top_ids == torch.topk(rows, 2, dim=-1).indices.tolist()


def filtered_support(logits, history, temperature, top_k, top_p, min_p, penalty):
    """The ids a sampler may draw: HF repetition penalty, temperature, then vLLM's min-p, top-k, top-p."""
    x = logits.clone()
    idx = torch.tensor(sorted(set(history)))
    v = x[idx]
    x[idx] = torch.where(v > 0, v / penalty, v * penalty)
    x = x / temperature
    p = torch.softmax(x, -1)
    keep = p >= min_p * p.max()
    if top_k > 0:
        kth = torch.topk(torch.where(keep, x, torch.tensor(-float("inf"))), top_k).values[-1]
        keep &= x >= kth
    p = torch.softmax(torch.where(keep, x, torch.tensor(-float("inf"))), -1)
    order = torch.argsort(-p, stable=True)
    above = torch.cumsum(p[order], 0) - p[order]
    keep_sorted = above < top_p
    keep_sorted[0] = True
    out = torch.zeros_like(keep)
    out[order[keep_sorted]] = True
    return out & keep


def test_sampled_logprobs_and_support(tiny):
    name, model_dir, model = tiny
    prompt = prompts_for(model.config.vocab_size, [9], seed=4)[0]
    params = dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.3)
    req = dict(params, prompt=prompt, n=3, max_tokens=16, seed=7, ignore_eos=True, logprobs=3)
    comps = probe(model_dir, [req])["results"][0]["completions"]
    assert len({tuple(c["tokens"]) for c in comps}) == 3, f"{name}: the 3 completions should differ"
    for c in comps:
        rows, lp, logits = teacher_logprobs(model, prompt, c["tokens"], params["temperature"])
        assert (torch.tensor(c["logprobs"]) - lp).abs().max().item() <= 1e-4, f"{name}: logprobs"
        for j, row in enumerate(c["top"]):
            ref = torch.topk(rows[j], 3)
            assert [pair[0] for pair in row] == ref.indices.tolist()
            assert max(abs(a[1] - b) for a, b in zip(row, ref.values.tolist())) <= 1e-4
        for j, t in enumerate(c["tokens"]):
            keep = filtered_support(logits[j], prompt + c["tokens"][:j], params["temperature"], params["top_k"],
                                    params["top_p"], params["min_p"], params["repetition_penalty"])
            assert keep[t], f"{name}: token {t} at {j} is outside the filtered support"


def build_with_tokenizer(out_dir):
    """A Qwen2-style tiny model with a 300-token vocabulary and a byte-level BPE tokenizer trained to 300 tokens."""
    torch.manual_seed(0)
    cfg = tiny_models.SPECS["qwen2_bias"]()
    cfg.vocab_size = 300
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, hello tandem", "stop here and there"] * 50
    tok.train_from_iterator(corpus, trainer)
    assert tok.get_vocab_size() <= 300
    tok.save(str(out_dir / "tokenizer.json"))
    return model, tok


def test_text_and_stop_strings(tmp_path):
    model, tok = build_with_tokenizer(tmp_path)
    prompt = tok.encode("hello world").ids
    base = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    full = probe(tmp_path, [base])["results"][0]["completions"][0]
    tokens = full["tokens"]
    text = tok.decode(tokens, skip_special_tokens=True)
    assert full["text"] == text
    # A stop string of two plain characters from the second half of the text.
    at = next((i for i in range(len(text) // 2, len(text) - 1)
               if text[i:i + 2].isprintable() and "\ufffd" not in text[i:i + 2]), None)
    assert at is not None, f"no plain 2-character substring in {text!r}"
    stop = text[at:at + 2]
    first = text.index(stop)
    reqs = [dict(base, stop=[stop]), dict(base, stop=[stop], include_stop_str=True)]
    cut, kept = [r["completions"][0] for r in probe(tmp_path, reqs)["results"]]
    assert cut["text"] == text[:first] and cut["finish"] == "stop" and cut["stop_reason"] == stop
    assert kept["text"] == text[:first + len(stop)]
    k = len(cut["tokens"])
    assert cut["tokens"] == tokens[:k], "tokens up to the stop are the greedy ones"
    assert stop in tok.decode(tokens[:k]) and stop not in tok.decode(tokens[:k - 1]), "ends at the completing token"
