"""Prompt scoring on /v1/completions, checked against transformers and driven by the real clients:

- `prompt_logprobs=k` (vLLM's extension) and `echo` with `logprobs=k` (OpenAI's legacy completions) through the
  official `openai` client: every prompt token's logprob equals log_softmax of transformers' logits at the position
  before it (1e-4; fp32 on both sides), its rank and the k alternatives are transformers' top k, the first token has
  none; the prefix cache is bypassed for such a request (a second identical request is scored again in full).
- lm-evaluation-harness's own `local-completions` model against tandem-serve on a local multiple-choice task
  (loglikelihood) and a local generate_until task, beside lm-evaluation-harness's `hf` model (transformers) on the
  same folder and tasks: per-request loglikelihoods within 1e-3, the same is_greedy flags, the same accuracy, and
  the same generated strings. The tasks are JSON files written here (CI reaches no dataset hub).
- Refusals: prompt_logprobs out of range or on chat (400 naming the field); echo with logprobs while streaming.
"""
import json

import openai
import pytest
import torch

from server_fixtures import TandemServer, tiny_model_dir  # noqa: F401 (fixture)

PROMPTS = [[1, 17, 250, 3, 99, 42, 7, 8, 9], [5, 6, 7, 8], [200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 210]]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = TandemServer(tiny_model_dir)
    yield srv
    assert srv.stop() == 0, srv.log_text()


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def model_id(srv):
    return client(srv).models.list().data[0].id


def hf_prompt_scores(model, ids):
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
    return logp   # (n, V): row i scores token i + 1


def test_prompt_logprobs_equal_transformers(server, hf_model):
    k = 3
    for prompt in PROMPTS:
        for attempt in range(2):   # the second time the prefix cache holds the prompt: still scored in full
            out = client(server).completions.create(model=model_id(server), prompt=prompt, max_tokens=2,
                                                    temperature=0, extra_body={"prompt_logprobs": k})
            plp = out.choices[0].model_extra["prompt_logprobs"]
            ref = hf_prompt_scores(hf_model, prompt)
            assert len(plp) == len(prompt) and plp[0] is None, plp
            for i in range(1, len(prompt)):
                row, tok = ref[i - 1], prompt[i]
                entry = plp[i][str(tok)]
                assert abs(entry["logprob"] - float(row[tok])) < 1e-4, (prompt, i, entry, float(row[tok]))
                assert entry["rank"] == 1 + int((row > row[tok]).sum()), (prompt, i, entry)
                top = torch.topk(row, k)
                for lp, tid in zip(top.values.tolist(), top.indices.tolist()):
                    assert abs(plp[i][str(tid)]["logprob"] - lp) < 1e-4, (prompt, i, tid)
                    assert isinstance(plp[i][str(tid)]["decoded_token"], str)


def test_echo_with_logprobs(server, hf_model):
    prompt = PROMPTS[0]
    out = client(server).completions.create(model=model_id(server), prompt=prompt, max_tokens=3, temperature=0,
                                            echo=True, logprobs=2, extra_body={"ignore_eos": True,
                                                                               "return_token_ids": True})
    c = out.choices[0]
    lp = c.logprobs
    n = len(prompt)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = hf_prompt_scores(hf_model, prompt + c.model_extra["token_ids"])
    full = prompt + c.model_extra["token_ids"]
    for i in range(1, n + 3):
        assert abs(lp.token_logprobs[i] - float(ref[i - 1][full[i]])) < 1e-4, (i, lp.token_logprobs[i])
        assert max(lp.top_logprobs[i].values()) == pytest.approx(float(ref[i - 1].max()), abs=1e-4), i
    assert lp.text_offset == sorted(lp.text_offset)


def test_refusals(server):
    c = client(server)
    for bad in (-1, 21, "two"):
        with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
            c.completions.create(model=model_id(server), prompt=[1, 2, 3], max_tokens=1,
                                 extra_body={"prompt_logprobs": bad})
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        c.chat.completions.create(model=model_id(server), messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                  extra_body={"prompt_logprobs": 1})
    with pytest.raises(openai.BadRequestError, match="echo"):
        c.completions.create(model=model_id(server), prompt=[1, 2, 3], max_tokens=1, echo=True, logprobs=1,
                             stream=True)


# ---- lm-evaluation-harness --------------------------------------------------------------------------

MC_DOCS = [
    {"question": "the quick brown fox", "choices": [" jumps", " hums", " boxes"], "answer": 0},
    {"question": "seven wizards quietly", "choices": [" box", " think", " answer", " reason"], "answer": 1},
    {"question": "numbers 1 2 3", "choices": [" 4", " plus", " minus"], "answer": 0},
    {"question": "a lazy dog while", "choices": [" the", " seven", " quick"], "answer": 2},
    {"question": "question reason think", "choices": [" step", " equals"], "answer": 0},
    {"question": "over a lazy", "choices": [" dog", " fox", " wizard", " hum"], "answer": 0},
]
GEN_DOCS = [{"question": q, "answer": a} for q, a in
            [("the quick brown", " fox"), ("numbers 0 1 2", " 3"), ("seven wizards", " box"), ("plus minus", " equals")]]


def write_tasks(d):
    (d / "mc.jsonl").write_text("".join(json.dumps(x) + "\n" for x in MC_DOCS))
    (d / "gen.jsonl").write_text("".join(json.dumps(x) + "\n" for x in GEN_DOCS))
    (d / "tandem_mc.yaml").write_text(f"""task: tandem_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    (d / "tandem_gen.yaml").write_text(f"""task: tandem_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
""")


def run_lm_eval(model, model_args, task_dir):
    import lm_eval
    from lm_eval.tasks import TaskManager
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["tandem_mc", "tandem_gen"],
                                   task_manager=TaskManager(include_path=str(task_dir)), log_samples=True,
                                   batch_size=1, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                   fewshot_random_seed=0)


def test_lm_evaluation_harness_local_completions_equals_hf(server, tiny_model_dir, tmp_path):
    pytest.importorskip("lm_eval")
    write_tasks(tmp_path)
    api = run_lm_eval("local-completions",
                      {"base_url": server.url + "/v1/completions", "model": model_id(server),
                       "tokenizer_backend": "huggingface", "tokenizer": str(tiny_model_dir), "num_concurrent": 1,
                       "max_retries": 1, "tokenized_requests": True}, tmp_path)
    hf = run_lm_eval("hf", {"pretrained": str(tiny_model_dir), "dtype": "float32", "device": "cpu"}, tmp_path)
    a, b = api["samples"]["tandem_mc"], hf["samples"]["tandem_mc"]
    assert len(a) == len(b) == len(MC_DOCS)
    for sa, sb in zip(sorted(a, key=lambda s: s["doc_id"]), sorted(b, key=lambda s: s["doc_id"])):
        for (lla, ga), (llb, gb) in zip([r[0] for r in sa["resps"]], [r[0] for r in sb["resps"]]):
            assert abs(float(lla) - float(llb)) < 1e-3, (sa["doc_id"], lla, llb)
            assert bool(ga) == bool(gb), (sa["doc_id"], ga, gb)
    assert api["results"]["tandem_mc"]["acc,none"] == hf["results"]["tandem_mc"]["acc,none"]
    ga, gb = api["samples"]["tandem_gen"], hf["samples"]["tandem_gen"]
    assert [s["resps"] for s in sorted(ga, key=lambda s: s["doc_id"])] == \
        [s["resps"] for s in sorted(gb, key=lambda s: s["doc_id"])]
    assert api["results"]["tandem_gen"]["exact_match,none"] == hf["results"]["tandem_gen"]["exact_match,none"]
