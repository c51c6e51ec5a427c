"""tandem-train GRPO with LoRA adapters (--use-peft) against a CPU rollout server, end to end.

2 ranks, every projection adapted, lora_dropout 0.05, beta 0.04 (the reference is the frozen base itself, run with
the adapters detached), lora_save_merged; once with each lora_sync. After 10 steps:
- the server holds what the ranks pushed — lora_sync adapter: the A and B matrices alone (rank 0 sends them; the
  server runs them beside its base weights), lora_sync merged: the base with the adapters merged in, each rank its
  slice — so its greedy continuation equals transformers' on the final checkpoint's merged/ folder and PEFT's on the
  adapter folder;
- adapter pushes carry the adapters' bytes (fp32), merged ones the whole model's;
- the KL to the reference starts at 0 (B = 0 at init: the policy is the base) and grows;
- every step synced (policy_version 10) and the metrics are finite.
"""
import json
import math
import pathlib
import sys

import pytest
import torch

from transformers import AutoModelForCausalLM

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from server_fixtures import TandemServer, build_tiny_model, http_json  # noqa: E402
from test_train_grpo import free_port, grpo_args, launch, write_dataset  # noqa: E402

torch.set_num_threads(2)
PROMPT = [5, 17, 33, 4]


@pytest.mark.parametrize("lora_sync", ["adapter", "merged"])
def test_grpo_with_lora_syncs_the_policy(tmp_path, lora_sync):
    d = tmp_path
    model_dir, data, out_dir = d / "model", d / "train.jsonl", d / "run"
    build_tiny_model(model_dir)
    write_dataset(data)
    steps = 10
    control = f"tcp://127.0.0.1:{free_port()}"
    extra = ["--use-peft", "--lora-r", "8", "--lora-alpha", "16", "--lora-target-modules", "all-linear",
             "--lora-dropout", "0.05", "--beta", "0.04", "--lora-save-merged", "--learning-rate", "5e-2",
             "--lora-sync", lora_sync]
    with TandemServer(model_dir, "--control", control) as srv:
        procs = launch(grpo_args(model_dir, data, out_dir, control, steps=steps, extra=extra), 2, free_port(), d)
        codes = [p.wait(timeout=900) for p, _ in procs]
        for _, log in procs:
            log.close()
        logs = "\n".join((d / f"rank{r}.log").read_text() for r in range(2))
        assert codes == [0, 0], logs
        status, served, _ = http_json("POST", srv.url + "/v1/completions", {
            "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        assert status == 200, served
    assert "LoRA r 8, alpha 16" in logs
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == steps and rows[-1]["policy_version"] == steps
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    # The tiny Llama (hidden 64, intermediate 96, 2 layers): r 8 on all 7 modules = 8 * (64+64 + 64+32 + 64+32 +
    # 64+64 + 64+96 + 64+96 + 96+64) * 2 layers adapter values; the whole model is far larger.
    n_adapter = 8 * (128 + 96 + 96 + 128 + 160 + 160 + 160) * 2
    n_model = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    sent = rows[-1]["sync_bytes"]
    if lora_sync == "adapter":
        assert n_adapter * 4 <= sent < n_adapter * 4 * 1.1, (sent, n_adapter)
    else:
        assert sent >= n_model * 4, (sent, n_model)
    kls = [r["kl"] for r in rows]
    assert kls[0] < 1e-6 < max(kls), kls

    from peft import PeftModel
    ckpt = out_dir / f"checkpoint-{steps}"
    ids = torch.tensor([PROMPT])
    gen = dict(attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long), do_sample=False, max_new_tokens=16,
               min_new_tokens=16, eos_token_id=None, pad_token_id=0)
    merged = AutoModelForCausalLM.from_pretrained(ckpt / "merged", dtype=torch.float32)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), ckpt)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        want = merged.generate(ids, **gen)[0, len(PROMPT):].tolist()
        via_peft = peft.generate(input_ids=ids, **gen)[0, len(PROMPT):].tolist()
        before = base.generate(ids, **gen)[0, len(PROMPT):].tolist()
    assert served["choices"][0]["token_ids"] == want == via_peft
    assert want != before, "the adapters did not change the model's greedy continuation"
