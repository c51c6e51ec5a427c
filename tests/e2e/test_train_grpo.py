"""tandem-train end to end (CPU): one rollout server, 2 trainer ranks (ZeRO-3, host backend), a toy task.

The task: prompts are short texts; the reward is regex_format in search mode for a digit. A random tiny model
writes a digit in about a third of its completions, so groups have reward variance and GRPO can push the
probability up. Checks: both ranks exit 0, the mean reward of the last steps beats the first steps', the
server's policy version followed the weight syncs, metrics.jsonl carries TRL's names, and the checkpoint the
run wrote loads in transformers. A rank killed mid-run makes the other exit with an error naming it.
"""
import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from server_fixtures import BUILD, TandemServer, build_tiny_model, free_port, http_json, metric, metrics  # noqa: E402


def train_binary():
    path = BUILD / "bin" / "tandem-train"
    if not path.exists():
        pytest.skip(f"{path} is not built (run scripts/test.sh, or set TANDEM_BUILD_DIR)")
    return str(path)


def write_dataset(path, n=64):
    words = ["the quick brown", "a lazy dog", "seven wizards", "numbers plus", "question answer", "think step"]
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": words[i % len(words)] + f" {i % 10}", "id": i}) + "\n")


def launch(args, world, port, out_dir, env_extra=None, binary=None):
    """Starts `world` ranks of `binary` (default: this build's tandem-train), logs in out_dir/rank<r>.log."""
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", **(env_extra or {}))
        log = open(out_dir / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen([binary or train_binary(), *args], env=env, stdout=log, stderr=subprocess.STDOUT),
                      log))
    return procs


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("grpo")
    model_dir = d / "model"
    build_tiny_model(model_dir)
    data = d / "train.jsonl"
    write_dataset(data)
    return d, model_dir, data


def grpo_args(model_dir, data, out_dir, control, steps, extra=()):
    return ["--model", str(model_dir), "--train-file", str(data), "--output-dir", str(out_dir),
            "--rollout-servers", control, "--rewards", "regex_format", "--format-regex", "[0-9]",
            "--format-regex-mode", "search", "--num-generations", "8", "--per-device-train-batch-size", "8",
            "--gradient-accumulation-steps", "1", "--max-completion-length", "12", "--max-prompt-length", "64",
            "--learning-rate", "2e-2", "--max-steps", str(steps), "--logging-steps", "1", "--save-steps", "0",
            "--zero-stage", "3", "--seed", "3", "--init-timeout", "60", "--comm-timeout", "20",
            "--rollout-timeout", "60", "--loss-type", "grpo", *extra]


def test_grpo_two_ranks_raises_reward(setup):
    d, model_dir, data = setup
    out_dir = d / "run"
    control = f"tcp://127.0.0.1:{free_port()}"
    with TandemServer(model_dir, "--control", control) as srv:
        procs = launch(grpo_args(model_dir, data, out_dir, control, steps=24), 2, free_port(), d)
        codes = [p.wait(timeout=900) for p, _ in procs]
        for _, log in procs:
            log.close()
        logs = [(d / f"rank{r}.log").read_text() for r in range(2)]
        assert codes == [0, 0], "\n".join(logs)
        # The server now holds what the two ranks sent, slice by slice: its greedy continuation must be the
        # final checkpoint's under transformers.
        status, served, _ = http_json("POST", srv.url + "/v1/completions", {
            "prompt": [5, 17, 33, 4], "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert status == 200, served
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 24
    for key in ("loss", "reward", "reward_std", "rewards/regex_format/mean", "frac_reward_zero_std",
                "completions/mean_length", "completions/clipped_ratio", "entropy", "grad_norm", "learning_rate",
                "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max", "num_tokens",
                "num_items_in_batch", "epoch", "completions/min_length", "completions/max_length",
                "completions/mean_terminated_length", "completions/min_terminated_length",
                "completions/max_terminated_length", "step_time", "rollout_time", "sync_time", "sync_transfer_time", "sync_bytes",
                "sync_begin_time", "sync_end_time", "sync_commit_time"):
        assert key in rows[0], key
    assert all(0 < r["sync_transfer_time"] <= r["sync_time"] and r["sync_bytes"] > 0 for r in rows)
    # the push's parts are disjoint intervals inside it, and the swap is part of the end's round trip
    assert all(0 < r["sync_begin_time"] and 0 <= r["sync_commit_time"] <= r["sync_end_time"] and
               r["sync_begin_time"] + r["sync_transfer_time"] + r["sync_end_time"] <= r["sync_time"] for r in rows)
    first = sum(r["reward"] for r in rows[:6]) / 6
    last = sum(r["reward"] for r in rows[-6:]) / 6
    assert last > first + 0.1, f"mean reward {first:.3f} -> {last:.3f}"
    assert rows[-1]["policy_version"] == 24
    # The final checkpoint loads in transformers and reproduces the trained weights' behaviour on a prompt.
    ckpt = out_dir / "checkpoint-24"
    assert (ckpt / "config.json").exists() and (ckpt / "tokenizer.json").exists()
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(torch.tensor([[5, 17, 33, 4]]), attention_mask=torch.ones(1, 4, dtype=torch.long),
                             do_sample=False, max_new_tokens=16, min_new_tokens=16, eos_token_id=None, pad_token_id=0)
    assert served["choices"][0]["token_ids"] == out[0, 4:].tolist()


def test_killed_rank_fails_the_other_cleanly(setup):
    d, model_dir, data = setup
    out_dir = d / "killed"
    control = f"tcp://127.0.0.1:{free_port()}"
    with TandemServer(model_dir, "--control", control):
        procs = launch(grpo_args(model_dir, data, out_dir, control, steps=1000, extra=["--comm-timeout", "5"]), 2,
                       free_port(), d)
        time.sleep(1.0)
        deadline = time.time() + 60
        while time.time() < deadline and "step 2/" not in (d / "rank0.log").read_text():
            time.sleep(0.2)
        procs[1][0].send_signal(signal.SIGKILL)
        t0 = time.time()
        code = procs[0][0].wait(timeout=60)
        elapsed = time.time() - t0
        for _, log in procs:
            log.close()
    log0 = (d / "rank0.log").read_text()
    assert code != 0
    assert elapsed < 30, f"rank 0 took {elapsed:.1f} s to notice"
    assert "rank 1" in log0, log0[-2000:]


def test_restarted_server_gets_the_weights(setup):
    """A rollout server that dies mid-run and comes back on the same endpoint is given the trainer's current
    weights before it generates again; the run finishes and the new server ends on the final version."""
    d, model_dir, data = setup
    out_dir = d / "restart"
    control = f"tcp://127.0.0.1:{free_port()}"
    first = TandemServer(model_dir, "--control", control)
    procs = launch(grpo_args(model_dir, data, out_dir, control, steps=30, extra=["--rollout-timeout", "5"]), 1,
                   free_port(), d)
    deadline = time.time() + 120
    while time.time() < deadline and "step 4/" not in (d / "rank0.log").read_text():
        time.sleep(0.1)
    first.kill()
    # Start the second server only once the trainer has seen the first one gone: a server back within the same
    # round can take that round's ordinary weight push over ZeroMQ's reconnect and never look stale.
    deadline = time.time() + 60
    while time.time() < deadline and "carrying on with the others" not in (d / "rank0.log").read_text():
        time.sleep(0.1)
    with TandemServer(model_dir, "--control", control) as second:
        code = procs[0][0].wait(timeout=300)
        procs[0][1].close()
        log = (d / "rank0.log").read_text()
        assert code == 0, log[-3000:]
        version = metric(metrics(second.url), "tandem_policy_version")
    assert "answers again" in log or "pushing them" in log, log[-3000:]
    assert version == 30, version


def test_kl_reference_and_multiple_iterations(setup):
    """beta > 0 (a frozen ZeRO-3 reference model), num_iterations 2 and two micro-steps per generation round
    (old logprobs), ZeRO-2, the dr_grpo loss, an entropy bonus (its gradient flows through the model): the run
    completes, logs a finite, non-negative KL that grows from 0 as the policy moves away from the reference."""
    d, model_dir, data = setup
    out_dir = d / "kl"
    control = f"tcp://127.0.0.1:{free_port()}"
    with TandemServer(model_dir, "--control", control):
        args = grpo_args(model_dir, data, out_dir, control, steps=6,
                         extra=["--beta", "0.04", "--num-iterations", "2", "--gradient-accumulation-steps", "2",
                                "--per-device-train-batch-size", "8", "--zero-stage", "2", "--loss-type", "dr_grpo",
                                "--entropy-coef", "0.01"])
        procs = launch(args, 1, free_port(), d)
        code = procs[0][0].wait(timeout=600)
        procs[0][1].close()
    log = (d / "rank0.log").read_text()
    assert code == 0, log[-3000:]
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 6
    kls = [r["kl"] for r in rows]
    assert all(k >= 0 and k == k for k in kls), kls
    assert kls[0] < 1e-6 < max(kls), kls
    assert all(r["entropy"] > 0 for r in rows)


def _metric_rows(out_dir):
    return {r["step"]: r for r in map(json.loads, (out_dir / "metrics.jsonl").read_text().splitlines())}


def _differing_keys(a, b):
    """Keys whose values differ between two metrics rows, leaving out the wall-clock times (*_time, elapsed), the
    pools' busy fractions (*_busy_fraction) and sync_bytes (the bytes sent to all servers: twice as many for two)."""
    keys = {k for k in set(a) | set(b)
            if not k.endswith(("_time", "_busy_fraction")) and k not in ("elapsed", "sync_bytes")}
    return sorted(k for k in keys if a.get(k) != b.get(k))


# Metrics renamed since an older baseline: its name -> this build's. num_tokens became TRL's cumulative prompt +
# completion count (issue 27); the per-round completion tokens it used to hold are num_items_in_batch.
RENAMED = {"num_tokens": "num_items_in_batch"}
# Metrics whose averaging became TRL's in issue 27: the mean over the step's micro-batches of each micro-batch's
# value, where a baseline from before (its rows lack num_items_in_batch) weighted every token of the step alike. The
# two agree when a step has one micro-batch; with several they are not compared (the loss, the rewards and the
# checkpoints' weights still are, bit for bit).
AVERAGED_SINCE = {"kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"}


def assert_same_run_as_baseline(out_b, rows_b, out_x, rows_x, checkpoints, micro_steps_per_step=1):
    """A run of this build (out_x, rows_x) equals the baseline build's (out_b, rows_b): every metric the baseline
    logs (under its name of then, RENAMED, for a baseline from before a rename; AVERAGED_SINCE), the checkpoints'
    weights byte for byte, and every trainer_state key the baseline writes (keys added since, such as zero_slicing, are not the
    baseline's)."""
    for step in rows_b:
        old, new = rows_b[step], rows_x[step]
        before_27 = "num_items_in_batch" not in old
        differing = [k for k in _differing_keys(old, new) if k in old and not (
            before_27 and k in RENAMED and old[k] == new.get(RENAMED[k])) and not (
            before_27 and k in AVERAGED_SINCE and micro_steps_per_step > 1)]
        assert not differing, (step, {k: (rows_b[step].get(k), rows_x[step].get(k)) for k in differing})
    assert len({rows_b[s]["loss"] for s in rows_b}) > 1
    for ckpt in checkpoints:
        assert (out_b / ckpt / "model.safetensors").read_bytes() == (out_x / ckpt / "model.safetensors").read_bytes()
        states = [json.loads((out / ckpt / "trainer_state.json").read_text()) for out in (out_b, out_x)]
        assert states[0] == {k: v for k, v in states[1].items() if k in states[0]}, states


def test_grpo_cpu_is_reproducible_and_resume_exact(setup):
    """Two identical GRPO runs on the CPU (2 ranks) log the same metrics bit for bit and end on the same weights; a
    run resumed from the first's checkpoint-3 repeats its steps 4-6 bit for bit too (issue 22).

    Each rank sends its prompts one message at a time and a server batches whatever has arrived, so which
    completions share a step is up to timing. The second run even has two servers, one on 1 thread and one on 2,
    which share the prompts. That used to move the servers' logprobs by an ulp or so, which the importance-sampling
    correction feeds into the loss: the runs parted at once. The server's forward is batch-invariant now (its
    numbers depend neither on the step's other sequences nor on the thread count: shared/model_layer.c), the
    sampling seeds follow the run's seed, the step, the rank and the prompt, and the trainer sums in fixed orders."""
    d, model_dir, data = setup
    runs = {}
    one, two = {}, {"OMP_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": "2"}
    plan = (("a", [], [one]), ("again", [], [one, two]),
            ("resumed", ["--resume", str(d / "repro-a" / "checkpoint-3")], [one]))
    for tag, extra, server_envs in plan:
        controls = [f"tcp://127.0.0.1:{free_port()}" for _ in server_envs]
        with contextlib.ExitStack() as stack:
            servers = [stack.enter_context(TandemServer(model_dir, "--control", control, env=env))
                       for control, env in zip(controls, server_envs)]
            args = grpo_args(model_dir, data, d / f"repro-{tag}", ",".join(controls), steps=6,
                             extra=["--save-steps", "3", "--per-device-train-batch-size", "16", *extra])
            procs = launch(args, 2, free_port(), d)
            codes = [p.wait(timeout=600) for p, _ in procs]
            for _, log in procs:
                log.close()
            generated = [metric(metrics(srv.url), "tandem_generation_tokens_total") for srv in servers]
        assert codes == [0, 0], (d / "rank0.log").read_text()[-3000:] + (d / "rank1.log").read_text()[-3000:]
        assert all(g > 0 for g in generated), (tag, generated)   # two servers: both took prompts
        runs[tag] = _metric_rows(d / f"repro-{tag}")
    assert sorted(runs["a"]) == sorted(runs["again"]) == [1, 2, 3, 4, 5, 6]
    assert sorted(runs["resumed"]) == [4, 5, 6]
    for step in range(1, 7):
        assert not _differing_keys(runs["a"][step], runs["again"][step]), (
            step, {k: (runs["a"][step].get(k), runs["again"][step].get(k))
                   for k in _differing_keys(runs["a"][step], runs["again"][step])})
    for step in (4, 5, 6):
        assert not _differing_keys(runs["a"][step], runs["resumed"][step]), (
            step, {k: (runs["a"][step].get(k), runs["resumed"][step].get(k))
                   for k in _differing_keys(runs["a"][step], runs["resumed"][step])})
    # The rewards moved (the runs did learn something to disagree about), and the weights they end on are the same
    # bytes.
    assert len({runs["a"][s]["loss"] for s in range(1, 7)}) > 1
    final = [(d / f"repro-{tag}" / "checkpoint-6" / "model.safetensors").read_bytes() for tag, _, _ in plan]
    assert final[0] == final[1] == final[2]


def test_top_entropy_quantile_on_two_ranks(setup):
    """top_entropy_quantile < 1 on 2 ranks: the entropy threshold is taken over both ranks' tokens (a collective
    per micro-batch). The run completes and logs every step."""
    d, model_dir, data = setup
    out_dir = d / "quantile"
    control = f"tcp://127.0.0.1:{free_port()}"
    with TandemServer(model_dir, "--control", control):
        procs = launch(grpo_args(model_dir, data, out_dir, control, steps=4, extra=["--top-entropy-quantile", "0.5"]),
                       2, free_port(), d)
        codes = [p.wait(timeout=600) for p, _ in procs]
        for _, log in procs:
            log.close()
    assert codes == [0, 0], (d / "rank0.log").read_text()[-3000:] + (d / "rank1.log").read_text()[-3000:]
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
