"""LoRA adapter updates over NCCL (tandem-train --use-peft --lora-sync adapter --weight-sync-transport nccl), GPU only.

The trainer sends each layer's adapter unit (bf16, what its forward computes with) from the rank that holds the
layer's master straight into the servers' device staging; the servers install it without a host round trip. Two
servers take the same pushes: one with --adapter-update-mode lowrank (the adapters as extra GEMMs), one with merge
(merged into a working copy of the base). After the run:
- the NCCL path was taken (no fall-back to zmq) and each push carried the adapters' bf16 bytes, per server;
- the lowrank server's greedy tokens and logprobs equal, bit for bit, those of a fresh server that loads the final
  checkpoint's PEFT folder with --lora (the same serving copy: the fp32 masters rounded to bf16 are the units the
  trainer sent, and the scale alpha / r = 2 is exact);
- the merged server agrees with it within bf16 tolerance (another summation order: B A rounded, then added).
Every process gets its own NCCL_HOSTID, so NCCL takes its network transport between them even where two share a GPU
(a one-GPU machine runs trainer and servers on cuda:0). With 2 GPUs the trainer runs 2 ranks (layers alternate
between them as senders).

CPU: the same over transport nccl's CPU twin (the host communicator; fp32 units, so the merged server too matches
the --lora server within fp32 rounding), with the lowrank server running two engines (--devices cpu,cpu): engine 0
receives, and its adapter staging is copied to engine 1 (spread_adapter_staging), whose answers must equal engine
0's. GPU machine without pytest: python3 tests/e2e/test_lora_nccl_sync.py --gpu (TANDEM_BUILD_DIR: the build).
"""
import json
import os
import pathlib
import subprocess
import sys
import tempfile

try:
    import pytest
except ImportError:
    pytest = None

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from server_fixtures import (BUILD, Skip, TandemServer, build_tiny_model, cuda_devices, free_port,  # noqa: E402
                             http_json, skip)

PROMPT = [5, 17, 33, 4]
STEPS = 4
R, ALPHA = 8, 16


def greedy(url, model=None):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "logprobs": 1}
    if model:
        body["model"] = model
    status, out, _ = http_json("POST", url + "/v1/completions", body)
    assert status == 200, out
    choice = out["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def run(d, gpu=True):
    gpus = cuda_devices() if gpu else 0
    if gpu and gpus < 1:
        skip("adapter updates over NCCL need a CUDA device; none visible")
    if not (BUILD / "bin" / "tandem-train").exists():
        skip(f"{BUILD}/bin/tandem-train is not built")
    model_dir, data, out_dir = d / "model", d / "train.jsonl", d / "run"
    build_tiny_model(model_dir)
    with open(data, "w") as f:
        for i in range(64):
            f.write(json.dumps({"prompt": f"numbers plus question {i % 10}"}) + "\n")
    world = 2 if gpus >= 2 or not gpu else 1
    server_dev = f"cuda:{1 if gpus >= 2 else 0}" if gpu else "cpu"
    # CPU: the lowrank server is two engines (the adapter staging spread from engine 0 to engine 1).
    placement = {"lowrank": ["--device", server_dev] if gpu else ["--devices", "cpu,cpu"],
                 "merge": ["--device", server_dev]}
    controls = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]

    def host_env(name):
        return {"NCCL_HOSTID": f"tandem-lora-nccl-{name}", "NCCL_NVLS_ENABLE": "0"}

    servers = [TandemServer(model_dir, "--control", controls[k], *placement[mode], "--kv-cache-memory",
                            "256M" if gpu else "64M", "--adapter-update-mode", mode, env=host_env(f"server{k}"),
                            start_timeout=300)
               for k, mode in enumerate(("lowrank", "merge"))]
    try:
        args = [str(BUILD / "bin" / "tandem-train"), "--model", str(model_dir), "--train-file", str(data),
                "--output-dir", str(out_dir), "--rollout-servers", ",".join(controls), "--rewards", "regex_format",
                "--format-regex", "[0-9]", "--format-regex-mode", "search", "--num-generations", "8",
                "--per-device-train-batch-size", "8", "--max-completion-length", "12", "--max-prompt-length", "64",
                "--learning-rate", "5e-2", "--max-steps", str(STEPS), "--logging-steps", "1",
                "--save-steps", str(STEPS), "--seed", "3", "--init-timeout", "120", "--comm-timeout", "120",
                "--rollout-timeout", "120", "--device", "cuda" if gpu else "cpu", "--use-peft", "--lora-r", str(R),
                "--lora-alpha", str(ALPHA), "--lora-target-modules", "all-linear", "--lora-dropout", "0",
                "--lora-sync", "adapter", "--weight-sync-transport", "nccl"]
        port = free_port()
        procs = []
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **host_env(f"rank{rank}"))
            log = open(d / f"rank{rank}.log", "w")
            procs.append((subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        codes = [p.wait(timeout=900) for p, _ in procs]
        for _, log in procs:
            log.close()
        text = (d / "rank0.log").read_text(errors="replace")
        assert codes == [0] * world, text[-4000:] + "\n--- server 0\n" + servers[0].log_text()[-3000:]
        said = "weight sync over NCCL" if gpu else "weight sync over the host communicator"
        assert said in text and "using transport zmq" not in text, text[-4000:]
        rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
        assert rows[-1]["policy_version"] == STEPS, rows[-1]
        # The tiny Llama (hidden 64, intermediate 96, kv 32, 2 layers), r 8 on all 7 modules; bf16 (CPU: fp32), to 2
        # servers. Units are padded (LAYOUT_ALIGN), so the bytes are at least the tensors' and a little more.
        n_adapter = R * (128 + 96 + 96 + 128 + 160 + 160 + 160) * 2
        es = 2 if gpu else 4
        sent = rows[-1]["sync_bytes"]
        assert n_adapter * es * 2 <= sent < n_adapter * es * 2 * 1.2, (sent, n_adapter)
        low_tokens, low_lps = greedy(servers[0].url)
        merged_tokens, merged_lps = greedy(servers[1].url)
        if not gpu:   # every engine of the two-engine server answers alike (requests go to the least loaded one)
            import concurrent.futures
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                both = list(pool.map(lambda _: greedy(servers[0].url), range(4)))
            assert all(b == (low_tokens, low_lps) for b in both), both
    finally:
        for srv in servers:
            srv.kill()
    ckpt = out_dir / f"checkpoint-{STEPS}"
    with TandemServer(model_dir, "--device", server_dev, "--kv-cache-memory", "256M" if gpu else "64M", "--lora",
                      f"pol={ckpt}", start_timeout=300) as ref:
        want_tokens, want_lps = greedy(ref.url, "pol")
        base_tokens, _ = greedy(ref.url)
    assert want_tokens != base_tokens, "the adapters did not change the greedy continuation"
    assert low_tokens == want_tokens and low_lps == want_lps, (low_tokens, want_tokens, low_lps, want_lps)
    worst = max(abs(a - b) for a, b in zip(merged_lps, want_lps))
    assert merged_tokens[:4] == want_tokens[:4] and abs(merged_lps[0] - want_lps[0]) < (0.05 if gpu else 1e-4), \
        (merged_tokens, want_tokens, merged_lps, want_lps)
    per_push = [r.get("sync_time", float("nan")) for r in rows]
    print(f"{'gpu' if gpu else 'cpu'}: {world} rank(s) -> 2 servers on {server_dev}, adapters over "
          f"{'NCCL (network transport)' if gpu else 'the host communicator'}: "
          f"{sent / 1e3:.1f} kB a push, sync {' '.join(f'{s * 1e3:.1f}' for s in per_push)} ms; lowrank = --lora "
          f"checkpoint bit for bit; merge within {worst:.2e} (12 tokens, first 4 equal)")


def test_lora_adapters_over_nccl(tmp_path):
    run(tmp_path)


def test_lora_adapters_over_nccl_cpu_twin(tmp_path):
    run(tmp_path, gpu=False)


if __name__ == "__main__":
    if "--gpu" not in sys.argv:
        sys.exit("usage: test_lora_nccl_sync.py --gpu   (TANDEM_BUILD_DIR: the build)")
    try:
        run(pathlib.Path(tempfile.mkdtemp(prefix="lora-nccl-")))
        print("summary: PASS: LoRA adapters pushed over NCCL into a lowrank and a merge server")
    except Skip as e:
        print(f"summary: SKIP: {e}")
        sys.exit(77)
