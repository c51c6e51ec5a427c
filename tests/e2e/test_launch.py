"""`tandem-train launch`: servers and ranks from one command; a failing process stops everything, naming it;
Ctrl-C stops everything; no process outlives the launcher."""
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from server_fixtures import BUILD, build_tiny_model  # noqa: E402
from test_train_grpo import free_port, write_dataset  # noqa: E402


def launcher(args, cwd, **kw):
    exe = (BUILD / "bin" / "tandem-train").resolve()
    if not exe.exists():
        pytest.skip(f"{exe} is not built")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
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


def common(d, out, steps):
    return ["--model", str(d / "model"), "--ranks", "2", "--servers", "1", "--master-port", str(free_port()),
            "--control-port", str(free_port()), "--log-dir", str(d / f"{out}-logs"), "--",
            "--train-file", str(d / "train.jsonl"), "--output-dir", str(d / out), "--rewards", "regex_format",
            "--format-regex", "[0-9]", "--format-regex-mode", "search", "--num-generations", "8",
            "--per-device-train-batch-size", "8", "--max-completion-length", "8", "--max-steps", str(steps),
            "--logging-steps", "1", "--learning-rate", "2e-2"]


def test_launch_runs_servers_and_ranks(setup):
    d = setup
    p = launcher(common(d, "ok", 3), d)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    assert "every rank finished; servers stopped" in out
    rows = [json.loads(x) for x in (d / "ok" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert not any(alive(pid) for pid in pids_in(out))


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
