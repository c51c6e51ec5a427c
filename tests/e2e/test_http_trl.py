"""TRL `vllm-serve` compatibility: GET /health/, GET /get_world_size/, POST /generate/.

The request below is exactly what TRL's client sends (trl/generation/vllm_client.py, VLLMClient.generate:
prompts, images, n, repetition_penalty, temperature, top_p, top_k, min_p, max_tokens, logprobs,
structured_outputs_regex, generation_kwargs), and the answer is read the way that client reads it
(prompt_ids, completion_ids, logprobs, logprob_token_ids). Shapes follow trl/scripts/vllm_serve.py:
completion_ids are flattened prompt-major, n per prompt; logprobs are (num_sequences, seq_len, k) with k = 1
for logprobs=0 and up to N+1 for logprobs=N, sorted by descending probability; both null for logprobs=None.
The logprobs are checked against transformers: log_softmax(logits / temperature) of the sampled tokens.
"""
import pytest
import torch

from server_fixtures import TandemServer, http_json, tiny_model_dir  # noqa: F401

torch.set_num_threads(1)
PROMPTS = ["the quick brown fox", "plus minus equals", "a lazy dog"]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with TandemServer(tiny_model_dir) as s:
        yield s
        assert s.alive(), s.log_text()


def trl_client_generate(url, prompts, n=1, repetition_penalty=1.0, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
                        max_tokens=16, logprobs=0, generation_kwargs=None):
    """The body and the answer handling of TRL's VLLMClient.generate (defaults as there), over plain HTTP."""
    status, body, _ = http_json("POST", url + "/generate/", {
        "prompts": prompts, "images": None, "n": n, "repetition_penalty": repetition_penalty,
        "temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p, "max_tokens": max_tokens,
        "logprobs": logprobs, "structured_outputs_regex": None, "generation_kwargs": generation_kwargs or {},
    })
    assert status == 200, body
    assert set(body) == {"prompt_ids", "completion_ids", "logprobs", "logprob_token_ids"}, body.keys()
    return body


def test_health_and_world_size(server):
    status, body, _ = http_json("GET", server.url + "/health/")
    assert status == 200 and body == {"status": "ok"}
    status, body, _ = http_json("GET", server.url + "/get_world_size/")
    assert status == 200 and body == {"world_size": 1}


def test_generate_shapes_text_prompts(server, tiny_model_dir):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    n, max_tokens = 3, 7
    out = trl_client_generate(server.url, PROMPTS, n=n, temperature=0.9, max_tokens=max_tokens)
    assert out["prompt_ids"] == [tok.encode(p).ids for p in PROMPTS]
    assert len(out["completion_ids"]) == len(PROMPTS) * n
    assert all(1 <= len(c) <= max_tokens for c in out["completion_ids"])
    # logprobs=0: one logprob per token, for the sampled token itself.
    assert len(out["logprobs"]) == len(out["logprob_token_ids"]) == len(PROMPTS) * n
    for ids, lps, lids in zip(out["completion_ids"], out["logprobs"], out["logprob_token_ids"]):
        assert len(lps) == len(lids) == len(ids)
        for t, lp, li in zip(ids, lps, lids):
            assert len(lp) == 1 and li == [t] and lp[0] <= 0


def test_completion_order_is_prompt_major(server):
    """Greedy, n=2: completions 2p and 2p+1 belong to prompt p and equal a one-prompt request."""
    out = trl_client_generate(server.url, PROMPTS, n=2, temperature=0.0, max_tokens=9)
    for p, prompt in enumerate(PROMPTS):
        single = trl_client_generate(server.url, [prompt], n=1, temperature=0.0, max_tokens=9)
        assert out["completion_ids"][2 * p] == out["completion_ids"][2 * p + 1] == single["completion_ids"][0]


def test_token_id_prompts_and_none_logprobs(server):
    prompts = [[86, 294, 265], [67, 85]]
    out = trl_client_generate(server.url, prompts, n=2, max_tokens=4, logprobs=None)
    assert out["prompt_ids"] == prompts
    assert len(out["completion_ids"]) == 4
    assert out["logprobs"] is None and out["logprob_token_ids"] is None


def test_top_logprobs_sorted_with_sampled_token(server):
    N = 3
    out = trl_client_generate(server.url, PROMPTS[:2], n=2, temperature=1.0, max_tokens=8, logprobs=N,
                              generation_kwargs={"seed": 7})
    for ids, lps, lids in zip(out["completion_ids"], out["logprobs"], out["logprob_token_ids"]):
        for t, lp, li in zip(ids, lps, lids):
            assert N <= len(lp) <= N + 1 and len(li) == len(lp)
            assert lp == sorted(lp, reverse=True)
            assert t in li and len(set(li)) == len(li)


def test_seed_in_generation_kwargs_is_reproducible(server):
    a = trl_client_generate(server.url, PROMPTS, n=4, max_tokens=10, generation_kwargs={"seed": 123})
    b = trl_client_generate(server.url, PROMPTS, n=4, max_tokens=10, generation_kwargs={"seed": 123})
    assert a["completion_ids"] == b["completion_ids"]
    # The second run may hit the prefix cache and batch differently: equal tokens, logprobs to fp32 rounding.
    flat = lambda o: torch.tensor([x[0] for seq in o["logprobs"] for x in seq])  # noqa: E731
    assert torch.allclose(flat(a), flat(b), atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_transformers(server, tiny_model_dir, temperature):
    """The sampled tokens' logprobs are log_softmax(logits / T) of the same model (what GRPO's importance
    sampling correction compares with the trainer's own)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    out = trl_client_generate(server.url, PROMPTS[:2], n=2, temperature=temperature, max_tokens=12,
                              generation_kwargs={"seed": 3})
    for k, (ids, lps) in enumerate(zip(out["completion_ids"], out["logprobs"])):
        prompt = out["prompt_ids"][k // 2]
        seq = torch.tensor([prompt + ids])
        with torch.no_grad():
            logits = model(input_ids=seq).logits[0, len(prompt) - 1:-1]  # (len(ids), V)
        ref = torch.log_softmax(logits / temperature, dim=-1).gather(1, torch.tensor(ids)[:, None])[:, 0]
        got = torch.tensor([lp[0] for lp in lps])
        assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), (got - ref).abs().max()
