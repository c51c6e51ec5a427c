"""Node-aware ZeRO end to end — sharding_strategy hybrid_shard (HSDP) and zero_hpz_partition_size (ZeRO++ hpZ):
tandem-train --mode sft on 4 CPU ranks started as 2 "nodes" x 2 ranks (two `tandem-train launch --nnodes 2` on
localhost, so the node membership comes from the launch contract).

HSDP (ZeRO-3 state partitioned within each node, replicated across the two) must give the losses and final weights
of flat ZeRO-3 over the 4 ranks within float tolerance (only summation orders differ). Its metrics rows count the
ZeRO bytes rank 0 sent across the node boundary: with 2 micro-steps per optimizer step, flat ZeRO-3 sends every
all-gather and reduce-scatter partly to the other node, HSDP only one all-reduce of its gradient slices per step
(about 2 bytes x parameters), a third of flat's here. hpZ gives the same results too; across nodes it sends the
reduce-scatter of each micro-step's node-local gradient slices and one refresh of the parameters per step (about
3 bytes x parameters here), never a parameter all-gather of forward or backward. The node map is printed at the rendezvous.
GRPO with either layout syncs the weights to the rollout server over ZeroMQ and equals flat ZeRO-3's run; NCCL
weight sync from them is refused.
"""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from server_fixtures import BUILD, build_tiny_model  # noqa: E402
from test_launch import LAUNCH_ENV, finish_nodes, launcher  # noqa: E402
from test_train_grpo import free_port  # noqa: E402
from test_train_sft_resume import write_sft  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("hsdp")
    build_tiny_model(d / "model")
    write_sft(d / "train.jsonl", n=64)
    return d


def run_2x2(d, tag, *layout):
    port = free_port()
    args = ["--mode", "sft", "--train-file", str(d / "train.jsonl"), "--output-dir", str(d / tag),
            "--per-device-train-batch-size", "2", "--gradient-accumulation-steps", "2", "--learning-rate", "1e-2",
            "--max-steps", "4", "--save-steps", "0", "--logging-steps", "1", "--zero-stage", "3", "--seed", "5",
            "--init-timeout", "60", *layout]
    procs = [launcher(["--model", str(d / "model"), "--nnodes", "2", "--node-rank", str(n), "--ranks", "2",
                       "--servers", "0", "--master-addr", "127.0.0.1", "--master-port", str(port),
                       "--log-dir", str(d / f"{tag}{n}-logs"), "--", *args], d)
             for n in (0, 1)]
    out0, out1 = finish_nodes(procs, timeout=600)
    assert procs[0].returncode == 0 and procs[1].returncode == 0, out0 + "\n---- node 1 ----\n" + out1
    rows = [json.loads(x) for x in (d / tag / "metrics.jsonl").read_text().splitlines()]
    return out0, rows


def weights(path):
    from safetensors.numpy import load_file
    return load_file(str(path))


def test_hsdp_equals_flat_zero3_and_keeps_gathers_inside_the_node(setup):
    d = setup
    out_flat, flat = run_2x2(d, "flat", "--sharding-strategy", "full_shard")
    out_hsdp, hsdp = run_2x2(d, "hsdp", "--sharding-strategy", "hybrid_shard")
    assert "node map (2 nodes of 2 ranks): node 0 (host " in out_flat and "): ranks 2-3" in out_flat, out_flat
    assert "ZeRO-3 over 2 rank(s) of each node, replicated over 2 node(s) (HSDP)" in out_hsdp, out_hsdp
    assert [r["step"] for r in flat] == [r["step"] for r in hsdp] == [1, 2, 3, 4]
    for a, b in zip(flat, hsdp):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * abs(a["grad_norm"]), (a["grad_norm"], b["grad_norm"])
    assert flat[-1]["loss"] < flat[0]["loss"]
    wf, wh = weights(d / "flat" / "checkpoint-4" / "model.safetensors"), weights(d / "hsdp" / "checkpoint-4" /
                                                                               "model.safetensors")
    assert wf.keys() == wh.keys()
    # Adam's update of an element is about lr whatever its gradient's size, so a summation-order difference in a tiny
    # gradient moves it by a fraction of lr: allowed up to lr / 1000 (measured: 3e-6).
    for k in wf:
        diff = np.abs(wf[k].astype(np.float64) - wh[k].astype(np.float64)).max()
        assert diff <= 1e-2 / 1000, (k, diff)
    # Per step, HSDP's cross-node bytes are one all-reduce of rank 0's gradient slices (half the padded model each,
    # fp32, over 2 replicas: 2 x ceil(slice / 2) x 4 bytes, about 2 bytes x parameters with a little padding), so no
    # all-gather or reduce-scatter of the 2 micro-steps left the node; flat ZeRO-3 sends 3x as much across (measured:
    # every gather and reduce-scatter of each micro-step goes to 2 ranks of the other node).
    params = int(out_hsdp.split(" parameters, ")[0].rsplit(" ", 1)[1])
    for a, b in zip(flat, hsdp):
        assert 2 * params <= b["comm/bytes_inter_node"] <= 1.05 * 2 * params, (params, b)
        assert b["comm/bytes_intra_node"] > 0
        assert 2 * b["comm/bytes_inter_node"] <= a["comm/bytes_inter_node"], (a, b)


def test_grpo_refuses_nccl_sync_from_hybrid_layouts(setup):
    d = setup
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    for layout, name in ((["--sharding-strategy", "hybrid_shard"], "sharding_strategy hybrid_shard"),
                         (["--zero-hpz-partition-size", "2"], "zero_hpz_partition_size > 1")):
        p = subprocess.run([str((BUILD / "bin" / "tandem-train").resolve()), "--model", str(d / "model"),
                            "--train-file", str(d / "train.jsonl"), "--output-dir", str(d / "grpo"),
                            "--rollout-servers", "tcp://127.0.0.1:1", "--rewards", "regex_format",
                            "--weight-sync-transport", "nccl", *layout], env=env, capture_output=True, text=True,
                           timeout=60)
        assert p.returncode != 0 and f"weight_sync_transport: nccl from {name} is not built" in p.stderr, p.stderr


def run_2x2_grpo(d, tag, *layout):
    """GRPO on 2 nodes x 2 ranks, node 0's launcher starting the rollout server; weights synced every step."""
    port, ctl = free_port(), free_port()
    args = ["--train-file", str(d / "prompts.jsonl"), "--output-dir", str(d / tag), "--rewards", "regex_format",
            "--format-regex", "[0-9]", "--format-regex-mode", "search", "--num-generations", "4",
            "--per-device-train-batch-size", "4", "--max-completion-length", "6", "--max-steps", "3",
            "--logging-steps", "1", "--learning-rate", "2e-2", "--zero-stage", "3", "--seed", "3", "--save-steps", "0",
            "--init-timeout", "60", *layout]
    procs = [launcher(["--model", str(d / "model"), "--nnodes", "2", "--node-rank", str(n), "--ranks", "2",
                       "--servers", "1", "--control-insecure", "--master-addr", "127.0.0.1", "--master-port",
                       str(port), "--control-port", str(ctl), "--log-dir", str(d / f"{tag}{n}-logs"), "--", *args], d)
             for n in (0, 1)]
    out0, out1 = finish_nodes(procs, timeout=600)
    assert procs[0].returncode == 0 and procs[1].returncode == 0, out0 + "\n---- node 1 ----\n" + out1
    return out0, [json.loads(x) for x in (d / tag / "metrics.jsonl").read_text().splitlines()]


def test_grpo_hsdp_and_hpz_equal_flat(setup):
    """GRPO with HSDP and with hpZ: each step's weights reach the server whole (over ZeroMQ: node 0's ranks send
    HSDP's replica, every rank its hpZ master slice), so the completions of steps 2 and 3, sampled from the synced
    weights, and their rewards are those of flat ZeRO-3; losses and gradient norms agree within float tolerance."""
    from test_train_grpo import write_dataset
    d = setup
    write_dataset(d / "prompts.jsonl")
    _, flat = run_2x2_grpo(d, "grpo-flat")
    for tag, layout in (("grpo-hsdp", ["--sharding-strategy", "hybrid_shard"]),
                        ("grpo-hpz", ["--zero-hpz-partition-size", "2"])):
        out0, rows = run_2x2_grpo(d, tag, *layout)
        assert "weight sync over ZeroMQ" in out0, out0
        assert [r["policy_version"] for r in rows] == [1, 2, 3] and all(r["sync_bytes"] > 0 for r in rows), rows
        for a, b in zip(flat, rows):
            assert a["reward"] == b["reward"] and a["completions/mean_length"] == b["completions/mean_length"], (tag, a, b)
            for key in ("loss", "grad_norm"):
                assert abs(a[key] - b[key]) <= 1e-4 * max(1.0, abs(a[key])), (tag, key, a[key], b[key])


def test_hpz_equals_flat_zero3_and_sends_across_nodes_only_gradients_and_refreshes(setup):
    d = setup
    _, flat = run_2x2(d, "flat-for-hpz", "--sharding-strategy", "full_shard")
    out, hpz = run_2x2(d, "hpz", "--zero-hpz-partition-size", "2")
    assert "ZeRO-3 over 4 rank(s), parameters over the 2 of each node (hpZ)" in out, out
    for a, b in zip(flat, hpz):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a["loss"], b["loss"])
    wf = weights(d / "flat-for-hpz" / "checkpoint-4" / "model.safetensors")
    wh = weights(d / "hpz" / "checkpoint-4" / "model.safetensors")
    for k in wf:
        diff = np.abs(wf[k].astype(np.float64) - wh[k].astype(np.float64)).max()
        assert diff <= 1e-2 / 1000, (k, diff)
    # Per step and rank across nodes (fp32, N = 4 ranks, M = 2 nodes): 2 micro-steps x 4 B x P / 4 of gradient
    # reduce-scatter plus 4 B x P / 4 of refresh = 3 B x P, plus padding and the norm's one-float all-reduce.
    params = int(out.split(" parameters, ")[0].rsplit(" ", 1)[1])
    for a, b in zip(flat, hpz):
        assert 3 * params <= b["comm/bytes_inter_node"] <= 1.1 * 3 * params, (params, b)
        assert b["comm/bytes_inter_node"] < a["comm/bytes_inter_node"], (a, b)


def test_checkpoints_resume_under_another_cut(setup):
    """A checkpoint resumes under another cut (checkpoint_reslice.c maps each cut's slices to the ranks' files):
    flat ZeRO-3's under hpZ, HSDP's flat and hpZ's under HSDP, all on the same 2 x 2 ranks, continue as flat's
    checkpoint resumed flat does (losses within 1e-5 relative, weights within lr / 1000: the runs that wrote them agree
    that closely, test_hsdp_equals_flat and test_hpz_equals_flat)."""
    d = setup
    for tag, layout in (("flat-for-hpz", ("--sharding-strategy", "full_shard")), ("hpz", ("--zero-hpz-partition-size", "2")),
                        ("hsdp", ("--sharding-strategy", "hybrid_shard"))):
        if not (d / tag / "checkpoint-4").exists():
            run_2x2(d, tag, *layout)
    resumes = {"flat": ("flat-for-hpz", ("--sharding-strategy", "full_shard")),
               "flat-as-hpz": ("flat-for-hpz", ("--zero-hpz-partition-size", "2")),
               "hsdp-as-flat": ("hsdp", ("--sharding-strategy", "full_shard")),
               "hpz-as-hsdp": ("hpz", ("--sharding-strategy", "hybrid_shard"))}
    rows, outs = {}, {}
    for name, (written_by, layout) in resumes.items():
        outs[name], rows[name] = run_2x2(d, f"resume-{name}", *layout, "--max-steps", "5", "--resume",
                                         str(d / written_by / "checkpoint-4"))
        assert [r["step"] for r in rows[name]] == [5], rows[name]
    assert "cutting the ZeRO state full_shard; re-slicing it for 4 ranks cutting it hpz:2" in outs["flat-as-hpz"]
    assert "cutting the ZeRO state hybrid_shard:2; re-slicing it for 4 ranks cutting it full_shard" in outs["hsdp-as-flat"]
    ref = rows["flat"][0]["loss"]
    w_ref = weights(d / "resume-flat" / "checkpoint-5" / "model.safetensors")
    for name in ("flat-as-hpz", "hsdp-as-flat", "hpz-as-hsdp"):
        assert abs(rows[name][0]["loss"] - ref) <= 1e-5 * abs(ref), (name, rows[name][0]["loss"], ref)
        w = weights(d / f"resume-{name}" / "checkpoint-5" / "model.safetensors")
        for k in w_ref:
            diff = np.abs(w_ref[k].astype(np.float64) - w[k].astype(np.float64)).max()
            assert diff <= 1e-2 / 1000, (name, k, diff)


def test_layouts_are_checked(setup):
    d = setup
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    base = [str((BUILD / "bin" / "tandem-train").resolve()), "--mode", "sft", "--model", str(d / "model"),
            "--train-file", str(d / "train.jsonl"), "--output-dir", str(d / "checked")]
    for extra, want in ((["--zero-hpz-partition-size", "2", "--zero-stage", "2"], "needs zero_stage 3"),
                        (["--zero-hpz-partition-size", "2", "--sharding-strategy", "hybrid_shard"], "pick one"),
                        (["--zero-hpz-partition-size", "3"], "must be the number of ranks per node")):
        p = subprocess.run(base + extra, env=env, capture_output=True, text=True, timeout=60)
        assert p.returncode != 0 and want in p.stderr, (extra, p.stderr)


def test_one_node_hsdp_cuts_as_flat(setup):
    """On one node HSDP has no replicas: it cuts the state as flat ZeRO does, and its checkpoint says full_shard, so
    that a resume under either strategy is accepted."""
    d = setup
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    p = subprocess.run([str((BUILD / "bin" / "tandem-train").resolve()), "--mode", "sft", "--model", str(d / "model"),
                        "--train-file", str(d / "train.jsonl"), "--output-dir", str(d / "one-hsdp"),
                        "--per-device-train-batch-size", "2", "--max-steps", "1", "--sharding-strategy",
                        "hybrid_shard"], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    state = json.loads((d / "one-hsdp" / "checkpoint-1" / "trainer_state.json").read_text())
    assert state["zero_slicing"] == "full_shard", state
