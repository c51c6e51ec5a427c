"""Two nodes that are really two hosts to the network stack (issue 25, "Two-node stand-ins", CPU): two network
namespaces made by the test, joined by a veth pair, each with its own address and its own loopback, one node
(`tandem-train launch --nnodes 2`, 1 rank) in each; node 0's address is MASTER_ADDR. The rollout server runs in
the second namespace, bound to node 1's veth address only, or where launch itself puts it (node 0, every
interface; node 1's rank reaches it at MASTER_ADDR). A rank, launcher or server that binds 127.0.0.1 or hands a
peer a loopback endpoint cannot be reached from the other namespace, so the run fails here, where the older
two-node tests (both "nodes" on one host's loopback) pass.

The same GRPO run (2 ranks, 1 server, weight sync over ZeroMQ every step) on one node, with plain
`tandem-train launch`, must give the same metrics and the same final weights bit for bit: on the CPU the ranks
sum in a fixed order for a given world size, whichever node each is on, and the server's forward is
batch-invariant (test_train_grpo.py::test_grpo_cpu_is_reproducible_and_resume_exact).

Needs root and a kernel that lets it make network namespaces (a container without CAP_SYS_ADMIN does not): skipped,
naming the reason, otherwise.
"""
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from server_fixtures import BUILD, build_tiny_model, free_port  # noqa: E402
from test_launch import LAUNCH_ENV, finish_nodes, launcher  # noqa: E402
from test_train_grpo import _differing_keys, _metric_rows, grpo_args, write_dataset  # noqa: E402

import pytest  # noqa: E402

# A private range that exists only inside the test's two namespaces: no route to it leaves them.
NODE0_ADDR, NODE1_ADDR, PREFIX = "10.213.0.1", "10.213.0.2", 24
# The same in IPv6 (a unique local prefix), on the same veth pair.
NODE0_ADDR6, NODE1_ADDR6, PREFIX6 = "fd00:213::1", "fd00:213::2", 64
# Each namespace has its own port space, so fixed ports cannot collide with anything on the host.
MASTER_PORT, CONTROL_PORT = 29500, 5555
STEPS = 3


def ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def kill_namespace_processes(ns):
    """SIGKILL whatever still runs in ns: only this test's processes can be there, since it made ns."""
    listed = ip("netns", "pids", ns, check=False)
    for pid in listed.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def remove_stale_namespaces():
    """A test run killed outright (SIGKILL, SIGTERM: no finalizer runs) leaves its namespaces behind; they are named
    after its pid, so those of a pid that no longer runs are removed here, with what still runs inside them."""
    for line in ip("netns", "list", check=False).stdout.splitlines():
        m = re.match(r"(tandem-(\d+)-[ab])\b", line)
        if m and not os.path.exists(f"/proc/{m.group(2)}"):
            kill_namespace_processes(m.group(1))
            ip("netns", "del", m.group(1), check=False)


@pytest.fixture(scope="module")
def namespaces():
    """Two namespaces tandem-<pid>-a/b joined by a veth pair (NODE0_ADDR in a, NODE1_ADDR in b), lo up in both.
    Removed at the end whatever happened, with every process still inside them."""
    if os.geteuid() != 0:
        pytest.skip("making network namespaces needs root")
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (Debian package iproute2; scripts/setup.sh installs it)")
    remove_stale_namespaces()
    pid = os.getpid()
    ns_a, ns_b = f"tandem-{pid}-a", f"tandem-{pid}-b"
    veth_a, veth_b = f"tdm{pid}a", f"tdm{pid}b"   # interface names are at most 15 bytes
    made = []

    def remove():
        for ns in reversed(made):
            kill_namespace_processes(ns)
            ip("netns", "del", ns, check=False)   # takes the veth end inside it along
        ip("link", "del", veth_a, check=False)    # in case the pair was made but not yet moved

    try:
        first = ip("netns", "add", ns_a, check=False)
        if first.returncode != 0:
            pytest.skip(f"`ip netns add` failed (no CAP_SYS_ADMIN in this container?): {first.stderr.strip()}")
        made.append(ns_a)
        ip("netns", "add", ns_b)
        made.append(ns_b)
        ip("link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
        ip("link", "set", veth_a, "netns", ns_a)
        ip("link", "set", veth_b, "netns", ns_b)
        for ns, veth, addr, addr6 in ((ns_a, veth_a, NODE0_ADDR, NODE0_ADDR6), (ns_b, veth_b, NODE1_ADDR, NODE1_ADDR6)):
            ip("-n", ns, "addr", "add", f"{addr}/{PREFIX}", "dev", veth)
            # nodad: usable at once, without the second or so of duplicate address detection.
            ip("-n", ns, "addr", "add", f"{addr6}/{PREFIX6}", "dev", veth, "nodad")
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "link", "set", veth, "up")
    except subprocess.CalledProcessError as e:
        remove()
        pytest.fail(f"setting up the namespaces failed: {e.cmd}: {e.stderr}")
    except BaseException:
        remove()
        raise
    try:
        yield ns_a, ns_b
    finally:
        remove()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("netns")
    build_tiny_model(d / "model")
    write_dataset(d / "train.jsonl")
    keys = d / "keys"
    made = subprocess.run([str((BUILD / "bin" / "tandem-train").resolve()), "keygen", "--force", str(keys)],
                          capture_output=True, text=True, timeout=30)
    assert made.returncode == 0, made.stderr
    return d, keys


def training_args(d, out_dir, control=None, *extra):
    """grpo_args less its --model (launch gives it) and, for launch's own servers (control None), less its
    --rollout-servers (launch gives those too); extra after them."""
    args = grpo_args(d / "model", d / "train.jsonl", out_dir, control or "", STEPS,
                     extra=["--weight-sync-steps", "1"])
    drop = {"--model"} | ({"--rollout-servers"} if control is None else set())
    kept = []
    for i, a in enumerate(args):
        if a in drop or (i > 0 and args[i - 1] in drop):
            continue
        kept.append(a)
    return kept + list(extra)


def launch_in(ns, args, cwd):
    """`tandem-train launch ARGS` inside ns, with launcher()'s environment (one thread per process)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env.update({"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
    return subprocess.Popen(in_namespace(ns, [str((BUILD / "bin" / "tandem-train").resolve()), "launch", *args]),
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def in_namespace(ns, argv):
    return ["ip", "netns", "exec", ns, *argv]


def start_server_in(ns, d, keys, control):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env.update({"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})   # what the one-node launch gives its server
    log = open(d / "netns-server.log", "w")
    proc = subprocess.Popen(in_namespace(ns, [str((BUILD / "bin" / "tandem-serve").resolve()),
                                              "--model", str(d / "model"), "--control", control, "--port", "0",
                                              "--device", "cpu", "--control-key-file", str(keys / "server.key"),
                                              "--control-authorized-keys", str(keys / "authorized_keys")]),
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, log


def reachable(ns, host, port):
    """Whether a TCP connection from inside ns to host:port is accepted."""
    probe = ("import socket, sys\ns = socket.socket(); s.settimeout(2)\n"
             f"sys.exit(s.connect_ex(({host!r}, {port})))")
    return subprocess.run(in_namespace(ns, [sys.executable, "-c", probe]), timeout=30).returncode == 0


def wait_reachable(ns, host, port, server, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.poll() is None, "the rollout server exited"
        if reachable(ns, host, port):
            return
        time.sleep(0.2)
    raise AssertionError(f"{host}:{port} not reachable from {ns} within {timeout} s")


@pytest.fixture(scope="module")
def one_node(setup):
    """The reference: the same run on one node with plain `tandem-train launch` (2 ranks, its own server on
    loopback), in the host's namespace."""
    d, _ = setup
    one = launcher(["--model", str(d / "model"), "--ranks", "2", "--servers", "1", "--master-port", str(free_port()),
                    "--control-port", str(free_port()), "--log-dir", str(d / "one-node-logs"), "--",
                    *training_args(d, d / "one-node")], d)
    out_one, = finish_nodes([one], timeout=300)
    assert one.returncode == 0, out_one
    return d / "one-node"


def run_two_nodes(namespaces, d, tag, node_args, train_extra=(), master_addr=NODE0_ADDR):
    """`tandem-train launch --nnodes 2` in each namespace (node 0 in the first, MASTER_ADDR its veth address);
    returns both nodes' output after checking that both finished."""
    procs = [launch_in(ns, ["--model", str(d / "model"), "--nnodes", "2", "--node-rank", str(n), "--ranks", "1",
                            "--master-addr", master_addr, "--master-port", str(MASTER_PORT),
                            "--log-dir", str(d / f"{tag}{n}-logs"), *node_args, "--",
                            *training_args(d, d / tag, *train_extra)], d)
             for n, ns in enumerate(namespaces)]
    out0, out1 = finish_nodes(procs, timeout=300)
    assert procs[0].returncode == 0 and procs[1].returncode == 0, out0 + "\n---- node 1 ----\n" + out1
    assert f"node 1 of 2: ranks 1..1 of WORLD_SIZE 2, MASTER_ADDR {master_addr}:{MASTER_PORT}" in out1, out1
    assert f"2 rank(s) joined (rendezvous at {master_addr}:{MASTER_PORT}" in out0, out0
    assert "weight sync over ZeroMQ" in out0, out0
    return out0, out1


def assert_same_run(two_nodes_dir, one_node_dir):
    two_rows, one_rows = _metric_rows(two_nodes_dir), _metric_rows(one_node_dir)
    assert sorted(two_rows) == sorted(one_rows) == list(range(1, STEPS + 1))
    for step in two_rows:
        # Only a run on several nodes counts the bytes its collectives sent inside and across the node boundary.
        assert two_rows[step]["comm/bytes_inter_node"] > 0 and "comm/bytes_inter_node" not in one_rows[step]
        differing = [k for k in _differing_keys(two_rows[step], one_rows[step]) if not k.startswith("comm/bytes_")]
        assert not differing, (step, {k: (two_rows[step].get(k), one_rows[step].get(k)) for k in differing})
    # Every step pushed the weights to the server, and training moved them (a loss that never changes would make
    # the comparison empty).
    assert all(two_rows[s]["sync_bytes"] > 0 for s in two_rows), two_rows
    assert len({two_rows[s]["loss"] for s in two_rows}) > 1, two_rows
    final = [(run / f"checkpoint-{STEPS}" / "model.safetensors").read_bytes() for run in (two_nodes_dir, one_node_dir)]
    assert final[0] == final[1]


def test_server_on_node_1_equals_one_node(namespaces, setup, one_node):
    """The server in the second namespace, bound to node 1's veth address only; both nodes' ranks reach it there."""
    ns_a, ns_b = namespaces
    d, keys = setup
    control = f"tcp://{NODE1_ADDR}:{CONTROL_PORT}"
    server, server_log = start_server_in(ns_b, d, keys, control)
    try:
        wait_reachable(ns_a, NODE1_ADDR, CONTROL_PORT, server)
        # The namespaces are separate hosts to TCP: node 0's loopback does not lead to node 1's server.
        assert not reachable(ns_a, "127.0.0.1", CONTROL_PORT)
        run_two_nodes(namespaces, d, "server-on-node1", ["--servers", "0"],
                      [control, "--control-server-key", str(keys / "server.pub"),
                       "--control-client-key", str(keys / "client.key")])
        assert server.poll() is None, (d / "netns-server.log").read_text()[-3000:]
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        server_log.close()
    assert_same_run(d / "server-on-node1", one_node)


def test_launch_server_on_node_0_equals_one_node(namespaces, setup, one_node):
    """launch's own placement: the server on node 0, listening on every interface there; node 0's rank reaches it on
    loopback, node 1's at MASTER_ADDR over the veth."""
    d, keys = setup
    out0, out1 = run_two_nodes(namespaces, d, "server-on-node0",
                               ["--servers", "1", "--control-port", str(CONTROL_PORT), "--control-keys", str(keys)])
    assert "rollout server 0" in out0 and "rollout server" not in out1, out0 + out1
    assert_same_run(d / "server-on-node0", one_node)


def test_ipv6_master_addr_equals_one_node(namespaces, setup, one_node):
    """MASTER_ADDR an IPv6 literal (the nodes have no IPv4 route to each other's data endpoints in use then: each
    publishes the address of the interface that routes to MASTER_ADDR, an IPv6 one); launch's server on node 0."""
    d, keys = setup
    out0, out1 = run_two_nodes(namespaces, d, "ipv6",
                               ["--servers", "1", "--control-port", str(CONTROL_PORT), "--control-keys", str(keys)],
                               master_addr=NODE0_ADDR6)
    assert "rollout server 0 (pid " in out0 and f") on tcp://[::]:{CONTROL_PORT}," in out0, out0
    assert_same_run(d / "ipv6", one_node)
