"""tandem-serve as a process: its command line, and signals at any moment of its life.

- `-h` prints the help exactly as `--help`, `--version` the project version; every default in the help is
  written as people write numbers (30, 0.5, 1G; never 3e+01) and equals the one docs/http-api.md gives.
- SIGTERM / SIGINT sent at a range of moments from the spawn on (before main, while the model loads, while HTTP
  starts, once listening) end the process within a couple of seconds every time: during start-up with status
  128 + signal and a log line saying start-up was interrupted, once listening after a drain with status 0.
  OpenBLAS's pool threads, started before main, do not block the signals; the test runs with such a pool
  (OPENBLAS_NUM_THREADS=2), where a signal used to be swallowed during start-up.
"""
import json
import os
import re
import signal
import subprocess
import time

import pytest

from server_fixtures import ROOT, serve_binary

def run_serve(*args):
    return subprocess.run([serve_binary(), *args], capture_output=True, text=True, timeout=30)


def help_defaults(text):
    """{"--option": "default as printed"} for every option whose help says (default X)."""
    lines, option = {}, None
    for line in text.splitlines():
        m = re.match(r"^  (?:-h, )?(--[a-z-]+)", line)
        if m:
            option = m.group(1)
            lines[option] = line
        elif option and line.startswith("    "):
            lines[option] += " " + line.strip()
        else:
            option = None
    out = {}
    for option, line in lines.items():
        m = re.search(r"\(default:? ([^)]*)\)", line)
        if m:
            out[option] = m.group(1)
    return out


def test_h_is_help_and_version_is_the_project_version():
    long_help, short_help = run_serve("--help"), run_serve("-h")
    assert long_help.returncode == 0 and short_help.returncode == 0, (long_help.stderr, short_help.stderr)
    assert long_help.stdout.startswith("usage: tandem-serve --model DIR") and short_help.stdout == long_help.stdout
    assert "-h, --help" in long_help.stdout and "--version" in long_help.stdout
    assert "128 + N (143 for SIGTERM, 130 for SIGINT)" in long_help.stdout
    v = run_serve("--version")
    project = re.search(r"project\(tandem\s+VERSION\s+([0-9.]+)", (ROOT / "CMakeLists.txt").read_text()).group(1)
    assert v.returncode == 0 and re.match(rf"^tandem-serve {re.escape(project)} \(", v.stdout), v.stdout
    bad = run_serve("-x")
    assert bad.returncode == 2 and "see --help" in bad.stderr


def test_help_defaults_are_written_as_people_write_them_and_match_the_docs():
    defaults = help_defaults(run_serve("--help").stdout)
    assert defaults["--drain-timeout"] == "30" and defaults["--weight-sync-timeout"] == "600", defaults
    docs = {}
    for line in (ROOT / "docs" / "http-api.md").read_text().splitlines():
        m = re.match(r"^\| `(--[a-z-]+)[^`]*`[^|]*\| `([^`]*)` \|", line)
        if m:
            docs[m.group(1)] = m.group(2)
    numeric = {k: v for k, v in defaults.items() if v[:1].isdigit() and k != "--host"}  # the host is 127.0.0.1
    assert len(numeric) >= 10, defaults
    for option, value in numeric.items():
        # 30, 0.5, 1G: no exponent, no trailing zeros after a decimal point
        assert re.fullmatch(r"[0-9]+(\.[0-9]*[1-9])?[KMGT]?", value), (option, value)
        assert docs.get(option) == value, (option, value, docs.get(option))


# Long enough to load (about a tenth of a second or more) that a signal sent when "starting:" is logged
# lands in the middle of it.
SLOW_HIDDEN, SLOW_INTER, SLOW_LAYERS, SLOW_VOCAB = 512, 1408, 8, 300


@pytest.fixture(scope="module")
def slow_model_dir(tmp_path_factory):
    """A Llama of ~95 MB of float32 zeros (the values do not matter here), no tokenizer."""
    import torch
    from safetensors.torch import save_file
    d = tmp_path_factory.mktemp("slow-llama")
    h, inter = SLOW_HIDDEN, SLOW_INTER
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": SLOW_VOCAB,
           "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": SLOW_LAYERS, "num_attention_heads": 8,
           "num_key_value_heads": 4, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
           "tie_word_embeddings": False, "torch_dtype": "float32"}
    (d / "config.json").write_text(json.dumps(cfg))
    t = {"model.embed_tokens.weight": torch.zeros(SLOW_VOCAB, h), "model.norm.weight": torch.ones(h),
         "lm_head.weight": torch.zeros(SLOW_VOCAB, h)}
    for i in range(SLOW_LAYERS):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = torch.ones(h)
        t[p + "post_attention_layernorm.weight"] = torch.ones(h)
        t[p + "self_attn.q_proj.weight"] = torch.zeros(h, h)
        t[p + "self_attn.k_proj.weight"] = torch.zeros(h // 2, h)
        t[p + "self_attn.v_proj.weight"] = torch.zeros(h // 2, h)
        t[p + "self_attn.o_proj.weight"] = torch.zeros(h, h)
        t[p + "mlp.gate_proj.weight"] = torch.zeros(inter, h)
        t[p + "mlp.up_proj.weight"] = torch.zeros(inter, h)
        t[p + "mlp.down_proj.weight"] = torch.zeros(h, inter)
    save_file(t, str(d / "model.safetensors"))
    return d


def spawn(model_dir, log_path):
    env = dict(os.environ, OPENBLAS_NUM_THREADS="2", OMP_NUM_THREADS="1")
    log = open(log_path, "wb")
    proc = subprocess.Popen([serve_binary(), "--model", str(model_dir), "--port", "0", "--kv-cache-memory", "64M"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    log.close()
    return proc


def wait_for_line(proc, log_path, pattern, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if re.search(pattern, log_path.read_text(errors="replace")):
            return
        assert proc.poll() is None, log_path.read_text(errors="replace")
        time.sleep(0.002)
    raise AssertionError(f"no line matching {pattern!r} within {timeout} s:\n{log_path.read_text()}")


def signal_and_wait(proc, sig, log_path, limit_s=2.0):
    """Sends sig; returns the exit status (negative: ended by a signal) once the process is gone."""
    t0 = time.time()
    proc.send_signal(sig)
    try:
        rc = proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"tandem-serve still ran {limit_s} s after {sig!r}:\n{log_path.read_text()}")
    assert time.time() - t0 <= limit_s
    return rc


def check_status(rc, sig, log):
    """128 + sig with the start-up line, 0 after a drain, or -sig (the default action, before main ran)."""
    assert rc in (128 + sig, 0, -sig), (rc, log)
    if rc == 128 + sig:
        name = signal.Signals(sig).name
        assert f"start-up interrupted by {name}" in log and f"exiting with status {128 + sig}" in log, log
    if rc == 0:
        assert "listening on" in log and "stopped" in log, log


@pytest.mark.parametrize("delay_s", [0.0, 0.01, 0.03, 0.08, 0.15, 0.3, 0.6])
def test_signal_after_spawn_is_acted_on(slow_model_dir, tmp_path, delay_s):
    log_path = tmp_path / "serve.log"
    proc = spawn(slow_model_dir, log_path)
    time.sleep(delay_s)
    rc = signal_and_wait(proc, signal.SIGTERM, log_path)
    check_status(rc, signal.SIGTERM, log_path.read_text(errors="replace"))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_while_loading_exits_128_plus_signal(slow_model_dir, tmp_path, sig):
    log_path = tmp_path / "serve.log"
    proc = spawn(slow_model_dir, log_path)
    wait_for_line(proc, log_path, r"tandem-serve: starting: ")
    rc = signal_and_wait(proc, sig, log_path)
    log = log_path.read_text(errors="replace")
    assert rc == 128 + sig, (rc, log)
    check_status(rc, sig, log)
    assert "listening on" not in log


def test_signal_once_listening_drains_and_exits_zero(slow_model_dir, tmp_path):
    log_path = tmp_path / "serve.log"
    proc = spawn(slow_model_dir, log_path)
    wait_for_line(proc, log_path, r"listening on http://")
    rc = signal_and_wait(proc, signal.SIGTERM, log_path)
    log = log_path.read_text(errors="replace")
    assert rc == 0 and "received SIGTERM: no longer accepting requests" in log, log
