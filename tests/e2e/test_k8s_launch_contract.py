"""The launch contract of the JobSet (k8s/base/jobset.yaml), run: the environment and the command line each trainer
pod of a two-node JobSet receives make `tandem-train launch` (CPU build) compute the same ranks and addresses as
the two-node stand-in (test_two_node_netns.py), and the run trains to the same metrics and weights, bit for bit,
as the same run on one node.

The JobSet is k8s/base sized to two nodes the way an overlay sizes it (a kustomization over k8s/base with JSON
patches: NNODES and the trainer Job's completions and parallelism 2). Its pods are built as the JobSet and Job
controllers and the kubelet build them (tests/e2e/k8s_pods.py): host names <jobset>-<job>-0-<index> in the JobSet's
subdomain, the jobset-name label and job-completion-index annotation that the env's fieldRefs read,
JOB_COMPLETION_INDEX, and $(VAR) expansion. Each trainer pod's launcher runs in one of the stand-in's two network
namespaces; the cluster DNS is stood in for by each namespace's /etc/hosts (`ip netns exec` mounts
/etc/netns/<ns>/hosts over it), which maps trainer pod i's name to node i's address and the rollout pod's name to
node 1's, where its server listens on every interface as in the rollout pod.

From the pod, unchanged: every launch option and every variable (NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT,
JOBSET_NAME, ROLLOUT_SERVERS, the NCCL ones), --rollout-servers and the control-key flags. Changed, because the
pod's files are not here: the volumes' paths (the model, /output, the keys) point at the stand-in's files; the
ConfigMap's grpo.json (a Qwen-sized run) is replaced by the stand-in's tiny GRPO options; OMP_NUM_THREADS and
OPENBLAS_NUM_THREADS are 1 as in the reference run (thread counts change the order of BLAS sums).
"""
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from k8s_pods import (K8S, container_argv, container_env, flag_value, pods_of, render_dir,  # noqa: E402
                      server_container, split_launch, the_jobset, trainer_container)
from server_fixtures import BUILD  # noqa: E402
from test_launch import LAUNCH_ENV, finish_nodes  # noqa: E402
from test_two_node_netns import (CONTROL_PORT, MASTER_PORT, NODE0_ADDR, NODE1_ADDR, assert_same_run,  # noqa: E402,F401
                                 in_namespace, namespaces, one_node, setup, start_server_in, training_args,
                                 wait_reachable)

TWO_NODES = """apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - {base}
patches:
  - target:
      group: jobset.x-k8s.io
      kind: JobSet
    patch: |-
      - op: test
        path: /spec/replicatedJobs/1/name
        value: trainer
      - op: replace
        path: /spec/replicatedJobs/1/template/spec/completions
        value: 2
      - op: replace
        path: /spec/replicatedJobs/1/template/spec/parallelism
        value: 2
      - op: test
        path: /spec/replicatedJobs/1/template/spec/template/spec/containers/0/env/3/name
        value: NNODES
      - op: replace
        path: /spec/replicatedJobs/1/template/spec/template/spec/containers/0/env/3/value
        value: "2"
"""


@pytest.fixture
def two_node_jobset(tmp_path):
    k = tmp_path / "two-nodes"
    k.mkdir()
    (k / "kustomization.yaml").write_text(TWO_NODES.format(base=os.path.relpath(K8S / "base", k)))
    js = the_jobset(render_dir(k, "k8s/base sized to two nodes"), "two-nodes")
    trainers, servers = pods_of(js, "trainer"), pods_of(js, "rollout")
    assert (len(trainers), len(servers)) == (2, 1)
    return trainers, servers


@pytest.fixture
def cluster_dns(namespaces):
    """Writes /etc/netns/<ns>/hosts for both namespaces (made by this test run, so the folders are its own); returns
    a function that sets the names in them. Removed afterwards."""
    parent = pathlib.Path("/etc/netns")
    parent_was_there = parent.exists()
    made = [parent / ns for ns in namespaces]
    try:
        for folder in made:
            folder.mkdir(parents=True, exist_ok=False)
    except OSError as e:
        pytest.skip(f"cannot make {folder} for the namespaces' /etc/hosts: {e}")

    def set_names(names):
        text = "127.0.0.1 localhost\n::1 localhost\n" + "".join(f"{addr} {name}\n" for name, addr in names.items())
        for folder in made:
            (folder / "hosts").write_text(text)

    try:
        yield set_names
    finally:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)
        if not parent_was_there:
            try:
                parent.rmdir()
            except OSError:
                pass   # something else put a folder there meanwhile


def on_stand_in(arg, volumes):
    """A path in the pod -> the stand-in's file behind the same volume."""
    for inside, here in volumes.items():
        if arg == inside or arg.startswith(inside + "/"):
            return str(here) + arg[len(inside):]
    return arg


def test_jobset_pods_launch_as_the_two_node_stand_in(namespaces, setup, one_node, two_node_jobset, cluster_dns):
    d, keys = setup
    trainers, servers = two_node_jobset
    ns_a, ns_b = namespaces
    cluster_dns({trainers[0]["fqdn"]: NODE0_ADDR, trainers[1]["fqdn"]: NODE1_ADDR, servers[0]["fqdn"]: NODE1_ADDR})
    # The rollout pod's server: its --control (every interface, port 5555), on node 1.
    control = flag_value(container_argv(servers[0], server_container(servers[0])), "--control")
    assert control == f"tcp://0.0.0.0:{CONTROL_PORT}", control
    server, server_log = start_server_in(ns_b, d, keys, control)
    out_dir, output_volume = d / "k8s-jobset", d / "k8s-output"
    try:
        # Node 0 reaches the server by the rollout pod's name.
        wait_reachable(ns_a, servers[0]["fqdn"], CONTROL_PORT, server)
        procs = []
        for pod, ns in zip(trainers, namespaces):
            c = trainer_container(pod)
            env = container_env(pod, c)
            volumes = {f"/data/models/{env['MODEL_NAME']}": d / "model", "/output": output_volume,
                       "/etc/tandem-control": keys}
            opts, _, train = split_launch(container_argv(pod, c))
            cut = train.index("--config")
            train = train[:cut] + train[cut + 2:]
            argv = [str((BUILD / "bin" / "tandem-train").resolve()), "launch"]
            for flag, value in opts.items():
                argv += [flag, on_stand_in(value, volumes)]
            argv += ["--", *[on_stand_in(a, volumes) for a in train], *training_args(d, out_dir)]
            penv = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
            penv.update(env)
            penv.update({"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
            procs.append(subprocess.Popen(in_namespace(ns, argv), cwd=d, env=penv, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        out0, out1 = finish_nodes(procs, timeout=300)
        assert procs[0].returncode == 0 and procs[1].returncode == 0, out0 + "\n---- node 1 ----\n" + out1
        assert server.poll() is None, (d / "netns-server.log").read_text()[-3000:]
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        server_log.close()
    master = f"{trainers[0]['fqdn']}:{MASTER_PORT}"
    # The stand-in's own lines (test_two_node_netns.run_two_nodes), with MASTER_ADDR the JobSet's name of pod 0.
    assert f"node 0 of 2: ranks 0..0 of WORLD_SIZE 2, MASTER_ADDR {master}" in out0, out0
    assert f"node 1 of 2: ranks 1..1 of WORLD_SIZE 2, MASTER_ADDR {master}" in out1, out1
    assert f"2 rank(s) joined (rendezvous at {master}" in out0, out0
    assert "weight sync over ZeroMQ" in out0, out0
    # Each node's launcher logs went to its own folder on the shared output volume.
    assert (output_volume / "launch-logs-node0").is_dir() and (output_volume / "launch-logs-node1").is_dir()
    assert_same_run(out_dir, one_node)
