"""Launcher conventions end to end: tandem-train ranks started by torchrun (--no-python) and by Kubeflow
PyTorchJob's per-pod variables (PET_NNODES, PET_NODE_RANK, PET_NPROC_PER_NODE, PET_MASTER_ADDR, PET_MASTER_PORT
beside RANK = the pod's index, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) join one run of 2 CPU ranks, and train
exactly as the same run started by `tandem-train launch --ranks 2` (same world, same reduction order: the losses
are equal bit for bit).

torchrun's agent listens on MASTER_PORT itself (the TCPStore its workers may share), so tandem's rendezvous takes
MASTER_PORT + 1 under torchrun (comm.h, comm_rendezvous_port_from_env); the ranks' log line says which port and
why. Contradictory variables are errors naming both variables and their values.
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from server_fixtures import BUILD, build_tiny_model, free_port  # noqa: E402
from test_launch import LAUNCH_ENV, finish_nodes, launcher  # noqa: E402
from test_train_sft_resume import write_sft  # noqa: E402

TORCHRUN = pathlib.Path(sys.executable).parent / "torchrun"
PET_ENV = ("PET_NNODES", "PET_NODE_RANK", "PET_NPROC_PER_NODE", "PET_MASTER_ADDR", "PET_MASTER_PORT",
           "TANDEM_RENDEZVOUS_PORT")


def clean_env(extra=None):
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_ENV and k not in PET_ENV and not k.startswith("TORCHELASTIC_")}
    env.update({"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", **(extra or {})})
    return env


def train_args(d, out, model=True):
    return ["--mode", "sft", *(["--model", str(d / "model")] if model else []), "--train-file", str(d / "train.jsonl"), "--output-dir",
            str(d / out), "--per-device-train-batch-size", "2", "--gradient-accumulation-steps", "2",
            "--learning-rate", "1e-2", "--max-steps", "3", "--save-steps", "0", "--logging-steps", "1",
            "--zero-stage", "3", "--seed", "5", "--init-timeout", "60"]


def losses(out_dir):
    return [r["loss"] for r in map(json.loads, (out_dir / "metrics.jsonl").read_text().splitlines())]


def tandem_train():
    exe = (BUILD / "bin" / "tandem-train").resolve()
    if not exe.exists():
        pytest.skip(f"{exe} is not built")
    return str(exe)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("conventions")
    build_tiny_model(d / "model")
    write_sft(d / "train.jsonl", n=32)
    # The reference: the same 2 ranks started by tandem-train launch.
    tandem_train()
    port = free_port()
    p = launcher(["--model", str(d / "model"), "--ranks", "2", "--servers", "0", "--master-port", str(port),
                  "--log-dir", str(d / "ref-logs"), "--", *train_args(d, "ref", model=False)], d)
    out, = finish_nodes([p], timeout=600)
    assert p.returncode == 0, out
    return d, losses(d / "ref")


def run_all(cmds, d, timeout=600):
    procs = [subprocess.Popen(cmd, cwd=d, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd, env in cmds]
    outs = finish_nodes(procs, timeout=timeout)
    for p, out in zip(procs, outs):
        assert p.returncode == 0, "\n----\n".join(outs)
    return outs


def torchrun():
    if not TORCHRUN.exists():
        pytest.skip(f"{TORCHRUN} is not installed (the reference venv's torch)")
    return str(TORCHRUN)


@pytest.mark.parametrize("rdzv", ["static", "standalone"])
def test_torchrun_one_node_of_two_ranks(setup, rdzv):
    """torchrun --no-python --nproc-per-node 2, with a fixed --master-port (static rendezvous: its agent's TCPStore
    binds MASTER_PORT) or --standalone (c10d on a port of the kernel's, which becomes MASTER_PORT): the ranks
    rendezvous on MASTER_PORT + 1 and train as tandem-train launch's ranks do."""
    d, ref = setup
    port = free_port(2)
    where = (["--master-addr", "127.0.0.1", "--master-port", str(port)] if rdzv == "static" else ["--standalone"])
    out, = run_all([([torchrun(), "--nnodes", "1", "--nproc-per-node", "2", *where, "--no-python", tandem_train(),
                      *train_args(d, f"torchrun1-{rdzv}")], clean_env())], d)
    said = "port from MASTER_PORT+1 (torchrun's agent holds MASTER_PORT)"
    assert said in out and (rdzv != "static" or f"rendezvous at 127.0.0.1:{port + 1}, {said}" in out), out
    assert losses(d / f"torchrun1-{rdzv}") == ref


def test_torchrun_two_nodes(setup):
    """Two torchrun agents, --nnodes 2 --node-rank 0/1, one rank each: GROUP_RANK gives each rank its node (the node
    map says 2 nodes), and the run is the reference run."""
    d, ref = setup
    port = free_port(2)
    cmds = [([torchrun(), "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "1", "--master-addr",
              "127.0.0.1", "--master-port", str(port), "--no-python", tandem_train(), *train_args(d, "torchrun2")],
             clean_env()) for n in (0, 1)]
    out0, _ = run_all(cmds, d)
    assert "node map (2 nodes of 1 rank" in out0, out0
    assert losses(d / "torchrun2") == ref


def pod_env(n, port, nproc):
    """What the Kubeflow training operator gives pod n of a 2-pod PyTorchJob (RANK is the pod's index)."""
    return {"RANK": str(n), "WORLD_SIZE": str(2 * nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "PET_NNODES": "2", "PET_NODE_RANK": str(n), "PET_NPROC_PER_NODE": str(nproc),
            "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port)}


def test_pytorchjob_pods_of_one_rank(setup):
    """Two 'pods' whose tandem-train reads the operator's variables directly (one rank per pod)."""
    d, ref = setup
    port = free_port()
    cmds = [([tandem_train(), *train_args(d, "pet1")], clean_env(pod_env(n, port, 1))) for n in (0, 1)]
    out0, _ = run_all(cmds, d)
    assert f"rendezvous at 127.0.0.1:{port}, port from MASTER_PORT)" in out0, out0
    assert losses(d / "pet1") == ref


def test_pytorchjob_pods_through_launch(setup):
    """Two 'pods' running tandem-train launch with no node flags: it takes --nnodes, --node-rank, --ranks,
    --master-addr and --master-port from PET_*, so the run is the reference run."""
    d, ref = setup
    port = free_port()
    exe = tandem_train()
    cmds = [([exe, "launch", "--model", str(d / "model"), "--servers", "0", "--log-dir", str(d / f"pet-launch{n}"),
              "--", *train_args(d, "pet-launch", model=False)], clean_env(pod_env(n, port, 1))) for n in (0, 1)]
    out0, _ = run_all(cmds, d)
    assert "node 0 of 2: ranks 0..0 of WORLD_SIZE 2" in out0, out0
    assert losses(d / "pet-launch") == ref


@pytest.mark.parametrize("env, want", [
    # WORLD_SIZE is not the pods x ranks per pod.
    ({"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "PET_NNODES": "2", "PET_NPROC_PER_NODE": "2"},
     ["WORLD_SIZE 3", "PET_NNODES=2 x PET_NPROC_PER_NODE=2"]),
    # RANK outside WORLD_SIZE.
    ({"RANK": "2", "WORLD_SIZE": "2", "PET_NNODES": "2", "PET_NPROC_PER_NODE": "1"}, ["RANK 2", "WORLD_SIZE 2"]),
    # Our node index and torchrun's disagree; ours and PyTorchJob's.
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "NODE_RANK": "1", "GROUP_RANK": "0"},
     ["NODE_RANK=1", "GROUP_RANK=0"]),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "NODE_RANK": "1", "PET_NODE_RANK": "0"},
     ["NODE_RANK=1", "PET_NODE_RANK=0"]),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1234", "PET_MASTER_PORT": "1235"},
     ["MASTER_PORT=1234", "PET_MASTER_PORT=1235"]),
    # A pod of 2 ranks whose only process was started as one rank (no launcher).
    ({"RANK": "0", "WORLD_SIZE": "4", "PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_NPROC_PER_NODE": "2"},
     ["PET_NPROC_PER_NODE=2 asks for 2 ranks in this pod", "tandem-train launch"]),
])
def test_contradictions_are_named(setup, env, want):
    d, _ = setup
    p = subprocess.run([tandem_train(), *train_args(d, "refused")], cwd=d, env=clean_env(env), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode != 0 and all(w in p.stderr for w in want), (env, p.stderr)


def test_launch_names_contradictions(setup):
    d, _ = setup
    for env, want in (({"NNODES": "2", "PET_NNODES": "3"}, "NNODES='2' and PET_NNODES='3' disagree"),
                      ({"MASTER_ADDR": "a", "PET_MASTER_ADDR": "b"}, "MASTER_ADDR='a' and PET_MASTER_ADDR='b' disagree"),
                      ({"NODE_RANK": "0", "PET_NODE_RANK": "1", "NNODES": "2"},
                       "NODE_RANK='0' and PET_NODE_RANK='1' disagree")):
        p = subprocess.run([tandem_train(), "launch", "--model", str(d / "model"), "--servers", "0", "--log-dir",
                            str(d / "refused-logs"), "--", *train_args(d, "refused", model=False)], cwd=d,
                           env=clean_env(env), capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and want in p.stderr, (env, p.stderr)
