"""Weight-sync bandwidth, trainer GPU0 -> rollout server GPU1, beside a torch GPU0 -> GPU1 copy in the same run.

    python3 bench/bench_sync_gpu.py --build build-gpu.carry [--shape 1.5b] [--steps 8] [--transports nccl[,zmq,ipc]]

A random Qwen2.5-1.5B-shaped model (bf16, tied embeddings) is saved once. tandem-serve --device cuda runs on GPU1
(CUDA_VISIBLE_DEVICES=1, or --device cuda:1 with --server-gpu index) with --control; one tandem-train rank runs on
GPU0 with --weight-sync-transport T and tiny rollouts (2 prompts' worth: 2 completions of at most 4 tokens, prompts
of at most 32 tokens), so each step is dominated by the push of the whole model. Every step pushes; metrics.jsonl
gives sync_time per step (the whole push as rank 0 sees it: weights_begin, the transfer, the server's swap at
weights_end). Step 1 also creates the NCCL communicator, so it is reported apart; the bandwidth is the model's
bytes over the median sync_time of the other steps:
  model GB/s = bf16 bytes of the model / seconds (the rate at which the server's copy of the model is replaced);
  wire GB/s  = bytes the trainer sent / seconds (GPU ranks send bf16 over every transport; CPU ranks fp32).
Transport ipc (same host): the server keeps its receive staging (the second copy of its weights) in CUDA IPC memory
and the trainer rank copies its slices straight into it (cudaMemcpyAsync / cudaMemcpy2DAsync from the rank's GPU:
within one GPU for a shard beside the trainer, peer to peer for the others); weights_end then swaps staging and live
weights. Step 1 (and step 2: the second region) includes mapping the server's handles. With --server-gpu same
--server-tp 2 that is issue 26's layout (shard 0 on the trainer's GPU).
When metrics.jsonl carries "sync_bytes" (bytes sent by all ranks in that step's push) the wire figure uses it.
Baseline: torch copies a 1 GiB tensor cuda:0 -> cuda:1 (GB/s = bytes / time, one direction).
The trainer is stopped once its last metrics row is written: its final checkpoint (about 25 GB for 1.5B, model
plus optimizer state) would only cost time here.
--dry-run-cpu checks this script without GPUs: the tiny test model, trainer and server on the CPU backend, zmq.
--lora-r R trains LoRA adapters instead (--use-peft, rank R, alpha 2R, every projection) and runs one push per
--lora-syncs value and --transports value: adapter (the A and B matrices alone: fp32 masters over zmq, bf16 units
over nccl), once per --adapter-update-modes value of the server (merge: into a working copy of the base; lowrank: the
extra GEMMs), and merged (the base with the adapters merged in, whole weights); the table then gives each push's
bytes and time. --server-gpu same puts the server on the trainer's GPU (nccl then runs over NCCL's network transport,
each process its own NCCL_HOSTID: it checks the path, its time is not NVLink's).
--ranks R runs R trainer ranks (ZeRO-3, GPUs 0..R-1; each sends its own slices). --server-tp N runs a tensor-parallel
server of N shards (issue 26): on GPUs R..R+N-1 (cvd, index), or on GPUs 0..N-1 with --server-gpu same, shard 0 beside
the trainer (the issue's layout for 2 GPUs; network transport as above). Issue 31's "TP 2 server fed by 2 ranks" on 4
GPUs: --ranks 2 --server-tp 2 --server-gpu index;
over nccl each shard receives only its parts of the trainer's slices. The summary then extrapolates a 72B push
(Qwen2.5-72B: 72.7 B params, 145 GB bf16) from the measured model rate, and says it is extrapolated.
The dry run takes --transports nccl too: CPU trainer and server over the host communicator (nccl's CPU twin); and
ipc: POSIX shared memory between the CPU trainer and the CPU server (ipc's CPU twin).
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import torch

import benchlib
from benchlib import build_model, server_fixtures, use_devlib
from server_fixtures import free_port


def qwen72b_params():
    """Qwen2.5-72B's parameters (config.json: hidden 8192, MLP 29568, 80 layers, 64 heads, 8 KV heads of 128, vocabulary
    152064, untied embeddings, q/k/v biases)."""
    C, I, L, KV, V = 8192, 29568, 80, 8 * 128, 152064
    layer = C * C + C + 2 * (C * KV + KV) + C * C + 3 * C * I + 2 * C
    return L * layer + 2 * V * C + C


def run_sync(build, model_dir, data, work, transport, steps, select, timeout, extra_env=None, tag=None,
             extra_args=(), server_args=(), server_tp=1, ranks=1):
    """Returns (metrics rows, rank-0 log, note). select: cvd | index | same | cpu (dry run). extra_env: variables
    set for both the trainer and the server (an NCCL tuning variant); tag names the run's folder and logs.
    server_args: more tandem-serve options. With select same and transport nccl, trainer and server get their own
    NCCL_HOSTID: one GPU cannot hold two members of a communicator otherwise (NCCL then takes its network
    transport between them: a correctness run, not a speed one)."""
    control = f"tcp://127.0.0.1:{free_port()}"
    # The server's GPUs follow the trainer ranks' (cuda:0 .. ranks-1), or start at 0 with select same.
    gpus = ",".join(str(ranks + k) for k in range(server_tp))
    sargs, senv = {"cvd": (["--device", "cuda"], {"CUDA_VISIBLE_DEVICES": gpus}),
                   "index": (["--device", f"cuda:{ranks}"], {}), "same": (["--device", "cuda:0"], {}),
                   "cpu": (["--device", "cpu"], {})}[select]
    sargs = sargs + ["--tensor-parallel-size", str(server_tp)]
    senv = dict(senv, **(extra_env or {}))
    tenv = dict(extra_env or {})
    if select == "same" and transport == "nccl":
        senv["NCCL_HOSTID"], tenv["NCCL_HOSTID"] = "bench-sync-server", "bench-sync-trainer"
    tag = tag or transport
    out = work / f"run-{tag}"
    args = [str(build / "bin" / "tandem-train"), "--model", str(model_dir), "--train-file", str(data),
            "--output-dir", str(out), "--rollout-servers", control, "--rewards", "regex_format",
            "--format-regex", "[0-9]", "--format-regex-mode", "search", "--num-generations", "2",
            "--per-device-train-batch-size", "2", "--max-completion-length", "4", "--max-prompt-length", "32",
            "--learning-rate", "1e-6", "--max-steps", str(steps), "--logging-steps", "1", "--save-steps", "0",
            "--seed", "3", "--init-timeout", "120", "--comm-timeout", "120", "--rollout-timeout", "120",
            "--device", "cpu" if select == "cpu" else "cuda", "--weight-sync-transport", transport, *extra_args]
    port = free_port()
    log_path = work / f"train-{tag}.log"
    metrics = out / "metrics.jsonl"
    with server_fixtures.TandemServer(model_dir, "--control", control, "--kv-cache-memory", "2G", *sargs, *server_args,
                                      env=senv, start_timeout=300) as srv, open(log_path, "w") as log:
        procs = []
        for rank in range(ranks):   # rank 0 logs to log_path; the others' output is dropped
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), **tenv)
            if "NCCL_HOSTID" in tenv:
                env["NCCL_HOSTID"] = f"{tenv['NCCL_HOSTID']}-{rank}"
            procs.append(subprocess.Popen(args, env=env, stdout=log if rank == 0 else subprocess.DEVNULL,
                                          stderr=subprocess.STDOUT))
        _, note = benchlib.follow_metrics(procs[0], metrics, steps, timeout, what="tandem-train")
        for p in procs:
            benchlib.stop(p, 30, group=False)
        server_log = srv.log_text()
    text = log_path.read_text(errors="replace")
    if note:
        note += f"\n--- trainer log (tail)\n{text[-3000:]}\n--- server log (tail)\n{server_log[-2000:]}"
    return benchlib.read_metrics(metrics), text, note


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build-gpu.carry")
    ap.add_argument("--shape", choices=list(benchlib.QWEN_SHAPES), default="1.5b")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--transports", default="nccl", help="comma-separated: nccl, zmq, ipc, auto")
    ap.add_argument("--server-gpu", choices=["cvd", "index", "same"], default="cvd")
    ap.add_argument("--lora-r", type=int, default=0, help="train LoRA adapters of this rank (0: the whole model)")
    ap.add_argument("--lora-syncs", default="adapter,merged", help="with --lora-r: comma-separated lora_sync values")
    ap.add_argument("--adapter-update-modes", default="merge",
                    help="with --lora-r and lora_sync adapter: comma-separated tandem-serve --adapter-update-mode values")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per training run")
    ap.add_argument("--nccl-variants", default="",
                    help="semicolon-separated NCCL tuning variants, each a comma- or space-separated list of VAR=VALUE set for "
                         "trainer and server, run with transport nccl after the --transports runs "
                         "(e.g. 'NCCL_P2P_NVL_CHUNKSIZE=2097152;NCCL_MIN_P2P_NCHANNELS=32,NCCL_P2P_NVL_CHUNKSIZE=1048576')")
    ap.add_argument("--server-tp", type=int, default=1, help="the server's tensor-parallel shards")
    ap.add_argument("--ranks", type=int, default=1, help="trainer ranks (ZeRO-3), on cuda:0 .. ranks-1")
    ap.add_argument("--dry-run-cpu", action="store_true")
    args = ap.parse_args()
    build = pathlib.Path(args.build).resolve()
    use_devlib(build)
    server_fixtures.BUILD = build
    copy = float("nan") if args.dry_run_cpu or torch.cuda.device_count() < 2 else benchlib.p2p_copy_gbs()
    print(f"torch copy cuda:0 -> cuda:1, 1 GiB: {copy:.1f} GB/s", flush=True)
    results, ok = [], True
    with tempfile.TemporaryDirectory() as d:
        d = pathlib.Path(d)
        model_dir = d / "model"
        model_dir.mkdir()
        params = sum(build_model(model_dir, "tiny" if args.dry_run_cpu else args.shape).values())
        data = d / "train.jsonl"
        with open(data, "w") as f:
            for i in range(64):
                f.write(json.dumps({"prompt": f"numbers plus question {i}"}) + "\n")
        lora_args = {}
        if args.lora_r:
            r = args.lora_r
            cfg = json.loads((model_dir / "config.json").read_text())
            C, I, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
            D = C // cfg["num_attention_heads"]
            KV = cfg["num_key_value_heads"] * D
            adapter_params = r * L * ((C + C) + 2 * (C + KV) + (C + C) + 3 * (C + I))
            print(f"LoRA r {r} on every projection: {adapter_params / 1e6:.1f} M adapter params "
                  f"({4 * adapter_params / 1e6:.0f} MB fp32)", flush=True)
            runs, server_args = [], {}
            for s in args.lora_syncs.split(","):
                for t in args.transports.split(","):
                    for mode in args.adapter_update_modes.split(",") if s == "adapter" else [""]:
                        tag = f"lora-{s}-{t}" + (f"-{mode}" if mode else "")
                        lora_args[tag] = ["--use-peft", "--lora-r", str(r), "--lora-alpha", str(2 * r),
                                          "--lora-target-modules", "all-linear", "--lora-dropout", "0",
                                          "--lora-sync", s]
                        server_args[tag] = ["--adapter-update-mode", mode] if mode else []
                        runs.append((t, tag, {}))
        else:
            runs = [(t, t, {}) for t in args.transports.split(",")]
        for i, v in enumerate(x for x in args.nccl_variants.split(";") if x.strip()):
            env = dict(kv.split("=", 1) for kv in v.replace(",", " ").split())
            runs.append(("nccl", f"nccl-v{i + 1}", env))
            print(f"nccl-v{i + 1}: {' '.join(f'{k}={val}' for k, val in env.items())}")
        for transport, tag, extra_env in runs:
            rows, log, note = run_sync(build, model_dir, data, d, transport, args.steps,
                                       "cpu" if args.dry_run_cpu else args.server_gpu, args.timeout, extra_env, tag,
                                       lora_args.get(tag, ()), server_args.get(tag, ()) if args.lora_r else (),
                                       args.server_tp, args.ranks)
            want = "weight sync over " + (
                ("shared memory (ipc)" if args.dry_run_cpu else "CUDA IPC (ipc)") if transport == "ipc" else
                "ZeroMQ" if transport == "zmq" or (transport == "auto" and args.dry_run_cpu) else
                "the host communicator" if args.dry_run_cpu else "NCCL")
            if not note and want not in log:
                note = f"the trainer's start line lacks {want!r}"
            fallback = next((ln.split("tandem-train: ", 1)[-1] for ln in log.splitlines()
                             if "from now on" in ln and "weight sync over NCCL" in ln), "")
            if fallback:  # auto: where NCCL could not reach the servers, what carried the weights instead
                print(f"{tag}: {fallback}", flush=True)
            if note or len(rows) < 2:
                ok = False
                print(f"{tag}: FAILED: {note or 'fewer than 2 steps'}")
                continue
            syncs = [r["sync_time"] for r in rows]
            rest = sorted(syncs[1:])
            med = rest[len(rest) // 2]
            model_bytes = 2 * params
            if all("sync_bytes" in r for r in rows[1:]):
                wire = sorted(r["sync_bytes"] / r["sync_time"] for r in rows[1:])[len(rows[1:]) // 2]
                wire_src = "sync_bytes"
            else:
                wire = (4 if args.dry_run_cpu else 2) * params / med
                wire_src = "params x dtype"
            step = sorted(r["step_time"] for r in rows[1:])[len(rows[1:]) // 2]
            # The sending alone (no control round trips, no swap), when the trainer reports it.
            xfer = sorted(r.get("sync_transfer_time", float("nan")) for r in rows[1:])[len(rows[1:]) // 2]
            parts = {k: sorted(r.get(k, float("nan")) for r in rows[1:])[len(rows[1:]) // 2]
                     for k in ("sync_begin_time", "sync_transfer_time", "sync_end_time", "sync_commit_time")}
            print(f"{tag}: median parts of a push (ms): " + ", ".join(f"{k[5:-5]} {v * 1e3:.2f}" for k, v in
                                                                      parts.items()) +
                  f"; unaccounted {(med - parts['sync_begin_time'] - xfer - parts['sync_end_time']) * 1e3:.2f}",
                  flush=True)
            results.append((tag, syncs[0], med, min(rest), model_bytes / med / 1e9, wire / 1e9, wire_src,
                            step, model_bytes / xfer / 1e9 if xfer > 0 else float("nan")))
            print(f"{tag}: sync per step " + " ".join(f"{s:.4f}" for s in syncs) + " s", flush=True)
            if tag in lora_args:
                mem = [ln for ln in log.splitlines() if "LoRA r" in ln][:1]
                print(f"{tag}: {rows[-1].get('sync_bytes', float('nan')) / 1e6:.1f} MB per push, median "
                      f"{med * 1e3:.1f} ms (sending {xfer * 1e3:.1f} ms, server commit "
                      f"{parts['sync_commit_time'] * 1e3:.1f} ms), step {step:.3f} s; {' '.join(mem)}", flush=True)
    gpu = "no GPU (dry run)" if args.dry_run_cpu else \
        f"GPU {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}"
    print(f"{gpu}, {'tiny test model' if args.dry_run_cpu else 'Qwen2.5-' + args.shape.upper() + ' shape'} "
          f"({params / 1e6:.0f} M params, {2 * params / 1e9:.2f} GB bf16), {args.ranks} trainer rank(s) -> 1 server "
          f"{'of ' + str(args.server_tp) + ' shards ' if args.server_tp > 1 else ''}"
          f"({'GPU0' if args.server_gpu == 'same' else 'GPU1'}{'..' if args.server_tp > 1 else ''}), "
          f"torch={torch.__version__}")
    print(f"{'run':<26}{'step 1 s':>10}{'median s':>10}{'best s':>9}{'model GB/s':>12}{'wire GB/s':>11}"
          f"{'send GB/s':>11}{'torch p2p GB/s':>16}{'model/p2p':>11}{'send/p2p':>10}{'step s':>9}")
    for t, first, med, best, model_gbs, wire_gbs, src, step, send_gbs in results:
        print(f"{t:<26}{first:>10.4f}{med:>10.4f}{best:>9.4f}{model_gbs:>12.1f}{wire_gbs:>11.1f}{send_gbs:>11.1f}"
              f"{copy:>16.1f}{model_gbs / copy:>10.2f}x{send_gbs / copy:>9.2f}x{step:>9.3f}   (wire bytes from {src})")
    print("model GB/s: the whole push (weights_begin, sends, the server's swap at weights_end); send GB/s: the "
          "sending alone (sync_transfer_time)")
    q72 = 2 * qwen72b_params()
    print("summary: sync " + "; ".join(f"{t} {m:.1f} GB/s = {m / copy:.0%} of p2p copy {copy:.0f} GB/s "
                                       f"({sg / copy:.0%} sending alone), {med * 1e3:.1f} ms per push; 72B "
                                       f"({q72 / 1e9:.0f} GB) at this rate {q72 / (m * 1e9):.1f} s (extrapolated)"
                                       for t, _, med, _, m, _, _, _, sg in results)
          + ("" if ok else " (FAILED runs above)"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
