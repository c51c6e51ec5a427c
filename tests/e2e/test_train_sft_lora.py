"""tandem-train --mode sft --use-peft end to end (CPU): LoRA adapters on a frozen base, PEFT adapter checkpoints.

- 2 ranks, every projection adapted (all-linear), r 8: the loss falls; checkpoint-6 is a PEFT adapter folder
  (adapter_config.json with PEFT's keys, adapter_model.safetensors, no base weights) that
  PeftModel.from_pretrained loads onto the base, and PEFT's logits with it equal tandem's (lora_probe forward on
  the same folder), max |diff| / max |ref| <= 1e-4.
- lora_save_merged: checkpoint-6/merged loads in transformers and its logits equal PEFT's merge_and_unload()'s
  (1e-5); tandem-serve serves it (greedy ids equal transformers' generate on it).
- Data parallelism: 2 ranks x 4 sequences and 1 rank x 8 sequences see the same rows per step; with the adapter
  gradients summed over the ranks, every step's loss and gradient norm agree (1e-5 relative) and so do the final
  adapters.
- Against PEFT + torch: 3 steps from tandem's initial adapter, the same rows and tokens, clip_grad_norm_ and
  torch.optim.AdamW with the linear schedule: losses and gradient norms within 1e-4, final adapters within 1e-3.
- Resume: a second run from checkpoint-3 of a 2-rank run with lora_dropout 0.05 (adapters, their AdamW state, data
  position, the dropout masks) repeats steps 4-6 bit for bit; a full-model checkpoint is refused by a use_peft run, and an adapter checkpoint with other
  LoRA options or without --use-peft is refused.
- Bad LoRA options are refused at start naming the key.
"""
import json
import pathlib
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from server_fixtures import TandemServer, build_tiny_model, http_json  # noqa: E402
from test_train_grpo import free_port, launch, train_binary  # noqa: E402
from test_train_sft_resume import run, write_sft  # noqa: E402

torch.set_num_threads(2)


def lora_args(model_dir, data, out_dir, batch, extra=()):
    return ["--mode", "sft", "--model", str(model_dir), "--train-file", str(data), "--output-dir", str(out_dir),
            "--per-device-train-batch-size", str(batch), "--gradient-accumulation-steps", "2",
            "--learning-rate", "1e-2", "--max-steps", "6", "--save-steps", "3", "--save-total-limit", "1",
            "--logging-steps", "1", "--seed", "5", "--shuffle-dataset", "false", "--init-timeout", "60",
            "--use-peft", "--lora-r", "8", "--lora-alpha", "16", "--lora-target-modules", "all-linear",
            "--lora-dropout", "0", *extra]


def metrics(out_dir):
    return {r["step"]: r for r in map(json.loads, (out_dir / "metrics.jsonl").read_text().splitlines())}


def assert_runs_agree(a_dir, b_dir, steps):
    """Two runs that differ only in the order of the sums over ranks: loss and grad norm within 1e-5 (relative) at
    each step, final adapters (checkpoint-6) within 1e-4."""
    a, b = metrics(a_dir), metrics(b_dir)
    for step in steps:
        for key in ("loss", "grad_norm"):
            assert abs(a[step][key] - b[step][key]) <= 1e-5 * abs(a[step][key]), (step, key, a[step], b[step])
    from safetensors.torch import load_file
    wa = load_file(str(a_dir / "checkpoint-6" / "adapter_model.safetensors"))
    wb = load_file(str(b_dir / "checkpoint-6" / "adapter_model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert ((wa[k] - wb[k]).norm() / wa[k].norm()).item() <= 1e-4, k


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("sft_lora")
    build_tiny_model(d / "model")
    write_sft(d / "train.jsonl")
    return d


@pytest.fixture(scope="module")
def two_ranks(setup):
    d = setup
    codes, logs = run(lora_args(d / "model", d / "train.jsonl", d / "a", 4, ["--lora-save-merged"]), 2, d, "a")
    assert codes == [0, 0], logs
    return d, logs


def test_lora_sft_trains_and_writes_a_peft_adapter(two_ranks):
    d, logs = two_ranks
    assert "LoRA r 8, alpha 16" in logs and "trainable parameters" in logs
    m = metrics(d / "a")
    assert sorted(m) == [1, 2, 3, 4, 5, 6]
    assert m[6]["loss"] < m[1]["loss"] - 0.5, m
    ckpt = d / "a" / "checkpoint-6"
    assert not (d / "a" / "checkpoint-3").exists()  # save_total_limit 1
    assert (ckpt / "adapter_model.safetensors").exists() and (ckpt / "tokenizer.json").exists()
    assert not (ckpt / "model.safetensors").exists()
    cfg = json.loads((ckpt / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 8 and cfg["lora_alpha"] == 16
    assert sorted(cfg["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"])
    assert json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == 6

    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    weights = load_file(str(ckpt / "adapter_model.safetensors"))
    assert len(weights) == 2 * 7 * 2
    assert all(torch.count_nonzero(w) > 0 for w in weights.values())  # B moved off its zero init
    base = AutoModelForCausalLM.from_pretrained(d / "model", dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, ckpt)
    seqs = [[5, 17, 33, 4, 9, 12, 40], [100, 7, 8]]
    with torch.no_grad():
        ref = torch.cat([peft(input_ids=torch.tensor([s])).logits[0] for s in seqs])
    probe = pathlib.Path(train_binary()).parent.parent / "tests" / "lora_probe"
    out = d / "probe.safetensors"
    subprocess.run([str(probe), "forward", str(d / "model"), str(ckpt), str(out)], input=json.dumps({"sequences": seqs}),
                   text=True, check=True, capture_output=True)
    got = load_file(str(out))["logits"]
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert err <= 1e-4, err
    # The adapter changes the model: its logits are not the base's.
    fresh = AutoModelForCausalLM.from_pretrained(d / "model", dtype=torch.float32)
    with torch.no_grad():
        plain = torch.cat([fresh(input_ids=torch.tensor([s])).logits[0] for s in seqs])
    assert (plain - ref).abs().max() > 1e-3
    # lora_save_merged: checkpoint-6/merged is the base with s B A added (PEFT's merge_and_unload), an HF folder.
    merged = AutoModelForCausalLM.from_pretrained(ckpt / "merged", dtype=torch.float32)
    peft_merged = peft.merge_and_unload()
    with torch.no_grad():
        got_merged = torch.cat([merged(input_ids=torch.tensor([s])).logits[0] for s in seqs])
        want_merged = torch.cat([peft_merged(input_ids=torch.tensor([s])).logits[0] for s in seqs])
    err = ((got_merged - want_merged).abs().max() / want_merged.abs().max()).item()
    assert err <= 1e-5, err
    assert (ckpt / "merged" / "tokenizer.json").exists()
    # tandem-serve serves the merged folder, and the adapter folder itself beside the base (--lora): greedy ids of
    # both equal transformers' generate on the merged model.
    server = TandemServer(ckpt / "merged")
    beside = TandemServer(d / "model", "--lora", f"sft={ckpt}")
    try:
        for ids in seqs:
            with torch.no_grad():
                out = merged.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12, min_new_tokens=12,
                                      attention_mask=torch.ones(1, len(ids), dtype=torch.long), eos_token_id=None,
                                      pad_token_id=0)
            for srv, model in ((server, None), (beside, "sft")):
                status, resp, _ = http_json("POST", srv.url + "/v1/completions",
                                            {"prompt": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                             "return_token_ids": True, **({"model": model} if model else {})})
                assert status == 200, resp
                assert resp["choices"][0]["token_ids"] == out[0, len(ids):].tolist(), model
    finally:
        server.kill()
        beside.kill()


def test_one_rank_equals_two_ranks(two_ranks):
    d, _ = two_ranks
    codes, logs = run(lora_args(d / "model", d / "train.jsonl", d / "b", 8), 1, d, "b")
    assert codes == [0], logs
    assert_runs_agree(d / "a", d / "b", range(1, 7))


def test_resume_on_another_number_of_ranks(setup):
    """The adapters' state is saved whole, so a 2-rank LoRA checkpoint resumes on 1 rank: with the global batch kept
    (4 x 2 ranks -> 8 x 1, shuffle off) and no dropout (its masks follow the rank), steps 4-6 continue as on 2 ranks,
    up to the order of the sums over ranks (as test_one_rank_equals_two_ranks allows)."""
    d = setup
    model, data = d / "model", d / "train.jsonl"
    args = lora_args(model, data, d / "w2", 4)
    args[args.index("--save-total-limit") + 1] = "0"
    codes, logs = run(args, 2, d, "w2")
    assert codes == [0, 0], logs
    codes, logs = run(lora_args(model, data, d / "w1", 8, ["--resume", str(d / "w2" / "checkpoint-3")]), 1, d, "w1")
    assert codes == [0], logs
    assert "written by 2 ranks; its adapters continue on 1 ranks (data_position 24 per rank becomes 48)" in logs, logs
    assert sorted(metrics(d / "w1")) == [4, 5, 6]
    assert_runs_agree(d / "w2", d / "w1", (4, 5, 6))


@pytest.mark.parametrize("extra,needle", [
    (["--lora-dropout", "1"], "lora_dropout must be in [0, 1)"),
    (["--lora-target-modules", "q_proj,qkv_proj"], "unknown module 'qkv_proj'"),
    (["--lora-r", "0"], "lora_r must be >= 1"),
    (["--lora-init", "pissa"], "lora_init 'pissa' is not supported"),
    (["--use-peft", "false", "--lora-save-merged"], "lora_save_merged: needs use_peft"),
])
def test_bad_lora_options_are_refused(setup, extra, needle):
    d = setup
    proc = subprocess.run([train_binary(), *lora_args(d / "model", d / "train.jsonl", d / "bad", 4, extra)],
                          capture_output=True, text=True, timeout=60,
                          env={"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                               "MASTER_PORT": str(free_port())})
    assert proc.returncode != 0
    assert needle in proc.stderr, proc.stderr


def test_training_matches_peft_with_torch_adamw(setup):
    """Three optimizer steps of tandem-train --use-peft against PEFT + torch on the same rows: tandem's initial
    adapter (lora_probe init, the trainer's seed and streams) loaded with PeftModel.from_pretrained(is_trainable),
    the completion-only cross-entropy over every completion token of the step (prompt + completion + EOS text
    tokenized as tandem and TRL do), torch.nn.utils.clip_grad_norm_(1.0), torch.optim.AdamW and a linear schedule.
    Every step's loss and gradient norm within 1e-4 relative, the final adapters within 1e-3."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM
    d = setup
    steps, batch, accum, lr, seed = 3, 4, 2, 1e-2, 5
    args = lora_args(d / "model", d / "train.jsonl", d / "ref", batch, ["--seed", str(seed)])
    args[args.index("--max-steps") + 1] = str(steps)
    codes, logs = run(args, 1, d, "ref")
    assert codes == [0], logs
    got = metrics(d / "ref")

    probe = pathlib.Path(train_binary()).parent.parent / "tests" / "lora_probe"
    init = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "init": "default", "seed": seed}
    subprocess.run([str(probe), "init", str(d / "model"), str(d / "init")], input=json.dumps(init), text=True,
                   check=True, capture_output=True)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(d / "model", dtype=torch.float32),
                                      d / "init", is_trainable=True)
    params = [p for n, p in model.named_parameters() if p.requires_grad]
    assert params and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 - k / steps)
    tok = Tokenizer.from_file(str(d / "model" / "tokenizer.json"))
    eos = json.loads((d / "model" / "tokenizer_config.json").read_text())["eos_token"]
    rows = [json.loads(line) for line in (d / "train.jsonl").read_text().splitlines()]
    for step in range(1, steps + 1):
        batch_rows = rows[(step - 1) * batch * accum: step * batch * accum]
        seqs = []
        for r in batch_rows:
            prompt = tok.encode(r["prompt"]).ids
            full = tok.encode(r["prompt"] + r["completion"] + eos).ids
            k = 0
            while k < len(prompt) and prompt[k] == full[k]:
                k += 1
            seqs.append((full, k))
        n_tokens = sum(len(f) - k for f, k in seqs)
        assert n_tokens == got[step]["num_items_in_batch"], (step, n_tokens, got[step])  # the loss normaliser
        opt.zero_grad()
        total = 0.0
        for full, k in seqs:
            logits = model(input_ids=torch.tensor([full])).logits[0]
            lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(full[1:])[:, None])[:, 0]
            loss = -lp[k - 1:].sum() / n_tokens  # targets of positions k-1 .. L-2: the completion's tokens
            loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0).item()
        opt.step()
        sched.step()
        print(f"step {step}: loss {got[step]['loss']:.7g} vs {total:.7g}, grad_norm {got[step]['grad_norm']:.7g} vs "
              f"{norm:.7g}")
        assert abs(got[step]["loss"] - total) <= 1e-4 * total, (step, got[step], total)
        assert abs(got[step]["grad_norm"] - norm) <= 1e-4 * norm, (step, got[step], norm)
    want = {n.replace(".default.", "."): p.detach() for n, p in model.named_parameters() if p.requires_grad}
    have = load_file(str(d / "ref" / f"checkpoint-{steps}" / "adapter_model.safetensors"))
    assert have.keys() == want.keys()
    worst = 0.0
    for name, w in want.items():
        err = ((have[name] - w).norm() / w.norm()).item()
        worst = max(worst, err)
        assert err <= 1e-3, (name, err)
    print(f"losses {[got[s]['loss'] for s in got]} vs torch last {total:.7g}; worst adapter after {steps} steps "
          f"{worst:.2e}")


def test_resume_repeats_the_run_exactly(setup):
    d = setup
    model, data = d / "model", d / "train.jsonl"
    # With adapter dropout: its masks follow (seed, step, micro-batch, rank), so the resumed steps draw the same.
    args = lora_args(model, data, d / "r1", 4, ["--lora-dropout", "0.05"])
    args[args.index("--save-total-limit") + 1] = "0"
    codes, logs = run(args, 2, d, "r1")
    assert codes == [0, 0], logs
    ckpt = d / "r1" / "checkpoint-3"
    assert (ckpt / "trainer_state" / "adapter_optimizer.safetensors").exists()
    codes, logs = run(lora_args(model, data, d / "r2", 4, ["--lora-dropout", "0.05", "--resume", str(ckpt)]), 2, d,
                      "r2")
    assert codes == [0, 0], logs
    assert "resumed from" in logs
    a, b = metrics(d / "r1"), metrics(d / "r2")
    assert sorted(b) == [4, 5, 6]
    for step in (4, 5, 6):
        assert (a[step]["loss"], a[step]["grad_norm"]) == (b[step]["loss"], b[step]["grad_norm"]), step
    from safetensors.torch import load_file
    wa = load_file(str(d / "r1" / "checkpoint-6" / "adapter_model.safetensors"))
    wb = load_file(str(d / "r2" / "checkpoint-6" / "adapter_model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # Other LoRA options, or no --use-peft, on this checkpoint; a use_peft run on a full-model checkpoint.
    codes, logs = run(lora_args(model, data, d / "r3", 4, ["--resume", str(ckpt), "--lora-r", "4"]), 2, d, "r3")
    assert codes != [0, 0] and "this run asks for r 4" in logs, logs
    plain = [a for a in lora_args(model, data, d / "r4", 4, ["--resume", str(ckpt)]) if a != "--use-peft"]
    codes, logs = run(plain, 2, d, "r4")
    assert codes != [0, 0] and "is a LoRA adapter checkpoint" in logs, logs
    full = [a for a in lora_args(model, data, d / "r5", 4) if a != "--use-peft"]
    full[full.index("--max-steps") + 1] = "1"
    full[full.index("--save-steps") + 1] = "1"
    codes, logs = run(full, 2, d, "r5")
    assert codes == [0, 0], logs
    codes, logs = run(lora_args(model, data, d / "r6", 4, ["--resume", str(d / "r5" / "checkpoint-1")]), 2, d, "r6")
    assert codes != [0, 0] and "is a full-model checkpoint" in logs, logs
