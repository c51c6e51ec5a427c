"""Transport nccl straight into tensor-parallel shards, on the CPU (its CPU twin: shared/comm's host backend between
CPU trainer ranks and CPU servers; the same code as on GPUs, fp32 slices instead of bf16).

Two trainer ranks (ZeRO-3) push every step with `--weight-sync-transport nccl` to two servers at once, one of 2
tensor-parallel shards and a plain one: 3 server members of the communicator beside the 2 ranks. Each rank sends each shard only the parts of its slice that the shard holds (whole rows straight from the slice,
o_proj / down_proj column blocks packed), and each shard receives them straight into its own staging.

Checks:
- the run ends, the trainer says it synced over the host communicator, and both servers are at the last version;
- after the run each server's greedy tokens AND logprobs equal, exactly, those of a fresh server of the same
  tensor-parallel size loaded from the run's last checkpoint (fp32, the masters the ranks sent): every shard holds
  the checkpoint's shards bit for bit (a part received into the wrong place, or missed, changes the logits);
- servers restarted at the same endpoints, one with another tensor-parallel size (2 -> 4: KV heads now replicated
  on two shards each), take a new run's pushes, cut for their new sizes, and again equal fresh servers of those
  sizes from that run's checkpoint.
"""
import contextlib
import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from server_fixtures import BUILD, TandemServer, build_tiny_model, free_port, http_json, metric, metrics  # noqa: E402
from test_train_grpo import launch, write_dataset  # noqa: E402

PROMPT = [5, 17, 33, 4]


def greedy(url):
    status, out, _ = http_json("POST", url + "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
        "logprobs": 1})
    assert status == 200, out
    choice = out["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def policy_version(url):
    return metric(metrics(url), "tandem_policy_version")


def args(model_dir, data, out_dir, controls, steps):
    return ["--model", str(model_dir), "--train-file", str(data), "--output-dir", str(out_dir),
            "--rollout-servers", ",".join(controls), "--rewards", "regex_format", "--format-regex", "[0-9]",
            "--format-regex-mode", "search", "--num-generations", "4", "--per-device-train-batch-size", "4",
            "--gradient-accumulation-steps", "1", "--max-completion-length", "8", "--max-prompt-length", "64",
            "--learning-rate", "2e-2", "--max-steps", str(steps), "--logging-steps", "1", "--save-steps", "0",
            "--zero-stage", "3", "--seed", "5", "--init-timeout", "60", "--comm-timeout", "30",
            "--rollout-timeout", "60", "--weight-sync-transport", "nccl"]


def run_ranks(d, model_dir, data, out_dir, controls, steps):
    if not (BUILD / "bin" / "tandem-train").exists():
        pytest.skip(f"{BUILD}/bin/tandem-train is not built")
    procs = launch(args(model_dir, data, out_dir, controls, steps), 2, free_port(), d)
    codes = [p.wait(timeout=600) for p, _ in procs]
    for _, log in procs:
        log.close()
    logs = [(d / f"rank{r}.log").read_text() for r in range(2)]
    assert codes == [0, 0], "\n".join(logs)
    return logs


def same_as_fresh(model_dir, ckpt, served, tp):
    """A fresh server of tp shards from the checkpoint answers exactly as the synced one did."""
    with TandemServer(ckpt, "--tensor-parallel-size", tp) as fresh:
        want = greedy(fresh.url)
    assert served == want, f"tensor-parallel size {tp}: synced {served} != fresh from {ckpt.name} {want}"


def test_nccl_transport_into_shards(tmp_path):
    d = tmp_path
    model_dir, data = d / "model", d / "train.jsonl"
    build_tiny_model(model_dir)
    write_dataset(data)
    controls = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    with contextlib.ExitStack() as stack:
        tp2 = stack.enter_context(TandemServer(model_dir, "--control", controls[0], "--tensor-parallel-size", 2))
        tp1 = stack.enter_context(TandemServer(model_dir, "--control", controls[1]))
        before = greedy(tp2.url)
        logs = run_ranks(d, model_dir, data, d / "run", controls, steps=3)
        assert "weight sync over the host communicator" in logs[0], logs[0]
        assert "ZeroMQ from now on" not in logs[0] and "transport zmq" not in logs[0], logs[0]
        rows = [json.loads(line) for line in (d / "run" / "metrics.jsonl").read_text().splitlines()]
        assert len(rows) == 3 and all(r["sync_bytes"] > 0 for r in rows), rows
        served = {2: greedy(tp2.url), 1: greedy(tp1.url)}
        assert policy_version(tp2.url) == 3 and policy_version(tp1.url) == 3
    assert served[2] != before, "the TP = 2 server's answer did not change: the weights never arrived"
    ckpt = d / "run" / "checkpoint-3"
    for tp, got in served.items():
        same_as_fresh(model_dir, ckpt, got, tp)

    # The TP = 2 server comes back with 4 shards at the same control endpoint: the next run's trainer learns the size
    # from its hello and cuts for 4 shards.
    with contextlib.ExitStack() as stack:
        tp4 = stack.enter_context(TandemServer(model_dir, "--control", controls[0], "--tensor-parallel-size", 4))
        tp1 = stack.enter_context(TandemServer(model_dir, "--control", controls[1]))
        run_ranks(d, model_dir, data, d / "run2", controls, steps=2)
        served = {4: greedy(tp4.url), 1: greedy(tp1.url)}
        assert policy_version(tp4.url) == 2
    for tp, got in served.items():
        same_as_fresh(model_dir, d / "run2" / "checkpoint-2", got, tp)
