"""Host time per engine step of tandem-serve at 512 streams (CPU backend, a model with little compute).

    $VENV/bin/python bench/bench_serve_host.py [--build build] [--loads greedy,grpo,zmq-grpo] [--perf]

A random Llama with 1 layer, hidden 64, GQA 4:2, vocab 300 and max_position_embeddings 32768 (Qwen2.5's context,
so each block table is 2048 entries as on the GPU) is served on the CPU. Three loads, each of 512 streams:
  greedy   : 64 concurrent POST /v1/completions of 8 prompts each, 32 prompt ids, max_tokens T, temperature 0,
             ignore_eos
  grpo     : 64 concurrent POST /v1/completions with n=8, 256 prompt ids, max_tokens T, temperature 1, ignore_eos
  zmq-grpo : the same 64 x 8 as one generate over the control channel (ZeroMQ, the trainer's path)
Per load it prints tokens/s and the engine's mean step time from /metrics (tandem_engine_step_seconds sum / count)
over the whole load and over the steady part only (@all: between two samples of /metrics, taken every 0.2 s, that
both saw all 512 streams running; the ramp while requests arrive and the tail are left out), and of the steady
step time the host part: the time outside the model and sampling calls (tandem_engine_step_compute_seconds_total),
i.e. scheduling, step arrays, sampling parameters and events. With --perf the server runs under `perf record` and
the hottest symbols of each thread are printed.
"""
import argparse
import concurrent.futures
import os
import pathlib
import random
import re
import shutil
import subprocess
import tempfile
import threading
import time

from benchlib import server_fixtures
from server_fixtures import free_port


def build_model(out_dir):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    tok = server_fixtures.build_tokenizer(out_dir)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
                      bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval().save_pretrained(out_dir, safe_serialization=True)


def metric(text, name):
    m = re.search(r"^" + re.escape(name) + r"\{[^}]*\} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def step_stats(url):
    _, text, _ = server_fixtures.http_json("GET", url + "/metrics")
    return (metric(text, "tandem_engine_step_seconds_sum"), metric(text, "tandem_engine_step_seconds_count"),
            int(metric(text, "tandem_sequences_running")), metric(text, "tandem_engine_step_compute_seconds_total"))


def zmq_generate(endpoint, prompts, n, max_tokens, temperature, seed):
    """One generate over the control channel (the trainer's path): all prompts in one message. Returns tokens."""
    import json
    import struct
    import zmq
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    head = dict(type="generate", id=1, n_prompts=len(prompts), n=n, max_tokens=max_tokens, temperature=temperature,
                ignore_eos=True, seed=seed)
    sock.send_multipart([json.dumps(head).encode()] + [struct.pack(f"<{len(p)}i", *p) for p in prompts])
    total = 0
    for _ in prompts:
        parts = sock.recv_multipart()
        h = json.loads(parts[0])
        assert h["type"] == "result", h
        total += sum(h["completion_lens"])
    sock.close(0)
    return total


def run_load(url, endpoint, n_requests, n_prompts, n, prompt_len, max_tokens, temperature, seed):
    rng = random.Random(seed)
    prompts = [[[rng.randrange(3, 290) for _ in range(prompt_len)] for _ in range(n_prompts)]
               for _ in range(n_requests)]

    def one(p):
        if endpoint:
            return zmq_generate(endpoint, p, n, max_tokens, temperature, seed)
        p = p if len(p) > 1 else p[0]  # a list of prompts, or one prompt
        status, body, _ = server_fixtures.http_json("POST", url + "/v1/completions", {
            "model": "model", "prompt": p, "max_tokens": max_tokens, "temperature": temperature, "n": n,
            "ignore_eos": True, "seed": seed}, timeout=3600)
        assert status == 200, body
        return body["usage"]["completion_tokens"]

    # Steady state: the steps between two samples of /metrics that both saw every stream running.
    done = threading.Event()
    steady = [0.0, 0, 0.0]

    def watch():
        prev = step_stats(url)
        while not done.wait(0.2):
            cur = step_stats(url)
            if prev[2] == cur[2] == n_requests * n_prompts * n:
                steady[0] += cur[0] - prev[0]
                steady[1] += int(cur[1] - prev[1])
                steady[2] += cur[3] - prev[3]
            prev = cur

    watcher = threading.Thread(target=watch)
    watcher.start()
    s0, c0, _, _ = step_stats(url)
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(n_requests) as pool:
        total = sum(pool.map(one, prompts))
    wall = time.perf_counter() - t0
    done.set()
    watcher.join()
    s1, c1, _, _ = step_stats(url)
    k = max(steady[1], 1)
    return total, wall, int(c1 - c0), (s1 - s0) / max(c1 - c0, 1), steady[1], steady[0] / k, (steady[0] - steady[2]) / k


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.environ.get("TANDEM_BUILD_DIR", "build"))
    ap.add_argument("--loads", default="greedy,grpo,zmq-grpo")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--perf", action="store_true", help="run the server under perf record, print the hot symbols")
    args = ap.parse_args()
    server_fixtures.BUILD = pathlib.Path(args.build).resolve()
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench-serve-host-"))
    model = work / "model"
    model.mkdir()
    build_model(model)
    serve = server_fixtures.serve_binary()
    perf_data = work / "perf.data"
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    argv = [serve, "--model", str(model), "--port", "0", "--kv-cache-memory", "1G", "--max-num-seqs", "512",
            "--max-num-batched-tokens", "4096", "--control", endpoint]
    if args.perf:
        argv = ["perf", "record", "-F", "999", "-g", "-o", str(perf_data), "--"] + argv
    log = open(work / "server.log", "wb")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = None
    for _ in range(1200):
        m = re.search(r"listening on http://[^:]+:(\d+)", (work / "server.log").read_text(errors="replace"))
        if m:
            url = f"http://127.0.0.1:{m.group(1)}"
            break
        time.sleep(0.1)
    assert url, (work / "server.log").read_text()
    loads = {"greedy": (64, 8, 1, 32, 0.0), "grpo": (64, 1, 8, 256, 1.0), "zmq-grpo": (1, 64, 8, 256, 1.0)}
    try:
        print(f"{'load':8} {'streams':>7} {'tokens':>8} {'wall s':>7} {'tok/s':>8} {'steps':>6} {'ms/step':>8} "
              f"{'steps@all':>9} {'ms/step@all':>11} {'host ms/step@all':>16}")
        for name in args.loads.split(","):
            n_req, n_prompts, n, plen, temp = loads[name]
            total, wall, steps, step, st_steps, st_step, st_host = run_load(
                url, endpoint if name.startswith("zmq") else None, n_req, n_prompts, n, plen, args.max_tokens, temp, 1)
            print(f"{name:8} {n_req * n_prompts * n:7d} {total:8d} {wall:7.2f} {total / wall:8.0f} {steps:6d} "
                  f"{step * 1e3:8.2f} {st_steps:9d} {st_step * 1e3:11.2f} {st_host * 1e3:16.3f}")
    finally:
        proc.send_signal(2)
        proc.wait(timeout=120)
    if args.perf:
        out = subprocess.run(["perf", "report", "-i", str(perf_data), "--no-children", "--sort", "pid,sym",
                              "--stdio", "-g", "none", "--percent-limit", "0.5"], capture_output=True, text=True)
        print(out.stdout[:20000])
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
