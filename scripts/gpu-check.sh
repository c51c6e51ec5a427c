#!/usr/bin/env bash
# Runs on the GPU machine from the repository root, over a build made here with scripts/gpu-build.sh:
# every CUDA test, then the GPU benchmark; prints a short table last. Builds nothing.
set -uo pipefail
B=${1:-build-gpu}
export LD_LIBRARY_PATH=$PWD/$B/devlib:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0
nvidia-smi -L
status=0
for t in test_cuda_vs_cpu test_model_cuda; do
  echo "== $t"; "$B/tests/$t" > "${OUT:-/tmp}/$t.txt" 2>&1; rc=$?; tail -25 "${OUT:-/tmp}/$t.txt"
  echo "$t rc=$rc"; [ $rc -ne 0 ] && status=1
done
echo "== bench"
python3 bench/bench_model_gpu.py --build "$B" 2>&1 | tee "${OUT:-/tmp}/bench_model_gpu.txt" | tail -6
exit $status
