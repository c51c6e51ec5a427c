"""Shared helpers for the end-to-end server tests: a tiny model folder and a real tandem-serve process.

The model folder holds a random Llama built by transformers (vocab 300) and a byte-level BPE tokenizer
trained here to 300 tokens with the `tokenizers` library, three special tokens, and a ChatML chat template,
so text, chat and token-id requests all work and transformers can load the same folder as the reference.

Server: `TandemServer(model_dir, *extra_args)` starts build/bin/tandem-serve on a free port (--port 0; the
port is read from the "listening on" log line), waits for GET /health, and `stop()` sends SIGTERM and
returns the exit code. Its log goes to a file (`server.log_text()`) so a chatty server never blocks on a
full pipe. Tests skip (with the reason) only when the binary is not built.
"""
import json
import os
import pathlib
import random
import re
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

try:
    import pytest
except ImportError:  # the benchmark scripts reuse these helpers on machines without pytest
    pytest = None

ROOT = pathlib.Path(__file__).resolve().parents[2]


class Skip(Exception):
    """A GPU case skipped when run as a script (`python3 tests/e2e/test_x.py --gpu`: the GPU machine has no pytest)."""


def skip(why):
    if pytest is not None:
        pytest.skip(why)
    raise Skip(why)


def cuda_devices():
    """CUDA devices torch sees (0 without torch or a driver)."""
    try:
        import torch
        return torch.cuda.device_count()
    except Exception:
        return 0


BUILD = pathlib.Path(os.environ.get("TANDEM_BUILD_DIR", ROOT / "build"))

VOCAB_SIZE = 300
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"
# The standard ChatML template (as used by SmolLM2 / Qwen2 without a default system prompt).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly box and hum "
          "numbers 0 1 2 3 4 5 6 7 8 9 plus minus equals answer question reason think step").split()


def _ephemeral_low():
    """The first port the kernel hands out for outgoing connections (32768 where /proc is not readable)."""
    try:
        return int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(n=1):
    """The first of n consecutive TCP ports on 127.0.0.1 that are free now.

    The ports come from below the kernel's ephemeral range: a port the kernel assigned (bind to 0) is in that
    range, and an outgoing connection made before the server binds can take it, or take P + 1 where a
    launcher gives server i the port P + i. CI lost a run to exactly that ("Address already in use" on P + 1).
    """
    high = max(_ephemeral_low(), 11024 + n)
    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(10000, high - n)
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {n} free TCP ports below {high}")


def serve_binary():
    path = BUILD / "bin" / "tandem-serve"
    if not path.exists():
        if pytest is None:
            raise FileNotFoundError(path)
        pytest.skip(f"{path} is not built (run scripts/test.sh, or set TANDEM_BUILD_DIR)")
    return str(path)


def _corpus(n_lines=400, seed=0):
    import random
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 14))) for _ in range(n_lines)]


def build_tokenizer(out_dir, vocab_size=VOCAB_SIZE):
    """Byte-level BPE trained on a fixed corpus; the special tokens take the first ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    assert tok.get_vocab_size() <= vocab_size
    out_dir = pathlib.Path(out_dir)
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 4096,
        "chat_template": CHATML_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    (out_dir / "special_tokens_map.json").write_text(json.dumps({"eos_token": EOS_TOKEN,
                                                                 "pad_token": "<|endoftext|>"}))
    return tok


def build_tiny_model(out_dir, seed=0, max_position_embeddings=4096):
    """Random Llama (2 layers, hidden 64, GQA 4:2, untied) + trained tokenizer in out_dir. Returns the model."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out_dir)
    eos = tok.token_to_id(EOS_TOKEN)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
                      rms_norm_eps=1e-6, initializer_range=0.08, bos_token_id=None, eos_token_id=eos,
                      pad_token_id=tok.token_to_id("<|endoftext|>"), tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # transformers initialises norms to 1; randomise them so mistakes show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    return model


def http_json(method, url, body=None, headers=None, timeout=60):
    """(status, parsed JSON or raw text, response headers) without raising on 4xx/5xx."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=dict(headers or {}))
    if data is not None and "Content-Type" not in req.headers:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw, hdrs = r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        status, raw, hdrs = e.code, e.read(), dict(e.headers)
    try:
        return status, json.loads(raw), hdrs
    except ValueError:
        return status, raw.decode("utf-8", "replace"), hdrs


class TandemServer:
    def __init__(self, model_dir, *extra_args, host="127.0.0.1", env=None, start_timeout=120):
        self.model_dir = str(model_dir)
        self.host = host
        self._logdir = tempfile.mkdtemp(prefix="tandem-serve-")
        self.log_path = pathlib.Path(self._logdir) / "server.log"
        args = [serve_binary(), "--model", self.model_dir, "--host", host, "--port", "0",
                "--kv-cache-memory", "64M", *map(str, extra_args)]
        full_env = dict(os.environ)
        full_env.setdefault("OMP_NUM_THREADS", "1")
        full_env.setdefault("OPENBLAS_NUM_THREADS", "1")
        full_env.update(env or {})
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=full_env)
        self.port = None
        deadline = time.time() + start_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"tandem-serve exited with {self.proc.returncode} during start:\n"
                                     f"{self.log_text()}")
            m = re.search(r"listening on http://(?:\[[^\]]+\]|[^:/]+):(\d+)", self.log_text())
            if m:
                self.port = int(m.group(1))
                break
            time.sleep(0.05)
        if self.port is None:
            self.kill()
            raise AssertionError(f"tandem-serve did not start in {start_timeout} s:\n{self.log_text()}")
        self.url = f"http://{host}:{self.port}"
        wait_health(self.url, timeout=start_timeout)

    def log_text(self):
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def alive(self):
        return self.proc.poll() is None

    def stop(self, sig=signal.SIGTERM, timeout=60):
        """Signals the server and waits for it; returns its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"tandem-serve did not exit within {timeout} s of {sig!r}:\n{self.log_text()}")
        self._log.close()
        return self.proc.returncode

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.stop()


def wait_health(url, timeout=60):
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        try:
            status, _, _ = http_json("GET", url + "/health", timeout=5)
            if status == 200:
                return
            last = status
        except OSError as e:
            last = e
        time.sleep(0.05)
    raise AssertionError(f"{url}/health did not answer 200 within {timeout} s (last: {last})")


def metrics(url, headers=None):
    """Parses /metrics into {(name, frozenset(labels.items())): value}."""
    status, text, _ = http_json("GET", url + "/metrics", headers=headers)
    assert status == 200, text
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$', line)
        assert m, f"bad metrics line: {line!r}"
        labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def metric(values, name, **labels):
    """Sum of every series of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in values.items() if n == name and want <= set(ls))


if pytest is not None:
    @pytest.fixture(scope="session")
    def tiny_model_dir(tmp_path_factory):
        d = tmp_path_factory.mktemp("tiny-llama-chatml")
        build_tiny_model(d)
        return d
