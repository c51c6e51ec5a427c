"""`tandem-train launch`: servers and ranks from one command; a failing process stops everything, naming it;
Ctrl-C stops everything; no process outlives the launcher. Several nodes: one launcher per "node" (here all on
localhost), node rank from the flag or the environment (NODE_RANK, JOB_COMPLETION_INDEX), servers started by node 0
or external ones."""
import json
import os
import pathlib
import signal
import stat
import subprocess
import sys
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from server_fixtures import BUILD, TandemServer, build_tiny_model  # noqa: E402
from test_train_grpo import free_port, write_dataset  # noqa: E402


# What the launcher reads from the environment; cleared so that the caller's shell cannot change a test.
LAUNCH_ENV = ("NNODES", "NODE_RANK", "JOB_COMPLETION_INDEX", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
              "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")


def launcher(args, cwd, env_extra=None, **kw):
    exe = (BUILD / "bin" / "tandem-train").resolve()
    if not exe.exists():
        pytest.skip(f"{exe} is not built")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env.update({"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", **(env_extra or {})})
    return subprocess.Popen([str(exe), "launch", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


def pids_in(text):
    out = []
    for line in text.splitlines():
        if "(pid " in line:
            out.append(int(line.split("(pid ")[1].split(")")[0]))
    return out


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes.
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("launch")
    build_tiny_model(d / "model")
    write_dataset(d / "train.jsonl")
    return d


def train_args(d, out, steps):
    return ["--train-file", str(d / "train.jsonl"), "--output-dir", str(d / out), "--rewards", "regex_format",
            "--format-regex", "[0-9]", "--format-regex-mode", "search", "--num-generations", "8",
            "--per-device-train-batch-size", "8", "--max-completion-length", "8", "--max-steps", str(steps),
            "--logging-steps", "1", "--learning-rate", "2e-2"]


def common(d, out, steps):
    return ["--model", str(d / "model"), "--ranks", "2", "--servers", "1", "--master-port", str(free_port()),
            "--control-port", str(free_port()), "--log-dir", str(d / f"{out}-logs"), "--", *train_args(d, out, steps)]


def finish_nodes(procs, timeout=300):
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append(out)
    return outs


def test_launch_runs_servers_and_ranks(setup):
    d = setup
    p = launcher(common(d, "ok", 3), d)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    assert "every rank finished; servers stopped" in out
    rows = [json.loads(x) for x in (d / "ok" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert not any(alive(pid) for pid in pids_in(out))
    # Out of the box the control channel is authenticated: fresh keys for the run, readable by its owner only.
    keys = d / "ok-logs" / "control-keys"
    assert f"control channel authenticated with fresh CURVE keys in {keys}" in out
    for name in ("server.key", "server.pub", "client.key", "authorized_keys"):
        assert stat.S_IMODE(os.stat(keys / name).st_mode) == 0o600, name
    assert "CURVE: server public key" in (d / "ok-logs" / "server0.log").read_text()


def test_one_node_without_keys_when_asked(setup):
    """--control-insecure on one node: no key folder, the server on loopback without CURVE, the run trains."""
    d = setup
    args = common(d, "insecure", 1)
    args[args.index("--ranks") + 1] = "1"
    args.insert(args.index("--"), "--control-insecure")
    p = launcher(args, d)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    assert not (d / "insecure-logs" / "control-keys").exists()
    assert "no keys: only this machine can reach it" in (d / "insecure-logs" / "server0.log").read_text()


def test_a_failing_rank_stops_everything(setup):
    d = setup
    args = common(d, "bad", 3)
    args[args.index("--train-file") + 1] = str(d / "missing.jsonl")
    p = launcher(args, d)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 1, out
    assert "exited with code 1" in out and "stopping the others" in out and "missing.jsonl" in out
    time.sleep(0.5)
    assert not any(alive(pid) for pid in pids_in(out)), out


def test_ctrl_c_stops_everything(setup):
    d = setup
    p = launcher(common(d, "interrupted", 100000), d)
    deadline = time.time() + 120
    seen = ""
    while time.time() < deadline and "step 2/" not in seen:
        line = p.stdout.readline()
        seen += line
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=120)
    seen += out
    assert p.returncode == 130, seen[-3000:]
    assert "interrupted (Ctrl-C)" in seen
    time.sleep(0.5)
    assert not any(alive(pid) for pid in pids_in(seen)), seen[-3000:]


def test_two_nodes_on_localhost(setup):
    """The same command on two "nodes" (1 rank each): node 0 starts the server, node 1's rank reaches it through
    --master-addr; RANK and WORLD_SIZE come from --nnodes/--node-rank, and the run trains to its last step. The
    server listens on every interface, so both nodes share one key folder (tandem-train keygen, --control-keys)."""
    d = setup
    keys = d / "nodes-keys"
    made = subprocess.run([str((BUILD / "bin" / "tandem-train").resolve()), "keygen", "--force", str(keys)],
                          capture_output=True, text=True, timeout=30)
    assert made.returncode == 0, made.stderr
    port, ctl = free_port(), free_port()
    procs = [launcher(["--model", str(d / "model"), "--nnodes", "2", "--node-rank", str(n), "--ranks", "1",
                       "--master-addr", "127.0.0.1", "--master-port", str(port), "--control-port", str(ctl),
                       "--control-keys", str(keys), "--log-dir", str(d / f"nodes{n}-logs"), "--",
                       *train_args(d, f"nodes{n}", 3)], d)
             for n in (0, 1)]
    out0, out1 = finish_nodes(procs)
    assert f"control channel authenticated with the CURVE keys in {keys}" in out0 + out1
    assert procs[0].returncode == 0, out0 + "\n---- node 1 ----\n" + out1
    assert procs[1].returncode == 0, out1 + "\n---- node 0 ----\n" + out0
    assert "node 0 of 2: ranks 0..0 of WORLD_SIZE 2" in out0 and "rollout server 0" in out0
    assert "node 1 of 2: ranks 1..1 of WORLD_SIZE 2" in out1 and "rollout server" not in out1
    assert "2 rank(s) joined" in out0
    assert "every rank of node 0 finished; servers stopped" in out0
    assert "every rank of node 1 finished" in out1
    rows = [json.loads(x) for x in (d / "nodes0" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert not (d / "nodes1" / "metrics.jsonl").exists()  # only rank 0 writes
    assert not any(alive(pid) for pid in pids_in(out0 + out1))


def test_two_nodes_from_the_environment_with_external_servers(setup):
    """What a Kubernetes indexed Job gives: NNODES, the node rank from JOB_COMPLETION_INDEX, MASTER_ADDR as a host
    name, and rollout servers of their own (--servers 0, --rollout-servers after --)."""
    d = setup
    ctl = free_port()
    with TandemServer(d / "model", "--control", f"tcp://127.0.0.1:{ctl}") as srv:
        port = free_port()
        procs = [launcher(["--model", str(d / "model"), "--ranks", "1", "--servers", "0",
                           "--log-dir", str(d / f"env{n}-logs"), "--", *train_args(d, f"env{n}", 2),
                           "--rollout-servers", f"tcp://127.0.0.1:{ctl}"], d,
                          env_extra={"NNODES": "2", "JOB_COMPLETION_INDEX": str(n), "MASTER_ADDR": "localhost",
                                     "MASTER_PORT": str(port)})
                 for n in (0, 1)]
        out0, out1 = finish_nodes(procs)
        assert srv.alive()
    assert procs[0].returncode == 0 and procs[1].returncode == 0, out0 + "\n---- node 1 ----\n" + out1
    assert f"node 1 of 2: ranks 1..1 of WORLD_SIZE 2, MASTER_ADDR localhost:{port}" in out1
    rows = [json.loads(x) for x in (d / "env0" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]


def test_node_options_are_checked(setup):
    d = setup

    def run(args, env=None):
        p = launcher(["--model", str(d / "model"), "--log-dir", str(d / "check-logs"), *args], d, env_extra=env)
        out, _ = p.communicate(timeout=60)
        return p.returncode, out

    code, out = run(["--nnodes", "2", "--node-rank", "2"])
    assert code == 2 and "--node-rank '2' must be an integer in 0..1" in out
    # NODE_RANK wins over JOB_COMPLETION_INDEX, and the error names the variable it read.
    code, out = run([], {"NNODES": "2", "NODE_RANK": "7", "JOB_COMPLETION_INDEX": "0"})
    assert code == 2 and "NODE_RANK '7'" in out
    code, out = run(["--nnodes", "zero"])
    assert code == 2 and "--nnodes 'zero'" in out
    code, out = run(["--nnodes", "2", "--master-addr", "tandem-nowhere.invalid", "--dns-timeout", "1",
                     "--control-insecure"])
    assert code == 1 and "MASTER_ADDR tandem-nowhere.invalid does not resolve" in out
    # Servers on every interface of node 0 need keys shared by every node, or an explicit opt-out.
    code, out = run(["--nnodes", "2", "--master-addr", "tandem-nowhere.invalid", "--dns-timeout", "1"])
    assert code == 2 and "--control-keys DIR" in out and "tandem-train keygen" in out, out
    code, out = run(["--control-keys", str(d / "no-such-keys")])
    assert code == 1 and "no-such-keys/server.key" in out, out


def test_two_servers_with_a_device_each(setup):
    """--server-device takes one entry per server; the rank spreads its prompts over both servers."""
    d = setup
    p = launcher(["--model", str(d / "model"), "--ranks", "1", "--servers", "2", "--server-device", "cpu,cpu",
                  "--master-port", str(free_port()), "--control-port", str(free_port(2)), "--log-dir",
                  str(d / "two-logs"), "--", *train_args(d, "two", 2)], d)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    assert out.count("device cpu, log") == 2, out
    rows = [json.loads(x) for x in (d / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]


def launched_children(launcher_pid):
    """{pid: argv} of the launcher's children that have exec'd tandem-serve or a tandem-train rank."""
    out = {}
    for task in pathlib.Path(f"/proc/{launcher_pid}/task").glob("*"):
        try:
            pids = (task / "children").read_text().split()
        except OSError:
            continue
        for pid in map(int, pids):
            try:
                argv = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            prog = argv[0].decode()
            if prog.endswith("tandem-serve") or (prog.endswith("tandem-train") and argv[1:2] != [b"launch"]):
                out[pid] = [a.decode() for a in argv if a]
    return out


def environ_of(pid):
    raw = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(x.decode().split("=", 1) for x in raw if b"=" in x)


@pytest.mark.parametrize("user_env", [{}, {"OMP_NUM_THREADS": "3"}], ids=["shared-out", "user-set-omp"])
def test_each_process_gets_a_share_of_the_cores(setup, user_env):
    """On the CPU each server and rank gets OPENBLAS_NUM_THREADS and OMP_NUM_THREADS = cores / processes (at least
    1), so that 1 + R processes do not each start a pool as wide as the machine; a variable the user set is passed
    on as it is. The start-up line says what was chosen."""
    d = setup
    out_name = "threads-" + ("user" if user_env else "auto")
    exe = (BUILD / "bin" / "tandem-train").resolve()
    if not exe.exists():
        pytest.skip(f"{exe} is not built")
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_ENV and k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    env.update(user_env)
    p = subprocess.Popen([str(exe), "launch", *common(d, out_name, 2)], cwd=d, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    seen = {}
    deadline = time.time() + 120
    while time.time() < deadline and len(seen) < 3 and p.poll() is None:
        for pid, argv in launched_children(p.pid).items():
            if pid not in seen:
                try:
                    seen[pid] = (argv[0], environ_of(pid))
                except OSError:
                    pass
        time.sleep(0.05)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    assert len(seen) == 3, (seen, out)  # 1 server + 2 ranks
    share = str(max(1, len(os.sched_getaffinity(0)) // 3))
    want_omp = user_env.get("OMP_NUM_THREADS", share)
    for prog, child_env in seen.values():
        assert child_env.get("OPENBLAS_NUM_THREADS") == share, (prog, share, child_env.get("OPENBLAS_NUM_THREADS"))
        assert child_env.get("OMP_NUM_THREADS") == want_omp, (prog, want_omp, child_env.get("OMP_NUM_THREADS"))
    cores = len(os.sched_getaffinity(0))
    line = f"{cores} CPU core(s) for 3 process(es) here; each runs with OPENBLAS_NUM_THREADS={share}, "
    line += "OMP_NUM_THREADS=3 (yours)" if user_env else f"OMP_NUM_THREADS={share}"
    assert line in out, out


def test_help_and_version(setup):
    exe = (BUILD / "bin" / "tandem-train").resolve()
    if not exe.exists():
        pytest.skip(f"{exe} is not built")
    for args in (["--version"], ["launch", "--version"], ["eval", "--version"], ["--model", "x", "--version"]):
        p = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=30)
        assert p.returncode == 0 and p.stdout.startswith("tandem-train 0.") and "CUDA backend" in p.stdout, (args, p)
    for sub in ([], ["launch"], ["eval"]):
        short = subprocess.run([str(exe), *sub, "-h"], capture_output=True, text=True, timeout=30)
        long = subprocess.run([str(exe), *sub, "--help"], capture_output=True, text=True, timeout=30)
        assert short.returncode == 0 and short.stdout == long.stdout and "usage:" in short.stdout, sub
        # Every default as a person writes it: no 6e+01 for 60 seconds.
        assert "e+0" not in short.stdout, [x for x in short.stdout.splitlines() if "e+0" in x]
        assert "--version" in short.stdout, sub
    top = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=30).stdout
    assert "--reward-timeout FLOAT  (default: 60)" in top and "--init-timeout FLOAT  (default: 300)" in top


def write_bad_config(path):
    path.write_text(json.dumps({"seed": "forty-two"}))
    return ["--config", str(path)]


@pytest.mark.parametrize("case", ["misspelled-flag", "bad-config-type", "rendezvous-port-in-use", "no-tokenizer"])
def test_an_early_rank_error_ends_launch_at_once(setup, case):
    """A rank that fails at start (a misspelled flag after --, a config value of the wrong type, a rendezvous port
    another process holds, a model folder without tokenizer.json) ends launch within seconds, non-zero, with the
    rank's error shown. The servers are still starting then: a SIGTERM they get during start-up must not be lost
    (it used to be, whenever an OpenBLAS pool thread took it: launch then waited its 30 s grace before SIGKILL).
    OPENBLAS_NUM_THREADS=2 gives the servers such a pool, as a machine with more cores does by default."""
    d = setup
    model, ranks, extra, expect = d / "model", 1, [], []
    held = None
    master_port = free_port()
    if case == "misspelled-flag":
        extra, expect = ["--learnig-rate", "1e-5"], ["unknown flag --learnig-rate (did you mean --learning-rate?)"]
    elif case == "bad-config-type":
        extra, expect = write_bad_config(d / "bad-config.json"), ["bad-config.json: seed: expected an integer"]
    elif case == "rendezvous-port-in-use":
        import socket
        held = socket.socket()
        held.bind(("127.0.0.1", master_port))
        held.listen(1)
        ranks, expect = 2, [f"cannot bind tcp://127.0.0.1:{master_port}", "Address already in use"]
    else:
        model = d / "model-without-tokenizer"
        if not model.exists():
            import shutil
            shutil.copytree(d / "model", model)
            (model / "tokenizer.json").unlink()
        expect = ["tokenizer.json: cannot read"]
    out_name = f"early-{case}"
    args = ["--model", str(model), "--ranks", str(ranks), "--servers", "1", "--master-port", str(master_port),
            "--control-port", str(free_port()), "--log-dir", str(d / f"{out_name}-logs"), "--",
            *train_args(d, out_name, 3), *extra]
    try:
        t0 = time.time()
        p = launcher(args, d, env_extra={"OMP_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": "2"})
        out, _ = p.communicate(timeout=120)
        elapsed = time.time() - t0
    finally:
        if held:
            held.close()
    assert p.returncode not in (0, None), out
    for text in expect:
        assert text in out, out
    assert "stopping the others" in out, out
    assert elapsed < 10, f"launch took {elapsed:.1f} s to stop after the rank's error:\n{out}"
    time.sleep(0.5)
    assert not any(alive(pid) for pid in pids_in(out)), out


def test_grpo_with_a_tensor_parallel_server(setup):
    """--server-tp 2: the launcher starts the server with --tensor-parallel-size 2 (two CPU shards); GRPO steps with
    a weight sync after each complete against it, and the server took every update (its policy version is the
    step count when training ends)."""
    d = setup
    p = launcher(["--model", str(d / "model"), "--ranks", "1", "--servers", "1", "--server-tp", "2",
                  "--master-port", str(free_port()), "--control-port", str(free_port()), "--log-dir",
                  str(d / "tp-logs"), "--", *train_args(d, "tp", 3)], d)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    log = (d / "tp-logs" / "server0.log").read_text()
    assert "tensor parallel 2 (CPU shards)" in log and "2 tensor-parallel shards, on each" in log, log
    rows = [json.loads(x) for x in (d / "tp" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["policy_version"] for r in rows] == [1, 2, 3] and all(r["sync_bytes"] > 0 for r in rows), rows
