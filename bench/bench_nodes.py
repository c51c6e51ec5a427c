"""ZeRO-3 across nodes (issue 25): flat ZeRO-3 (full_shard), ZeRO++ hpZ (zero_hpz_partition_size = ranks per node)
and HSDP (hybrid_shard) on two-node stand-ins; step time, the bytes that cross the node boundary, and what a
4 x 8 cluster would see.

    python3 bench/bench_nodes.py --stand-in cpu --build build-cpu        # 2 nodes x 2 ranks, CPU backend
    python3 bench/bench_nodes.py --stand-in gpu --build build-gpu.carry  # 2 nodes x 1 GPU + 1 node x 2 GPUs
    python3 bench/bench_nodes.py --stand-in gpu --dry-run-cpu --build build-cpu   # the GPU path, tiny model, CPU
    python3 bench/bench_nodes.py --stand-in gpu --same-gpu --shapes 1.5b ...      # smoke test on one GPU

Nodes: every "node" is one `tandem-train launch --nnodes M --node-rank n --ranks G` on this host (as
tests/e2e/test_train_node_sharding.py starts them), so the node membership comes from the launch contract.
  cpu: M = 2 nodes x G = 2 ranks, the host backend (ZeroMQ over loopback), one BLAS thread a rank. Runs flat, hpZ
    and HSDP at each --grad-accums value.
  gpu: M = 2 nodes x G = 1 GPU, node n on GPU n (CUDA_VISIBLE_DEVICES) with NCCL_HOSTID bench-nodes-n, so NCCL
    takes its network transport between them (NCCL_NVLS_ENABLE=0); flat and HSDP. hpZ needs G > 1
    (zero_hpz_partition_size 1 is "off"), so it has no run here. Baseline: flat on one node of 2 GPUs (NVLink);
    HSDP and hpZ on one node cut the state as flat does. --dry-run-cpu runs the same launches on the CPU backend
    with the tiny test model (NCCL variables set but unused) to check this script. --same-gpu puts both nodes on
    GPU 0 (NCCL_HOSTID still apart) and leaves the baseline out: a smoke test of the NCCL path on one GPU, its
    times not the stand-in's.
Model: cpu: a small Qwen2.5-shaped model (benchlib.qwen_config: width 256, 8 layers, MLP 1024, 4 heads, 2 KV
heads, tied, with server_fixtures' byte-level tokenizer and its vocabulary of 300), fp32 as CPU runs train;
gpu: random bf16 Qwen2.5-1.5B / -7B shapes (benchlib.QWEN_SHAPES, tied, vocab 151936); dry run: the tiny Llama.
Data: prompt/completion rows of exactly --seq-len tokens (benchlib.write_data). SFT, --zero-stage 3, --batch
sequences a rank per micro-step, grad accumulation A micro-steps per optimizer step, gradient checkpointing on
(gpu) or off (cpu). Launchers are stopped once the last metrics row is written (the final save would only cost
time).
Per run, from rank 0's metrics.jsonl: step s = median step_time of steps 2..N; cross-node and intra-node bytes =
comm/bytes_inter_node and comm/bytes_intra_node (rank 0's ZeRO collectives per optimizer step, trainer/trainer.c;
the same in every row); loss diff = the largest |loss - flat's loss| / |flat's loss| over the steps, against the
flat run of the same stand-in and A (float tolerance 1e-5 on CPU, bf16's 1e-2 on GPUs). gpu: peak MiB per GPU
from nvidia-smi sampled every second (less what the GPU held before the launch), and the trainer's own ZeRO state
line; the formula says 18 B x P / N per rank flat, 18 B x P / G with HSDP.

Bytes rank 0 sends per optimizer step, counted as comm_bytes counts them (shared/comm/comm.c: an all-gather or a
reduce-scatter of `count` elements a rank sends count x dtype to every other member; an all-reduce 2 x
ceil(count / W) x dtype; each peer is inside or across the node), from trainer/zero3.c. N = G x M ranks, e the
parameters' bytes (2 bf16 on GPUs, 4 on CPU runs), units u (embedding, L layers, final) of n_u elements, pad_k(n) =
n rounded up to a multiple of 64 k (shared/layout.c), g = the gathers of a step: embedding + final + L + (2A - 1) x
(L - 2) layers (two layer slots; bench_zero3_gpu.py), S_k = sum of pad_k(n_u) over the units, Sg_k = the same over
the g gathers:
  flat:  every collective over all N: per peer  Sg_N / N x e  +  A x S_N / N x 4  +  8 (norm);
         intra = (G - 1) x that, inter = (N - G) x that.
  hpZ:   gathers and the first reduce-scatter over the node (G), the second over the M ranks of this LOCAL_RANK,
         one refresh all-gather over those after the optimizer step, the norm over all N:
         intra = (G - 1) x (Sg_N / G x e + A x S_N / G x 4 + 8);
         inter = (M - 1) x (A x S_N / N x 4 + S_N / N x e) + (N - G) x 8.
  HSDP:  every collective of forward and backward over the node, one all-reduce of each unit's fp32 gradient slice
         (pad_G(n_u) / G elements) over the M replicas per step:
         intra = (G - 1) x (Sg_G / G x e + A x S_G / G x 4 + 8) (0 when G = 1: nothing is gathered or scattered);
         inter = (M - 1) x sum_u 2 x ceil(pad_G(n_u) / G / M) x 4.
Without padding, with P parameters and g' = gathers per parameter per step (about 2A): inter per rank and step is
flat (M-1)/M x P x (g' e + 4A), hpZ (M-1)/N x P x (4A + e), HSDP 8 x P x (M-1) / (G M); flat / hpZ = G x (g' e +
4A) / (4A + e) and flat / HSDP = G x (g' e + 4A) / 8, whatever M. The script checks the exact formula against every
measured row, then evaluates it for the issue's node size (G = 8, M = 4 nodes, bf16) for the 1.5B and 7B shapes,
and models the cross-node time at 400 Gb/s (50 GB/s) per GPU, each GPU its own NIC, full duplex, for a 4 x 8
cluster: N = 32 (G = 8, every GPU a trainer rank) and the issue's N = 28 (G = 7: one rollout GPU per node).
"""
import argparse
import json
import math
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import benchlib
from benchlib import LAYOUT_ALIGN, MemSampler, gpu_mem_mib, server_fixtures, unit_numels, use_devlib, write_data
from server_fixtures import free_port

MODES = ("flat", "hpz", "hsdp")
LINK_BYTES_S = 400e9 / 8  # 400 Gb/s per GPU
# The CPU stand-in's model: Qwen2.5's layer structure (GQA, q/k/v biases, tied embeddings) at a width that trains
# a few steps of 4 ranks on 2 cores in seconds.
CPU_SHAPE = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2)


def qwen_numels(cfg):
    """{HF parameter name: numel} of a tied Qwen2 config (dict with QWEN_SHAPES' keys and vocab_size)."""
    C, I, L, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    hd = C // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out = {"model.embed_tokens.weight": V * C, "model.norm.weight": C}
    for i in range(L):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": C, p + "self_attn.q_proj.weight": q * C,
                    p + "self_attn.k_proj.weight": kv * C, p + "self_attn.v_proj.weight": kv * C,
                    p + "self_attn.q_proj.bias": q, p + "self_attn.k_proj.bias": kv, p + "self_attn.v_proj.bias": kv,
                    p + "self_attn.o_proj.weight": C * q, p + "post_attention_layernorm.weight": C,
                    p + "mlp.gate_proj.weight": I * C, p + "mlp.up_proj.weight": I * C,
                    p + "mlp.down_proj.weight": C * I})
    return out


def shape_units(shape):
    """Unit numels of a QWEN_SHAPES shape, without building it."""
    cfg = dict(benchlib.QWEN_SHAPES[shape], vocab_size=benchlib.QWEN_VOCAB)
    return unit_numels(qwen_numels(cfg), cfg["num_hidden_layers"])


def pad(n, k):
    q = k * LAYOUT_ALIGN
    return (n + q - 1) // q * q


def gathers_per_step(n_layers, A):
    """Layer all-gathers per optimizer step (two layer slots, bench_zero3_gpu.py); embedding and final: one each."""
    return n_layers + (2 * A - 1) * max(n_layers - 2, 0)


def counted_bytes(units, mode, G, M, A, e):
    """(intra-node, inter-node) bytes rank 0 sends in ZeRO collectives per optimizer step (docstring's formula)."""
    N, L = G * M, len(units) - 2
    if len({*units[1:-1]}) > 1:
        raise SystemExit("the gather count assumes layers of one size")

    def sums(k):
        p = [pad(n, k) for n in units]
        return p, sum(p), p[0] + p[-1] + gathers_per_step(L, A) * (p[1] if L else 0)

    if mode == "hsdp":
        p, S, Sg = sums(G)
        intra = (G - 1) * (Sg // G * e + A * S // G * 4 + 8)
        inter = (M - 1) * sum(2 * math.ceil(x // G / M) * 4 for x in p)
        return intra, inter
    p, S, Sg = sums(N)
    if mode == "flat":
        per_peer = Sg // N * e + A * S // N * 4 + 8
        return (G - 1) * per_peer, (N - G) * per_peer
    intra = (G - 1) * (Sg // G * e + A * S // G * 4 + 8)
    inter = (M - 1) * (A * S // N * 4 + S // N * e) + (N - G) * 8
    return intra, inter


def gathers_per_param(units, A):
    """g': elements all-gathered per step over parameters (about 2A; the embedding and final unit once a step)."""
    L = len(units) - 2
    return (units[0] + units[-1] + gathers_per_step(L, A) * (units[1] if L else 0)) / sum(units)


def unpadded_ratios(units, G, A, e):
    """(flat / hpZ, flat / HSDP) cross-node bytes per step from the docstring's formula without padding."""
    g = gathers_per_param(units, A)
    return G * (g * e + 4 * A) / (4 * A + e), G * (g * e + 4 * A) / 8


def flat_ring_bytes(units, G, M, A, e):
    """Flat's cross-node bytes per GPU and step if NCCL routed every collective over rings of all N ranks, node by
    node, one NIC a GPU: each ring crosses the node boundary M times, each crossing carrying (N - 1) / N of the full
    buffer, spread over the N NICs: M (N - 1) / N^2 of each full buffer (the count's direct sends: (M - 1) / M).
    hpZ's and HSDP's cross-node collectives are over one rank a node, where the two agree."""
    N, L = G * M, len(units) - 2
    p = [pad(n, N) for n in units]
    full = (p[0] + p[-1] + gathers_per_step(L, A) * (p[1] if L else 0)) * e + A * sum(p) * 4
    return full * M * (N - 1) / N ** 2


def build_cpu_model(d):
    """The CPU stand-in's small Qwen2.5-shaped model (fp32, tied) with server_fixtures' tokenizer; {name: numel}."""
    import torch
    from transformers import AutoModelForCausalLM
    d.mkdir(parents=True, exist_ok=True)
    tok = server_fixtures.build_tokenizer(d)
    cfg = benchlib.qwen_config("0.5b", vocab_size=server_fixtures.VOCAB_SIZE, bos_token_id=None,
                               eos_token_id=tok.token_to_id(server_fixtures.EOS_TOKEN), **CPU_SHAPE)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(d, safe_serialization=True)
    numels = {n: p.numel() for n, p in model.named_parameters()}
    want = qwen_numels(dict(CPU_SHAPE, vocab_size=server_fixtures.VOCAB_SIZE))
    if numels != want:
        raise SystemExit(f"qwen_numels disagrees with transformers' model: {set(numels.items()) ^ set(want.items())}")
    return numels


class Nodes:
    """The launchers of one run, as one process for benchlib.follow_metrics: poll() is the first exit status."""
    def __init__(self, procs):
        self.procs, self.returncode = procs, None

    def poll(self):
        for p in self.procs:
            if p.poll() is not None:
                self.returncode = p.returncode
                return p.returncode
        return None

    def stop(self):
        for p in self.procs:  # every node at once, so that none waits for a peer that is already stopping
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            benchlib.stop(p, 60)


def mode_args(mode, G):
    """mode: flat, hpz or hsdp, with "-off" for the same run under --overlap-comm false."""
    base, _, off = mode.partition("-")
    return {"flat": ["--sharding-strategy", "full_shard"], "hpz": ["--zero-hpz-partition-size", str(G)],
            "hsdp": ["--sharding-strategy", "hybrid_shard"]}[base] + (["--overlap-comm", "false"] if off else [])


def run(a, tag, M, G, mode, A, model_dir, data, work, cpu, timeout):
    """One run of M launchers of G ranks; returns (metrics rows, node 0's log text, peak MiB per GPU, note)."""
    out, port = work / f"run-{tag}", free_port()
    train = ["--mode", "sft", "--train-file", str(data), "--output-dir", str(out), "--max-prompt-length", "0",
             "--per-device-train-batch-size", str(a.batch), "--gradient-accumulation-steps", str(A),
             "--gradient-checkpointing", "false" if a.stand_in == "cpu" else "true", "--zero-stage", "3",
             "--learning-rate", str(a.lr), "--max-steps", str(a.steps), "--logging-steps", "1", "--save-steps", "0",
             "--seed", "3", "--init-timeout", "600", "--comm-timeout", "600", "--device", "cpu" if cpu else "cuda",
             *mode_args(mode, G)]
    procs, logs = [], []
    base = gpu_mem_mib() if not cpu else {}
    sampler = MemSampler() if not cpu else None
    if sampler:
        sampler.start()
    print(f"== {tag}: {M} node(s) x {G} rank(s), {mode.partition('-')[0]}, grad accum {A}, overlap "
          f"{'off' if mode.endswith('-off') else 'on'}", flush=True)
    for n in range(M):
        cmd = [str(a.build / "bin" / "tandem-train"), "launch", "--model", str(model_dir), "--nnodes", str(M),
               "--node-rank", str(n), "--ranks", str(G), "--servers", "0", "--master-addr", "127.0.0.1",
               "--master-port", str(port), "--log-dir", str(work / f"logs-{tag}-{n}"), "--", *train]
        env = dict(os.environ)
        for k in ("NNODES", "NODE_RANK", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                  "MASTER_PORT", "GROUP_RANK", "GROUP_WORLD_SIZE"):
            env.pop(k, None)
        if cpu:  # several processes on a few cores
            env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        if a.stand_in == "gpu" and M > 1:  # one GPU a node, each its own NCCL host: its network transport between
            env.update(CUDA_VISIBLE_DEVICES="0" if a.same_gpu else str(n), NCCL_HOSTID=f"bench-nodes-{n}",
                       NCCL_NVLS_ENABLE="0")
        elif a.stand_in == "gpu":
            env.update(CUDA_VISIBLE_DEVICES=",".join(str(g) for g in range(G)), NCCL_NVLS_ENABLE="0")
            env.pop("NCCL_HOSTID", None)
        if n == 0:
            print("   " + " ".join(f"{k}={env[k]}" for k in ("CUDA_VISIBLE_DEVICES", "NCCL_HOSTID") if k in env)
                  + " " + " ".join(cmd), flush=True)
        logs.append(work / f"launch-{tag}-{n}.log")
        with open(logs[-1], "w") as log:
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    nodes = Nodes(procs)
    try:
        _, note = benchlib.follow_metrics(nodes, out / "metrics.jsonl", a.steps, timeout,
                                          lambda i, r: print(f"  step {i}: {r['step_time']:.3f} s, loss "
                                                             f"{r['loss']:.4f}", flush=True))
    finally:
        nodes.stop()
        if sampler:
            sampler.halt.set()
            sampler.join()
    text = logs[0].read_text(errors="replace")
    want = [f"node map ({M} nodes of {G} rank{'s' if G > 1 else ''})"] if M > 1 else []
    want.append({"flat": f"ZeRO-3 over {G * M} rank(s):",
                 "hpz": f"ZeRO-3 over {G * M} rank(s), parameters over the {G} of each node (hpZ)",
                 "hsdp": f"ZeRO-3 over {G} rank(s) of each node, replicated over {M} node(s) (HSDP)"}
                [mode.partition("-")[0]])
    if M == 1 and mode != "flat":
        want = []
    want.append("ZeRO collectives over " + ("ZeroMQ" if cpu else "NCCL"))
    missing = [w for w in want if w not in text]
    if not note and missing:
        note = f"node 0's log lacks {missing[0]!r}"
    if note:
        for n, p in enumerate(logs):
            note += benchlib.launch_log_tails(p.read_text(errors="replace"), work / f"logs-{tag}-{n}")
    for n, p in enumerate(logs):
        benchlib.keep_launch_logs(f"nodes_{tag}_{n}", p, work / f"logs-{tag}-{n}")
    peak = {g: m - base.get(g, 0) for g, m in sampler.peak.items()} if sampler else {}
    return benchlib.read_metrics(out / "metrics.jsonl"), text, peak, note


def zero_line(text):
    line = next((ln for ln in text.splitlines() if " parameters, " in ln and "ZeRO-3 over" in ln), "")
    return line.split("tandem-train: ", 1)[-1]


def plan(a, cpu):
    """[(tag, M, G, mode, A)] in the order they run."""
    runs = []
    for A in a.grad_accums:
        if a.stand_in == "cpu":
            runs += [(f"2x2-{m}-a{A}", 2, 2, m, A) for m in MODES]
        else:
            # The slowest (flat across the network) last: a --time-budget cuts it first.
            if not a.same_gpu:
                runs.append((f"1x2-flat-a{A}", 1, 2, "flat", A))
            runs += [(f"2x1-hsdp-a{A}", 2, 1, "hsdp", A), (f"2x1-flat-a{A}", 2, 1, "flat", A)]
    if a.overlap_off:  # the same multi-node runs again with --overlap-comm false, after all the others
        runs += [(f"{tag}-off", M, G, f"{m}-off", A) for tag, M, G, m, A in list(runs) if M > 1]
    return runs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stand-in", choices=["cpu", "gpu"], required=True,
                    help="cpu: 2 nodes x 2 ranks on the CPU backend; gpu: 2 nodes x 1 GPU and 1 node x 2 GPUs")
    ap.add_argument("--build", default="build-cpu", help="folder with bin/tandem-train (gpu: build-gpu.carry)")
    ap.add_argument("--dry-run-cpu", action="store_true",
                    help="gpu stand-in's launches on the CPU backend with the tiny test model (checks this script)")
    ap.add_argument("--same-gpu", action="store_true",
                    help="gpu: both nodes on GPU 0, no one-node baseline (a smoke test on one GPU)")
    ap.add_argument("--shapes", default="1.5b,7b", help="gpu: comma list of QWEN_SHAPES shapes")
    ap.add_argument("--grad-accums", default="1,4", help="comma list of gradient accumulation steps")
    ap.add_argument("--steps", type=int, default=0, help="optimizer steps per run (default: cpu 4, gpu 3)")
    ap.add_argument("--batch", type=int, default=0, help="sequences a rank per micro-step (default: cpu 2, gpu 1)")
    ap.add_argument("--seq-len", type=int, default=0, help="tokens a sequence (default: cpu 128, gpu 512)")
    ap.add_argument("--prompt-len", type=int, default=0, help="of which the prompt (default: a quarter)")
    ap.add_argument("--lr", type=float, default=1e-4, help="learning rate")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per run")
    ap.add_argument("--overlap-off", action="store_true",
                    help="also run every multi-node run with --overlap-comm false, to compare overlap on and off")
    ap.add_argument("--time-budget", type=int, default=-1,
                    help="seconds for the whole script: runs it cuts short or leaves out are listed as not run "
                         "(0: none; default: gpu 450, under gpu-check.sh's 540 s, cpu none)")
    a = ap.parse_args()
    t_start = time.time()
    cpu = a.stand_in == "cpu" or a.dry_run_cpu
    a.build = pathlib.Path(a.build).resolve()
    if not (a.build / "bin" / "tandem-train").exists():
        raise SystemExit(f"{a.build / 'bin' / 'tandem-train'} is not there (--build)")
    if a.dry_run_cpu and a.stand_in != "gpu":
        raise SystemExit("--dry-run-cpu checks the gpu stand-in: give --stand-in gpu")
    a.grad_accums = [int(x) for x in a.grad_accums.split(",")]
    shapes = ["tiny"] if a.dry_run_cpu else ["cpu-qwen"] if a.stand_in == "cpu" else a.shapes.split(",")
    for s in shapes:
        if s not in (*benchlib.QWEN_SHAPES, "tiny", "cpu-qwen"):
            raise SystemExit(f"--shapes: {s} is not one of {', '.join(benchlib.QWEN_SHAPES)}")
    a.steps = a.steps or (4 if a.stand_in == "cpu" else 3)
    if a.time_budget < 0:
        a.time_budget = 450 if a.stand_in == "gpu" and not a.dry_run_cpu else 0
    a.batch = a.batch or (2 if a.stand_in == "cpu" else 1)
    a.seq_len = a.seq_len or (128 if a.stand_in == "cpu" else 512)
    a.prompt_len = a.prompt_len or a.seq_len // 4
    if a.steps < 2:
        raise SystemExit("--steps must be >= 2: the median is over steps 2..N")
    if not 0 < a.prompt_len < a.seq_len - 2:
        raise SystemExit("--prompt-len must be in 1 .. --seq-len - 3")
    use_devlib(a.build)
    if not cpu:
        import torch
        if torch.cuda.device_count() < (1 if a.same_gpu else 2):
            raise SystemExit(f"the gpu stand-in needs 2 GPUs ({torch.cuda.device_count()} visible; --same-gpu: 1)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM still stops the launchers
    e = 4 if cpu else 2
    results, ok = [], True  # (shape, tag, M, G, mode, A, rows, peak, zero line, note)
    unit_sets = {}
    for shape in shapes:
        if a.time_budget and a.time_budget - (time.time() - t_start) < 60:
            print(f"== {shape}: not run (--time-budget {a.time_budget} s spent)", flush=True)
            results += [(shape, tag, M, G, mode, A, [], {}, "", "not run: --time-budget spent")
                        for tag, M, G, mode, A in plan(a, cpu)]
            continue
        with tempfile.TemporaryDirectory() as d:
            d = pathlib.Path(d)
            model_dir = d / "model"
            if shape == "cpu-qwen":
                numels = build_cpu_model(model_dir)
            else:
                model_dir.mkdir()
                numels = benchlib.build_model(model_dir, shape)
                if shape != "tiny" and unit_numels(numels, benchlib.QWEN_SHAPES[shape]["num_hidden_layers"]) != \
                        shape_units(shape):
                    raise SystemExit(f"{shape}: qwen_numels disagrees with transformers' model")
            cfg = json.loads((model_dir / "config.json").read_text())
            unit_sets[shape] = unit_numels(numels, cfg["num_hidden_layers"])
            runs = plan(a, cpu)
            most = max(M * G for _, M, G, _, _ in runs) * a.batch * max(a.grad_accums) * (a.steps + 1)
            data = d / "train.jsonl"
            write_data(data, model_dir / "tokenizer.json", server_fixtures.EOS_TOKEN, most, a.seq_len, a.prompt_len)
            for tag, M, G, mode, A in runs:
                left = a.time_budget - (time.time() - t_start) if a.time_budget else a.timeout
                if left < 30:
                    print(f"== {shape} {tag}: not run (--time-budget {a.time_budget} s spent)", flush=True)
                    results.append((shape, tag, M, G, mode, A, [], {}, "", "not run: --time-budget spent"))
                    continue
                rows, text, peak, note = run(a, f"{shape}-{tag}", M, G, mode, A, model_dir, data, d, cpu,
                                             min(a.timeout, left))
                if note.startswith("timeout") and left < a.timeout:
                    print(f"{shape} {tag}: {note.splitlines()[0]}", flush=True)
                    results.append((shape, tag, M, G, mode, A, [], {}, "", "not run: cut by --time-budget"))
                    continue
                note = note or benchlib.check_sft_rows(rows, a.steps, M * G * a.batch * A * a.seq_len)
                if note:
                    ok = False
                    print(f"{shape} {tag}: FAILED: {note}", flush=True)
                results.append((shape, tag, M, G, mode, A, rows, peak, zero_line(text), note))
    report(a, cpu, e, results, unit_sets, ok)


def fmt_b(x):
    return f"{x / 1e9:.3f} GB" if x >= 1e8 else f"{x / 1e6:.2f} MB"


def report(a, cpu, e, results, unit_sets, ok):
    print()
    where = ("CPU backend, 2 nodes x 2 ranks on one host (ZeroMQ over loopback)" if a.stand_in == "cpu" else
             "CPU backend (dry run of the gpu stand-in)" if cpu else "GPUs: 2 nodes x 1 GPU (NCCL network transport, "
             "NCCL_HOSTID per node) and 1 node x 2 GPUs (NVLink)")
    print(f"{where}; SFT, ZeRO-3, {a.batch} x {a.seq_len} tokens a rank per micro-step, {a.steps} steps a run, "
          f"{'fp32' if e == 4 else 'bf16'} parameters")
    flat = {(s, M, A): rows for s, _, M, G, m, A, rows, _, _, note in results if m == "flat" and rows}
    tol = 1e-5 if cpu else 1e-2
    checks, worst_loss = [], 0.0
    hdr = (f"{'shape':>8} {'nodes x ranks':>13} {'mode':>5} {'A':>2} {'step s':>8} {'cross-node/step':>16} "
           f"{'formula':>14} {'intra-node/step':>16} {'formula':>14} {'loss vs flat':>12}")
    if not cpu:
        hdr += f" {'peak MiB/GPU':>14}"
    lines = [hdr]
    for shape, tag, M, G, mode, A, rows, peak, zline, note in results:
        if not rows or note:
            lines.append(f"{shape:>8} {f'{M} x {G}':>13} {mode:>5} {A:>2} {note.splitlines()[0][:80] if note else ''}")
            continue
        step = statistics.median(r["step_time"] for r in rows[1:])
        f_intra, f_inter = counted_bytes(unit_sets[shape], mode.partition("-")[0], G, M, A, e)
        if M > 1:
            inter = sorted({r["comm/bytes_inter_node"] for r in rows})
            intra = sorted({r["comm/bytes_intra_node"] for r in rows})
            same = inter == [f_inter] and intra == [f_intra]
            checks.append(same)
            meas_x = fmt_b(inter[0]) + ("" if len(inter) == 1 else "+")
            meas_i = fmt_b(intra[0]) + ("" if len(intra) == 1 else "+")
            if not same:
                print(f"{shape} {tag}: counted bytes {inter} / {intra} per step differ from the formula's "
                      f"{f_inter} / {f_intra}", flush=True)
        else:
            meas_x = meas_i = "(one node)"
        ref = flat.get((shape, M, A)) if M > 1 else flat.get((shape, 2, A))
        diff = max((abs(r["loss"] - f["loss"]) / abs(f["loss"]) for r, f in zip(rows, ref)), default=0.0) \
            if ref else float("nan")
        worst_loss = max(worst_loss, diff)
        line = (f"{shape:>8} {f'{M} x {G}':>13} {mode:>5} {A:>2} {step:>8.3f} {meas_x:>16} {fmt_b(f_inter):>14} "
                f"{meas_i:>16} {fmt_b(f_intra):>14} {diff:>12.2e}")
        if not cpu:
            line += f" {', '.join(str(peak[g]) for g in sorted(peak)) or '-':>14}"
        lines.append(line)
        if not cpu and zline:
            lines.append(f"{'':>10}trainer: {zline}")
    if not cpu:
        for shape, units in unit_sets.items():
            P = sum(units)
            lines.append(f"{shape}: state by the formula, per GPU: flat 18 B x P / 2 = {9 * P / 2**30:.1f} GiB, "
                         f"HSDP (G = 1) 18 B x P = {18 * P / 2**30:.1f} GiB (P = {P / 1e9:.3f} G, padded units)")
    for shape, units in unit_sets.items():  # the unpadded formula's ratios against the counted ones
        for A in a.grad_accums:
            meas = {m: rows[0]["comm/bytes_inter_node"] for s, _, M, G, m, A2, rows, _, _, note in results
                    if s == shape and A2 == A and M == 2 and G > 1 and rows and not note}
            if "flat" in meas and len(meas) > 1:
                G = next(G for s, _, M, G, _, _, _, _, _, _ in results if s == shape and M == 2)
                r_hpz, r_hsdp = unpadded_ratios(units, G, A, e)
                lines.append(f"{shape} A={A}, counted flat / mode: " + ", ".join(
                    f"{m} {meas['flat'] / meas[m]:.2f}x" for m in ("hpz", "hsdp") if m in meas) +
                    f"; unpadded formula (g' = {gathers_per_param(units, A):.2f}): hpz G (g'e + 4A) / (4A + e) = "
                    f"{r_hpz:.2f}x, hsdp G (g'e + 4A) / 8 = {r_hsdp:.2f}x")
    for ln in lines:
        print(ln)

    # The formula for the node size and the 4 x 8 cluster, bf16 parameters as GPUs train them.
    model_shapes = {s: unit_sets.get(s) or shape_units(s) for s in ("1.5b", "7b")}
    print()
    print("formula, bf16, per rank and optimizer step, bytes across nodes (ratio: flat / this mode):")
    print(f"{'shape':>6} {'G x M':>6} {'N':>3} {'A':>2} {'flat':>10} {'hpZ':>10} {'HSDP':>10} {'flat/hpZ':>9} "
          f"{'flat/HSDP':>9} {'t flat':>8} {'t hpZ':>8} {'t HSDP':>8} {'flat ring':>10} {'t ring':>7} "
          f"{'ring/hpZ':>8} {'ring/HSDP':>9}")
    at_target = {}
    for shape, units in model_shapes.items():
        for G, M in ((8, 4), (7, 4)):
            for A in a.grad_accums:
                x = {m: counted_bytes(units, m, G, M, A, 2)[1] for m in MODES}
                ring = flat_ring_bytes(units, G, M, A, 2)
                at_target[(shape, G, A)] = x
                print(f"{shape:>6} {f'{G} x {M}':>6} {G * M:>3} {A:>2} {x['flat'] / 1e9:>8.2f}GB "
                      f"{x['hpz'] / 1e9:>8.2f}GB {x['hsdp'] / 1e9:>8.2f}GB {x['flat'] / x['hpz']:>8.1f}x "
                      f"{x['flat'] / x['hsdp']:>8.1f}x " + " ".join(f"{x[m] / LINK_BYTES_S:>7.3f}s" for m in MODES) +
                      f" {ring / 1e9:>8.2f}GB {ring / LINK_BYTES_S:>6.3f}s {ring / x['hpz']:>7.1f}x "
                      f"{ring / x['hsdp']:>8.1f}x")
    print("t: the bytes at 400 Gb/s (50 GB/s) per GPU; flat ring: flat's collectives routed over NCCL rings "
          "(flat_ring_bytes), not what comm_bytes counts")
    summary = f"nodes ({a.stand_in}{' dry run' if a.dry_run_cpu else ''}): "
    if checks:
        summary += (f"counted cross/intra-node bytes = formula in {sum(checks)} of {len(checks)} multi-node runs; ")
    by = {(s, M, m, A): statistics.median(r["step_time"] for r in rows[1:])
          for s, _, M, G, m, A, rows, _, _, note in results if rows and not note}
    for shape in unit_sets:
        for A in a.grad_accums:
            f = by.get((shape, 2, "flat", A))
            parts = [f"{m} {by[(shape, 2, m, A)] / f:.2f}x" for m in ("hpz", "hsdp") if f and (shape, 2, m, A) in by]
            if f and (shape, 1, "flat", A) in by:
                parts.append(f"1-node flat {by[(shape, 1, 'flat', A)] / f:.2f}x")
            if parts:
                summary += f"{shape} A={A} step time vs 2-node flat: " + ", ".join(parts) + "; "
    for (shape, M, m, A), off in sorted(by.items()):  # overlap on against off, same run otherwise
        on = by.get((shape, M, m.partition("-")[0], A)) if m.endswith("-off") else None
        if on:
            slower = on > off * 1.02
            checks.append(not slower)
            summary += (f"{shape} {m[:-4]} A={A} overlap on / off {on / off:.2f}x"
                        f"{' (SLOWER: overlap must not be)' if slower else ''}; ")
    summary += f"max loss diff vs flat {worst_loss:.1e} (tolerance {tol:.0e}); "
    A4 = 4 if 4 in a.grad_accums else max(a.grad_accums)
    for shape in model_shapes:
        x = at_target[(shape, 8, A4)]
        summary += (f"{shape} at G=8 M=4 A={A4}: flat/hpZ {x['flat'] / x['hpz']:.1f}x, flat/HSDP "
                    f"{x['flat'] / x['hsdp']:.1f}x fewer cross-node bytes (target >= 4x), "
                    f"{x['flat'] / LINK_BYTES_S:.2f} / {x['hpz'] / LINK_BYTES_S:.2f} / "
                    f"{x['hsdp'] / LINK_BYTES_S:.2f} s a step at 400 Gb/s; ")
    skipped = [f"{s} {tag}" for s, tag, *_, note in results if note.startswith("not run")]
    if skipped:
        summary += f"not run (--time-budget): {', '.join(skipped)}; "
    bad = not ok or not all(checks) or worst_loss > tol
    print("summary: " + summary.rstrip("; ") + (" (FAILED: see above)" if bad else ""))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
