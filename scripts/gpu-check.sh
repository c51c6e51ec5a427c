#!/usr/bin/env bash
# Runs on the GPU machine from the repository root, over a folder made here with scripts/gpu-build.sh:
#   scripts/gpu-check.sh [BUILD] [WHAT]
# BUILD: the carried folder (default build-gpu.carry). WHAT (default all), or several joined by commas:
#   tests  every test binary in BUILD/tests (each under a timeout; exit 77 = skipped)
#   train  bench/bench_model_gpu.py (training step vs PyTorch) and, when carried, bench/bench_attention_gpu.py
#   grpo   scripts/gpu-grpo-check.py (GRPO variants A/B/C on 2 GPUs)
#   serve  bench/bench_serve_gpu.py $SERVE_ARGS (e.g. SERVE_ARGS="--shape 1.5b --grpo")
#   sync   bench/bench_sync_gpu.py $SYNC_ARGS (weight-sync bandwidth over NCCL vs a torch GPU0->GPU1 copy)
#   devices  tests/e2e/test_serve_devices.py --gpu (tandem-serve --devices 0,1 vs one engine; needs 2 GPUs)
#   ipc    tests/e2e/test_weight_sync_ipc.py --gpu (GRPO over transport ipc into a TP 2 server on cuda:0-1, shard 0
#          beside the trainer rank on cuda:0, and with 3+ GPUs a plain one; then auto's fallback to ipc beside a
#          server on the trainer's own GPU; skips with fewer than 2 GPUs)
#   structured tests/e2e/test_structured_outputs.py --gpu (regex / json-schema outputs on cuda:0)
#   tp       tests/e2e/test_serve_tensor_parallel.py --gpu (the 405B shape refused on one GPU naming TP 8; TP 2 vs TP 1
#            greedy on 2 GPUs)
#   lora     tests/e2e/test_lora_nccl_sync.py --gpu (LoRA adapter updates over NCCL into a lowrank and a merge server;
#            one GPU is enough: every process its own NCCL_HOSTID)
#   shards tests/e2e/test_weight_sync_shards.py --gpu (GRPO over NCCL into a TP 2 server on cuda:0-1 and a plain one;
#          one GPU: the plain one alone)
#   async  bench/bench_async_gpu.py $ASYNC_ARGS (asynchronous GRPO, issue 24: max_staleness 0 vs 1, 2 on 2 GPUs; e.g.
#          ASYNC_ARGS="--shape 7b --staleness 0,1 --steps 10")
#   zero3  bench/bench_zero3_gpu.py $ZERO3_ARGS (SFT on 1 and all GPUs, ZeRO-3 overlap on vs --overlap-comm false)
#   nodes  bench/bench_nodes.py --stand-in gpu $NODES_ARGS (ZeRO-3 flat vs HSDP on 2 nodes x 1 GPU over NCCL's
#          network transport, flat on 1 node x 2 GPUs; cross-node bytes, memory; needs 2 GPUs)
#   kernels  the kernel benchmarks that were carried: bench/bench_gemm_gpu.py (GEMMs of a training step vs torch),
#          BUILD/bench/bench_elementwise (RMSNorm(+residual)/SwiGLU GB/s), BUILD/bench/bench_attention_paged
#   decode bench/bench_decode_gpu.py $DECODE_ARGS (the decode step alone, no HTTP: GPU time per step vs roofline)
#   demo   `tandem-train demo --device auto` (the README's demo on the GPU), output in $LOGS/demo
#   faults test_comm_nccl_watch, test_comm_nccl, tests/e2e/test_weight_push_faults.py --gpu (a server stalled, killed
#          and restarted during a GRPO run over NCCL; needs 2 GPUs)
# Full logs go to $OUT (or /tmp/gpu-check); a summary table comes last. Builds nothing. Exits 1 when a test fails
# or a script exits non-zero. One device command has 10 minutes: all of it may not fit, run the pieces apart.
# Timeouts: TEST_TIMEOUT (default 300 s per test), BENCH_TIMEOUT (default 540 s per script).
set -uo pipefail
B=${1:-build-gpu.carry}
WHAT=${2:-all}
LOGS=${OUT:-/tmp/gpu-check}
mkdir -p "$LOGS"
# gpu-build.sh ships the binaries and libraries as one xz archive; python3 unpacks it (the machine may lack xz), into
# /tmp when the carried folder is read-only, and BUILD then names the unpacked copy.
if [ ! -d "$B/bin" ] && [ -f "$B/carry.tar.xz" ]; then
  unpack() { python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' \
               "$B/carry.tar.xz" "$1"; }
  if ! unpack "$B" 2>/dev/null; then
    mkdir -p /tmp/tandem-gpu-carry && unpack /tmp/tandem-gpu-carry && B=/tmp/tandem-gpu-carry
  fi
fi
DEVLIB=$(cd "$B" && pwd)/devlib
[ -d "$DEVLIB" ] || echo "gpu-check: no $B/devlib (nor carry.tar.xz): the binaries may miss libraries"
export LD_LIBRARY_PATH=$DEVLIB:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0
nvidia-smi -L
nvidia-smi topo -m > "$LOGS/topo.txt" 2>&1
status=0
summary=()
want() { [[ ",$WHAT," == *",all,"* || ",$WHAT," == *",$1,"* ]]; }

if want tests; then
  for path in "$B"/tests/*; do
    [ -x "$path" ] || continue
    t=$(basename "$path")
    echo "== $t"
    t0=$SECONDS
    timeout "${TEST_TIMEOUT:-300}" "$path" > "$LOGS/$t.txt" 2>&1
    rc=$?
    tail -15 "$LOGS/$t.txt"
    case $rc in
      0) verdict=pass ;;
      77) verdict=skip ;;
      124) verdict="FAIL (timeout ${TEST_TIMEOUT:-300} s)"; status=1 ;;
      *) verdict=FAIL; status=1 ;;
    esac
    echo "$t rc=$rc $verdict"
    summary+=("$(printf '%-26s rc=%-4s %-28s %4d s' "$t" "$rc" "$verdict" $((SECONDS - t0)))")
  done
fi

# run_py NAME CMD...: runs one script under the timeout, log to $LOGS/NAME.txt, prints its tail; the summary
# table keeps its "summary:" line (or its last line).
run_py() {
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  timeout "${BENCH_TIMEOUT:-540}" "$@" > "$LOGS/$name.txt" 2>&1
  local rc=$?
  tail -n "${TAIL:-30}" "$LOGS/$name.txt"
  [ $rc -ne 0 ] && status=1
  local head
  head=$(grep '^summary:' "$LOGS/$name.txt" | tail -1)
  [ -z "$head" ] && head=$(tail -1 "$LOGS/$name.txt")
  summary+=("$(printf '%-26s rc=%-4s %4d s  %s' "$name" "$rc" $((SECONDS - t0)) "${head#summary: }")")
}

if want train; then
  run_py bench_model_gpu python3 bench/bench_model_gpu.py --build "$B"
  if [ -x "$B/bench/bench_attention" ]; then
    TAIL=8 run_py bench_attention_gpu python3 bench/bench_attention_gpu.py --build "$B"
    while IFS= read -r line; do summary+=("    $line"); done < <(grep '^| qwen' "$LOGS/bench_attention_gpu.txt")
  fi
fi
if want grpo; then
  TAIL=45 run_py gpu_grpo_check python3 scripts/gpu-grpo-check.py --build "$B"
fi
if want serve; then
  # shellcheck disable=SC2086  # SERVE_ARGS is a list of flags
  run_py bench_serve_gpu python3 bench/bench_serve_gpu.py --build "$B" ${SERVE_ARGS:-}
fi
if want sync; then
  # shellcheck disable=SC2086
  run_py bench_sync_gpu python3 bench/bench_sync_gpu.py --build "$B" ${SYNC_ARGS:-}
fi
if want devices; then
  TANDEM_BUILD_DIR=$B run_py serve_devices python3 tests/e2e/test_serve_devices.py --gpu
fi
if want tp; then
  TANDEM_BUILD_DIR=$B run_py serve_tp python3 tests/e2e/test_serve_tensor_parallel.py --gpu
fi
if want lora; then
  TANDEM_BUILD_DIR=$B run_py lora_nccl python3 tests/e2e/test_lora_nccl_sync.py --gpu
fi
if want shards; then
  TANDEM_BUILD_DIR=$B run_py sync_shards python3 tests/e2e/test_weight_sync_shards.py --gpu
fi
if want ipc; then
  TANDEM_BUILD_DIR=$B run_py sync_ipc python3 tests/e2e/test_weight_sync_ipc.py --gpu
fi
if want structured; then
  TANDEM_BUILD_DIR=$B run_py serve_structured python3 tests/e2e/test_structured_outputs.py --gpu
fi
if want async; then
  # shellcheck disable=SC2086
  TAIL=45 run_py bench_async_gpu python3 bench/bench_async_gpu.py --build "$B" ${ASYNC_ARGS:-}
fi
if want zero3; then
  # shellcheck disable=SC2086
  run_py bench_zero3_gpu python3 bench/bench_zero3_gpu.py --build "$B" ${ZERO3_ARGS:-}
fi
if want nodes; then
  # shellcheck disable=SC2086
  TAIL=60 run_py bench_nodes python3 bench/bench_nodes.py --stand-in gpu --build "$B" ${NODES_ARGS:-}
fi
if want kernels; then
  [ -f bench/bench_gemm_gpu.py ] && TAIL=40 run_py bench_gemm_gpu python3 bench/bench_gemm_gpu.py --build "$B"
  [ -x "$B/bench/bench_elementwise" ] && TAIL=30 run_py bench_elementwise "$B/bench/bench_elementwise"
  if [ -x "$B/bench/bench_attention_paged" ]; then
    TAIL=40 run_py bench_attention_paged "$B/bench/bench_attention_paged"
  fi
fi
if want decode; then
  TAIL=60 run_py bench_decode_gpu python3 bench/bench_decode_gpu.py --build "$B" ${DECODE_ARGS:-}
fi
if want faults; then
  # A rollout server or rank that dies or stalls: the weight-sync communicator's peer watch, the nccl backend's
  # failure cases, and a GRPO run over NCCL whose server is stopped, killed and restarted (issue 22).
  TAIL=12 run_py comm_nccl_watch "$B/tests/test_comm_nccl_watch"
  TAIL=12 run_py comm_nccl "$B/tests/test_comm_nccl"
  TANDEM_BUILD_DIR=$B TAIL=20 run_py weight_push_faults python3 tests/e2e/test_weight_push_faults.py --gpu
fi
if want demo; then
  TAIL=12 run_py demo "$B/bin/tandem-train" demo --output-dir "$LOGS/demo" --device auto
fi

echo
echo "== summary ($B, $WHAT; logs in $LOGS)"
for line in "${summary[@]}"; do echo "$line"; done
echo "gpu-check: $([ $status -eq 0 ] && echo PASS || echo FAIL)"
exit $status
