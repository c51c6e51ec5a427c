"""Helpers the bench scripts share: the Qwen2.5 shapes, the carried libraries, random models, the roofline's
ceilings, the GPU-to-GPU copy, GPU memory sampling, and running a `tandem-train launch` and following it through
its metrics.jsonl.

The scripts run as `python3 bench/NAME.py` (by hand or through scripts/gpu-check.sh) and `import benchlib`: Python
puts a script's own folder first on sys.path, so this module is found from any working directory. It imports only
the standard library itself (torch and transformers inside the functions that use them), and puts tests/e2e on
sys.path for `server_fixtures` (the e2e tests' server, tokenizer and tiny-model helpers).
"""
import concurrent.futures
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
E2E = ROOT / "tests" / "e2e"
if str(E2E) not in sys.path:
    sys.path.insert(0, str(E2E))
import server_fixtures  # noqa: E402

# Layer shapes of Qwen2.5-0.5B, -1.5B, -7B and -14B (tied embeddings here, vocabulary QWEN_VOCAB; the real 7B and
# 14B untie them).
QWEN_SHAPES = {
    "14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                num_key_value_heads=8),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2),
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2),
}
QWEN_VOCAB = 151936
# Shapes served from config.json alone (tandem-serve --load-format random): their bf16 files (65 / 145 GB) would not
# fit the GPU machines' disks, nor their random init one GPU. Untied embeddings and the larger vocabulary, as the
# real Qwen2.5-32B / 72B configs say.
QWEN_CONFIG_ONLY_SHAPES = {
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "72b": dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}


def qwen_config(shape, **overrides):
    """A transformers Qwen2Config of a QWEN_SHAPES shape: tied embeddings, context 4096, random weights to come."""
    from transformers import Qwen2Config
    kw = dict(vocab_size=QWEN_VOCAB, tie_word_embeddings=True, max_position_embeddings=4096, **QWEN_SHAPES[shape])
    kw.update(overrides)
    return Qwen2Config(**kw)


def use_devlib(build):
    """Puts the carried folder's bundled libraries (scripts/gpu-build.sh packs them as devlib.tar.xz) on the
    library path of the processes this script starts; unpacks them first (into /tmp when the folder is read-only)."""
    lib = build / "devlib"
    if not lib.is_dir() and (build / "devlib.tar.xz").exists():
        for dest in (build, pathlib.Path(tempfile.gettempdir()) / "tandem-bench-devlib"):
            try:
                dest.mkdir(parents=True, exist_ok=True)
                with tarfile.open(build / "devlib.tar.xz") as tar:
                    tar.extractall(dest, filter="data")
                lib = dest / "devlib"
                break
            except OSError as e:
                print(f"cannot unpack {build / 'devlib.tar.xz'} into {dest}: {e}", file=sys.stderr)
    if lib.is_dir():
        os.environ["LD_LIBRARY_PATH"] = f"{lib}:{os.environ.get('LD_LIBRARY_PATH', '')}"
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast can take a shared host's GPUs down


def build_qwen_model(d, shape, device="cuda:0", edit=None, **from_config):
    """Saves a random bf16 Qwen2.5-shaped model (QWEN_SHAPES) with server_fixtures' small byte-level tokenizer into
    folder d; returns the model, still on `device`. edit(model, d): called before saving (the tokenizer is already
    in d). from_config: extra arguments of from_config (attention)."""
    import torch
    from transformers import AutoModelForCausalLM
    server_fixtures.build_tokenizer(d)
    torch.manual_seed(0)
    cfg = qwen_config(shape, bos_token_id=None, eos_token_id=None)
    with torch.device(device):  # random init on the GPU: seconds instead of a minute for 1.5B
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, **from_config)
    if edit:
        edit(model, pathlib.Path(d))
    model.save_pretrained(d, safe_serialization=True)
    return model


def build_config_only(d, shape):
    """Writes config.json (a QWEN_SHAPES or QWEN_CONFIG_ONLY_SHAPES shape) and server_fixtures' small tokenizer into d, no
    weights, for tandem-serve --load-format random; returns the parameter count (Qwen2: q/k/v biases; the embeddings
    once when tied)."""
    from transformers import Qwen2Config
    server_fixtures.build_tokenizer(d)
    kw = dict(vocab_size=QWEN_VOCAB, tie_word_embeddings=True, max_position_embeddings=4096, bos_token_id=None,
              eos_token_id=None, torch_dtype="bfloat16")
    kw.update(QWEN_SHAPES.get(shape) or QWEN_CONFIG_ONLY_SHAPES[shape])
    Qwen2Config(**kw).save_pretrained(d)
    C, I, L, V = kw["hidden_size"], kw["intermediate_size"], kw["num_hidden_layers"], kw["vocab_size"]
    KV = kw["num_key_value_heads"] * (C // kw["num_attention_heads"])
    layer = C * C + C + 2 * (C * KV + KV) + C * C + 3 * C * I + 2 * C
    return L * layer + V * C * (1 if kw["tie_word_embeddings"] else 2) + C


def build_model(d, shape, edit=None):
    """Writes a model folder, "tiny" (server_fixtures' 2-layer Llama, vocab 300, for the CPU dry runs) or a
    QWEN_SHAPES shape; returns {parameter name: numel} (tied embeddings once, as saved) and frees the GPU's copy.
    edit(model, d): changes the random model before it is saved (tiny: saved again after it)."""
    if shape == "tiny":
        model = server_fixtures.build_tiny_model(d)
        if edit:
            edit(model, pathlib.Path(d))
            model.save_pretrained(d, safe_serialization=True)
        return {n: p.numel() for n, p in model.named_parameters()}
    import torch
    model = build_qwen_model(d, shape, edit=edit)
    numels = {n: p.numel() for n, p in model.named_parameters()}
    del model
    torch.cuda.empty_cache()
    return numels


def measure_ceilings():
    """(device copy GB/s counting read + write, bf16 matmul FLOP/s) on the current GPU."""
    import torch
    n = 1 << 30  # bf16 elements: 2 GiB per buffer
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        dst.copy_(src)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    bw = 2 * 2 * n * 10 / (start.elapsed_time(end) * 1e-3)
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(5):
        a @ b
    start.record()
    for _ in range(20):
        a @ b
    end.record()
    torch.cuda.synchronize()
    peak = 2 * 8192 ** 3 * 20 / (start.elapsed_time(end) * 1e-3)
    del a, b
    torch.cuda.empty_cache()
    return bw, peak


def roofline(b, ctx_mean, weight_bytes, kv_bytes_per_token, params, bw, peak):
    """(memory bound, compute bound) in tokens/s for a decode batch of b sequences at mean context ctx_mean."""
    mem = b * bw / (weight_bytes + b * kv_bytes_per_token * ctx_mean)
    return mem, peak / (2 * params)


def p2p_copy_gbs(dst=1, nbytes=1 << 30, iters=10):
    """torch copy of a 1 GiB tensor cuda:0 -> cuda:dst, GB/s one direction."""
    import torch
    a = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda:0")
    b = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=f"cuda:{dst}")
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize(0), torch.cuda.synchronize(dst)
    t0 = time.perf_counter()
    for _ in range(iters):
        b.copy_(a)
    torch.cuda.synchronize(0), torch.cuda.synchronize(dst)
    dt = time.perf_counter() - t0
    del a, b
    torch.cuda.empty_cache()
    return nbytes * iters / dt / 1e9


def check_sft_rows(rows, steps, tokens_per_step):
    """'' when an SFT run's metrics rows are all there and each step trained tokens_per_step tokens (num_tokens is
    TRL's cumulative count of every token, all ranks), else what is wrong."""
    if len(rows) < steps:
        return f"{len(rows)} of {steps} steps"
    if any(r["num_tokens"] != (i + 1) * tokens_per_step for i, r in enumerate(rows)):
        return (f"num_tokens {[r['num_tokens'] for r in rows]} are not multiples of {tokens_per_step} tokens a step: "
                "the rows are not the size this script made them")
    return ""


def gpu_mem_mib():
    """{gpu index: MiB used} from nvidia-smi, {} when there is none."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {int(i): int(m) for i, m in (line.split(",") for line in out.strip().splitlines() if "," in line)}


class MemSampler(threading.Thread):
    """Samples nvidia-smi every second; peak[gpu] = the most MiB seen."""
    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.halt = {}, threading.Event()

    def run(self):
        while not self.halt.is_set():
            for g, m in gpu_mem_mib().items():
                self.peak[g] = max(m, self.peak.get(g, 0))
            self.halt.wait(1.0)


def run_launch(cmd, env, metrics, steps, timeout, name, log_path, logs, show=None):
    """Runs a `tandem-train launch` command line (started in its own session, output to log_path, the launch's
    --log-dir `logs`) until rank 0's metrics.jsonl at `metrics` has `steps` rows, then stops it (SIGTERM: the
    launcher stops its ranks and servers; the final checkpoint would only cost time), sampling GPU memory all the
    while. show(row number, row) is called for each new row. The logs are kept under $OUT/NAME-logs (OUT set).
    Returns (rows, launcher log text, failure note with the logs' tails or '', {gpu: (peak MiB, peak - MiB before
    the launch)}, whether it was still running when stopped)."""
    base = gpu_mem_mib()
    sampler = MemSampler()
    sampler.start()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _, note = follow_metrics(proc, metrics, steps, timeout, show, poll_s=0.5)
        finally:
            stopped = stop(proc, 90)
    sampler.halt.set()
    sampler.join()
    text = log_path.read_text(errors="replace")
    if note:
        note += launch_log_tails(text, logs)
    keep_launch_logs(name, log_path, logs)
    mem = {g: (sampler.peak[g], sampler.peak[g] - base.get(g, 0)) for g in sorted(sampler.peak)}
    return read_metrics(metrics), text, note, mem, stopped


def follow_metrics(proc, metrics, steps, timeout, show=None, poll_s=0.2, what="tandem-train launch"):
    """Waits until the metrics.jsonl at `metrics` has `steps` whole rows, proc exits or `timeout` seconds pass;
    show(row number, row) is called for each new row. Returns (rows seen, failure note or '')."""
    deadline, seen = time.time() + timeout, 0
    while True:
        exited = proc.poll() is not None  # asked before reading, so that its last rows are read
        done = metrics.read_text().split("\n")[:-1] if metrics.exists() else []  # whole lines only
        for line in done[seen:]:
            r = json.loads(line)
            seen += 1
            if show:
                show(seen, r)
        if seen >= steps:
            return seen, ""
        if exited:
            return seen, f"{what} exited with {proc.returncode} after {seen} of {steps} steps"
        if time.time() > deadline:
            return seen, f"timeout after {timeout} s ({seen} of {steps} steps)"
        time.sleep(poll_s)


def stop(proc, wait_s, group=True):
    """SIGTERM to proc if it still runs (a launcher then stops its ranks and servers), SIGKILL after wait_s seconds
    (to its process group when group: it was started with start_new_session). Returns whether it was running."""
    if proc.poll() is not None:
        return False
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        if group:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
        proc.wait()
    return True


def launch_log_tails(text, logs):
    """For a failure note: the tail of the launcher's log text and of each log in the launch's --log-dir."""
    tails = [f"--- launcher + rank 0 log (tail)\n{text[-4000:]}"]
    for p in sorted(logs.glob("*.log")) if logs.is_dir() else []:
        tails.append(f"--- {p.name} (tail)\n{p.read_text(errors='replace')[-1500:]}")
    return "\n" + "\n".join(tails)


def keep_launch_logs(name, log_path, logs):
    """Copies the launcher's log and the launch's --log-dir logs to $OUT/NAME-logs when OUT is set (the device
    tool's output folder), to read beside the table."""
    if os.environ.get("OUT"):
        keep = pathlib.Path(os.environ["OUT"]) / f"{name}-logs"
        keep.mkdir(parents=True, exist_ok=True)
        for p in [log_path, *(sorted(logs.glob("*.log")) if logs.is_dir() else [])]:
            shutil.copy(p, keep / p.name)


def read_metrics(metrics):
    """The rows of a metrics.jsonl, [] when it is not there."""
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []


LAYOUT_ALIGN = 64  # shared/layout.h
# A decoder layer's tensors in the order shared/layout.c places them (those a model lacks are skipped).
LAYER_ORDER = ["input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
               "self_attn.v_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
               "self_attn.q_norm.weight", "self_attn.k_norm.weight", "self_attn.o_proj.weight",
               "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
               "mlp.down_proj.weight"]


def unit_numels(numels, n_layers):
    """[embedding, layer 0 .. L-1, final] element counts, aligned as shared/layout.c builds the units."""
    def align(x):
        return (x + LAYOUT_ALIGN - 1) // LAYOUT_ALIGN * LAYOUT_ALIGN
    units = [align(numels["model.embed_tokens.weight"])]
    for layer in range(n_layers):
        cursor = 0
        for t in LAYER_ORDER:
            n = numels.get(f"model.layers.{layer}.{t}")
            if n is None:
                continue
            # up_proj follows gate_proj with no padding between: the two are read as one (2I, C) matrix.
            cursor = (cursor + n) if t == "mlp.gate_proj.weight" else align(cursor + n)
        units.append(align(cursor))
    final = align(numels["model.norm.weight"])
    if "lm_head.weight" in numels:
        final = align(final + numels["lm_head.weight"])
    units.append(final)
    return units


def write_data(path, tok_file, eos, n_rows, seq_len, prompt_len, seed=0):
    """n_rows prompt/completion rows of exactly seq_len tokens (prompt_len of them the prompt's), checked with the
    model's tokenizer; the completion ends with the EOS text as tandem-train appends it."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tok_file))
    words = sorted(set(server_fixtures._WORDS))
    cost = {w: len(tok.encode(" " + w).ids) for w in words}
    ones = [w for w in words if cost[w] == 1]
    # The prompt's first word has no space before it: one that is a single token that way too.
    firsts = [w for w in words if len(tok.encode(w).ids) == 1]
    if not ones or not firsts:
        raise SystemExit("the tokenizer has no one-token word to fill rows with")
    rng = random.Random(seed)

    def text_of(n_tokens, lead):
        """Words worth n_tokens tokens, each with a leading space (the first too when lead)."""
        out, left = [], n_tokens
        while left > 0:
            w = rng.choice(words) if left > 4 else rng.choice(ones)
            if cost[w] <= left:
                out.append(w)
                left -= cost[w]
        s = " ".join(out)
        return " " + s if lead else s

    n_eos = len(tok.encode(eos).ids)
    with open(path, "w") as f:
        for i in range(n_rows):
            prompt = rng.choice(firsts) + text_of(prompt_len - 1, True)
            completion = text_of(seq_len - prompt_len - n_eos, True)
            p_ids, f_ids = tok.encode(prompt).ids, tok.encode(prompt + completion + eos).ids
            if len(p_ids) != prompt_len or len(f_ids) != seq_len or f_ids[:prompt_len] != p_ids:
                raise SystemExit(f"row {i}: {len(p_ids)} prompt / {len(f_ids)} tokens, wanted {prompt_len} / "
                                 f"{seq_len} with the prompt as prefix")
            f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")


def completions(url, prompts, max_tokens, n=1, temperature=0):
    """Every prompt (a list of ids, or a tensor) as one concurrent /v1/completions request (n choices, seed 1,
    ignore_eos); the token ids of every choice, in prompt order."""
    def one(p):
        status, body, _ = server_fixtures.http_json("POST", url + "/v1/completions", {
            "prompt": p, "max_tokens": max_tokens, "temperature": temperature, "n": n,
            "seed": 1, "ignore_eos": True, "return_token_ids": True}, timeout=1800)
        assert status == 200, body
        return [c["token_ids"] for c in body["choices"]]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        ids = [p.tolist() if hasattr(p, "tolist") else list(p) for p in prompts]
        return [choice for choices in pool.map(one, ids) for choice in choices]


STEP_KINDS = ("decode_graph", "decode_eager", "prefill")


def engine_counters(url):
    """(steps, seconds in steps, seconds in the model and sampling calls, then steps and model + sampling seconds of
    each kind in STEP_KINDS) so far, summed over the engines."""
    v = server_fixtures.metrics(url)
    return ((server_fixtures.metric(v, "tandem_engine_step_seconds_count"),
             server_fixtures.metric(v, "tandem_engine_step_seconds_sum"),
             server_fixtures.metric(v, "tandem_engine_step_compute_seconds_total"))
            + tuple(server_fixtures.metric(v, "tandem_engine_steps_by_kind_total", kind=k) for k in STEP_KINDS)
            + tuple(server_fixtures.metric(v, "tandem_engine_step_compute_seconds_by_kind_total", kind=k)
                    for k in STEP_KINDS))


def engine_split(before, after, wall):
    """Where a load's wall time went, from the engine's counters: its steps' mean time, split into the model and
    sampling calls (GPU work and its launches: they wait for the device) and the engine's host work around them,
    and the share of the wall time the engine spent in steps at all (the rest: HTTP, admission, the client)."""
    d = [a - b for a, b in zip(after, before)]
    steps, step_s, compute_s = d[:3]
    if steps <= 0:
        return "no steps"
    n_kinds = len(STEP_KINDS)
    kinds = ", ".join(f"{k} {int(n)} x {c / n * 1e3:.2f} ms" for k, n, c in zip(STEP_KINDS, d[3:3 + n_kinds],
                                                                                d[3 + n_kinds:]) if n > 0)
    return (f"{int(steps)} steps, {step_s / steps * 1e3:.2f} ms/step = {compute_s / steps * 1e3:.2f} model+sampling + "
            f"{(step_s - compute_s) / steps * 1e3:.2f} host; in steps {step_s / wall:.0%} of the wall time"
            f" (model+sampling by kind: {kinds})")
