"""Transport ipc: trainer ranks on the servers' host copy their ZeRO slices straight into the servers' receive staging
(rollout_server/weight_ipc.h, trainer/weight_sync_ipc.c). On the CPU (what CI runs) the staging is POSIX shared memory
in fp32; on GPUs cudaMalloc blocks shared with CUDA IPC handles, in bf16.

CPU checks:
- two trainer ranks (ZeRO-3) push every step with `--weight-sync-transport ipc` into a server of 2 tensor-parallel
  shards on two engines (--devices cpu,cpu: engine 0's shards' staging is copied into both engines) and a plain
  server; the trainer says it syncs over shared memory, every push moved bytes, both servers end at the last version,
  and each answers (greedy tokens AND logprobs) exactly as a fresh server of its size loaded from the run's last
  checkpoint: every part of every rank's slice landed in its place in every shard (a part written to the wrong
  offset, or missed, changes the logits);
- while the servers run, their weights are in /dev/shm under names that carry their pids (per shard two regions:
  the update is written into one while the live weights are in the other, and the commit swaps them); a server
  stopped cleanly leaves none behind;
- LoRA with lora_sync merged: the ranks write their slices of the merged units into a TP 2 and a plain server, which
  then answer as fresh servers from the checkpoint's merged/ folder;
- a server killed (SIGKILL) in the middle of a run and restarted on the same endpoint gets a new staging (a new
  staging id): the ranks map it anew and the restarted server ends on the last version, equal to a fresh server from
  the final checkpoint. The killed server's shared memory is what a crash leaves behind (docs/training.md says so);
  the test removes it.

GPU (`python3 tests/e2e/test_weight_sync_ipc.py --gpu`; no pytest there): a trainer rank on cuda:0, a TP = 2 server
on cuda:0-1 (shard 0 shares cuda:0 with the trainer rank, the case NCCL cannot hold in one communicator) and, with 3
GPUs or more, a plain server on the last one; 3 pushes over CUDA IPC; synced servers equal fresh ones from the
checkpoint bit for bit. Then the default transport (auto) with the trainer rank and a plain server both on cuda:0:
NCCL refuses that layout, auto says so and falls back to ipc, and the server ends equal to a fresh one. Skips visibly
(exit 77) with fewer than 2 GPUs.
"""
import concurrent.futures
import contextlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from server_fixtures import (BUILD, Skip, TandemServer, build_tiny_model, cuda_devices, free_port,  # noqa: E402
                             skip)
from test_weight_sync_shards import args as shards_trainer_args  # noqa: E402 (one copy of each helper)
from test_weight_sync_shards import greedy, policy_version, write_dataset  # noqa: E402

SHM = pathlib.Path("/dev/shm")


def staging_of(pid):
    return sorted(p.name for p in SHM.glob(f"tandem-ipc-{pid}-*"))


def trainer_args(model_dir, data, out_dir, controls, steps, device, extra=(), transport="ipc"):
    return shards_trainer_args(model_dir, data, out_dir, controls, steps, device, transport) + list(extra)


def start_ranks(d, model_dir, data, out_dir, controls, steps, world, device, extra=(), transport="ipc"):
    if not (BUILD / "bin" / "tandem-train").exists():
        skip(f"{BUILD}/bin/tandem-train is not built")
    port, procs = free_port(), []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NCCL_NVLS_ENABLE="0")
        log = open(d / f"{out_dir.name}-rank{rank}.log", "w")
        procs.append((subprocess.Popen([str(BUILD / "bin" / "tandem-train"),
                                        *trainer_args(model_dir, data, out_dir, controls, steps, device, extra, transport)],
                                       env=env, stdout=log, stderr=subprocess.STDOUT), log))
    return procs


def wait_ranks(d, out_dir, procs, timeout=600):
    try:
        codes = [p.wait(timeout=timeout) for p, _ in procs]
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
            log.close()
    logs = [(d / f"{out_dir.name}-rank{r}.log").read_text(errors="replace") for r in range(len(procs))]
    assert codes == [0] * len(procs), "\n".join(log[-4000:] for log in logs)
    return logs


def same_as_fresh(ckpt, served, tp, server_args=()):
    """A fresh server of tp shards from the checkpoint answers exactly as the synced one did."""
    with TandemServer(ckpt, "--tensor-parallel-size", tp, *server_args, start_timeout=300) as fresh:
        want = greedy(fresh.url)
    assert served == want, f"tensor-parallel size {tp}: synced {served} != fresh from {ckpt.name} {want}"


def setup(d):
    model_dir, data = d / "model", d / "train.jsonl"
    build_tiny_model(model_dir)
    write_dataset(data)
    return model_dir, data


def run(d, gpu):
    """Servers {tp: args}, 3 steps over transport ipc; every server then equals a fresh one from the checkpoint."""
    model_dir, data = setup(d)
    if gpu:
        gpus = cuda_devices()
        if gpus < 2:
            skip(f"transport ipc into a TP = 2 server sharing cuda:0 with the trainer needs 2 CUDA devices; {gpus} "
                 "visible")
        plan = {2: ["--device", "cuda:0", "--kv-cache-memory", "256M"]}
        if gpus >= 3:
            plan[1] = ["--device", f"cuda:{gpus - 1}", "--kv-cache-memory", "256M"]
        world, device, said = 1, "cuda", "weight sync over CUDA IPC (ipc)"
    else:
        plan, world, device, said = {2: ["--devices", "cpu,cpu"], 1: []}, 2, "cpu", \
            "weight sync over shared memory (ipc)"
    controls = {tp: f"tcp://127.0.0.1:{free_port()}" for tp in plan}
    out_dir = d / "run"
    with contextlib.ExitStack() as stack:
        servers = {tp: stack.enter_context(TandemServer(model_dir, "--control", controls[tp], "--tensor-parallel-size",
                                                        tp, *plan[tp], start_timeout=300))
                   for tp in plan}
        before = {tp: greedy(srv.url) for tp, srv in servers.items()}
        logs = wait_ranks(d, out_dir, start_ranks(d, model_dir, data, out_dir, list(controls.values()), 3, world,
                                                  device))
        assert said in logs[0], logs[0]
        rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
        assert len(rows) == 3 and all(r["sync_bytes"] > 0 for r in rows), rows
        served = {tp: greedy(srv.url) for tp, srv in servers.items()}
        if not gpu:   # both engines of the two-engine server answer alike (requests go to the least loaded one)
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                assert all(a == served[2] for a in pool.map(lambda _: greedy(servers[2].url), range(4)))
        assert all(policy_version(srv.url) == 3 for srv in servers.values())
        if not gpu:   # shared memory named after each server's pid: per shard two regions, live and staging
            for tp, srv in servers.items():
                assert len(staging_of(srv.proc.pid)) == 2 * tp, (tp, staging_of(srv.proc.pid))
        pids = [srv.proc.pid for srv in servers.values()]
    assert all(staging_of(pid) == [] for pid in pids), "a server stopped cleanly left its shared memory behind"
    for tp in plan:
        assert served[tp] != before[tp], f"the TP = {tp} server's answer did not change: the weights never arrived"
        same_as_fresh(out_dir / "checkpoint-3", served[tp], tp, plan[tp])
    return rows, sorted(plan)


def test_ipc_transport_into_shards(tmp_path):
    run(tmp_path, gpu=False)


def test_ipc_lora_merged(tmp_path):
    """LoRA with lora_sync merged: each rank writes its slice of the merged units; both servers then answer as a fresh
    one from the checkpoint's merged/ folder (greedy tokens: the merge is computed apart on each side)."""
    d = tmp_path
    model_dir, data = setup(d)
    steps, out_dir = 3, d / "run"
    controls = {tp: f"tcp://127.0.0.1:{free_port()}" for tp in (2, 1)}
    extra = ["--use-peft", "--lora-r", "8", "--lora-alpha", "16", "--lora-target-modules", "all-linear",
             "--lora-dropout", "0", "--lora-save-merged", "--lora-sync", "merged", "--learning-rate", "5e-2"]
    with contextlib.ExitStack() as stack:
        servers = {tp: stack.enter_context(TandemServer(model_dir, "--control", controls[tp], "--tensor-parallel-size",
                                                        tp)) for tp in controls}
        before = {tp: greedy(srv.url)[0] for tp, srv in servers.items()}
        logs = wait_ranks(d, out_dir, start_ranks(d, model_dir, data, out_dir, list(controls.values()), steps, 2,
                                                  "cpu", extra))
        served = {tp: greedy(srv.url)[0] for tp, srv in servers.items()}
        assert all(policy_version(srv.url) == steps for srv in servers.values())
    assert "shared memory (ipc)" in logs[0] and "LoRA r 8" in logs[0], logs[0][-3000:]
    for tp in controls:
        assert served[tp] != before[tp], f"TP {tp}: the merged weights never arrived"
        with TandemServer(out_dir / f"checkpoint-{steps}" / "merged", "--tensor-parallel-size", tp) as fresh:
            assert served[tp] == greedy(fresh.url)[0], tp


def staging_id(server):
    ids = re.findall(r"transport ipc: the weight staging .* \(staging id ([0-9a-f]{16})\)", server.log_text())
    assert len(ids) == 1, server.log_text()[-2000:]
    return ids[0]


def test_ipc_restarted_server_is_mapped_again(tmp_path):
    d = tmp_path
    model_dir, data = setup(d)
    steps = 40
    controls = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    out_dir = d / "run"
    with TandemServer(model_dir, "--control", controls[0], "--tensor-parallel-size", 2) as keep:
        victim = TandemServer(model_dir, "--control", controls[1])
        procs = start_ranks(d, model_dir, data, out_dir, controls, steps, 2, "cpu")
        log0 = d / "run-rank0.log"
        try:
            t0 = time.time()
            while not re.search(r"step 3/", log0.read_text(errors="replace")):
                assert time.time() - t0 < 300 and procs[0][0].poll() is None, log0.read_text()[-3000:]
                time.sleep(0.1)
            first, old_id = staging_of(victim.proc.pid), staging_id(victim)
            assert len(first) == 2, first   # after 2 pushes or more: the live weights and the staging
            victim.stop(signal.SIGKILL)
            # What a crashed server leaves behind: its shared memory (docs/training.md); removed by hand.
            assert staging_of(victim.proc.pid) == first
            for name in first:
                (SHM / name).unlink()
            with TandemServer(model_dir, "--control", controls[1]) as back:
                logs = wait_ranks(d, out_dir, procs)
                served = greedy(back.url)
                assert policy_version(back.url) == steps and policy_version(keep.url) == steps, logs[0][-3000:]
                # The restarted server made a staging of its own, which the ranks mapped to give it the weights.
                assert len(staging_of(back.proc.pid)) == 2 and staging_id(back) != old_id
        finally:
            for p, _ in procs:
                if p.poll() is None:
                    p.kill()
            victim.kill()
    assert "shared memory (ipc)" in logs[0], logs[0][-3000:]
    same_as_fresh(out_dir / f"checkpoint-{steps}", served, 1)


def run_auto(d):
    """GPU: the default transport with the trainer rank and a server on one GPU. NCCL refuses the layout (one
    communicator cannot hold a GPU twice), so auto says so once and carries the weights over ipc from then on; the
    server ends equal to a fresh one from the checkpoint."""
    model_dir, data = setup(d)
    control, out_dir = f"tcp://127.0.0.1:{free_port()}", d / "auto"
    server_args = ["--device", "cuda:0", "--kv-cache-memory", "256M"]
    with TandemServer(model_dir, "--control", control, *server_args, start_timeout=300) as srv:
        logs = wait_ranks(d, out_dir, start_ranks(d, model_dir, data, out_dir, [control], 3, 1, "cuda",
                                                  transport="auto"))
        assert "weight sync over NCCL" in logs[0] and \
            "using transport ipc (the servers' memory on this host) from now on" in logs[0], logs[0][-4000:]
        rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
        assert len(rows) == 3 and all(r["sync_bytes"] > 0 for r in rows), rows
        assert policy_version(srv.url) == 3
        served = greedy(srv.url)
    same_as_fresh(out_dir / "checkpoint-3", served, 1, server_args)
    return rows


if __name__ == "__main__":
    if "--gpu" not in sys.argv:
        sys.exit("usage: test_weight_sync_ipc.py --gpu   (TANDEM_BUILD_DIR: the build)")
    try:
        rows, sizes = run(pathlib.Path(tempfile.mkdtemp(prefix="ipc-gpu-")), True)
        auto = run_auto(pathlib.Path(tempfile.mkdtemp(prefix="ipc-gpu-auto-")))
        print(f"summary: PASS: ipc into servers of tensor-parallel sizes {sizes}, sync ms "
              + " ".join(f"{r['sync_time'] * 1e3:.1f}" for r in rows) + "; auto beside a server on its own GPU fell "
              "back to ipc, sync ms " + " ".join(f"{r['sync_time'] * 1e3:.1f}" for r in auto) + "; each equal to "
              "fresh servers from the checkpoint")
    except Skip as e:
        print(f"summary: SKIP: {e}")
        sys.exit(77)
