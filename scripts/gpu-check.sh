#!/usr/bin/env bash
# Runs on the GPU machine from the repository root, over a build made here with scripts/gpu-build.sh:
# every CUDA test, then the GPU benchmark; prints a short table last. Builds nothing.
set -uo pipefail
B=${1:-build-gpu}
export LD_LIBRARY_PATH=$PWD/$B/devlib:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0
nvidia-smi -L
status=0
# $2 = all (default) | train | serve | grpo: which benchmarks to run after the tests.
for t in test_cuda_vs_cpu test_model_cuda; do
  echo "== $t"; "$B/tests/$t" > "${OUT:-/tmp}/$t.txt" 2>&1; rc=$?; tail -25 "${OUT:-/tmp}/$t.txt"
  echo "$t rc=$rc"; [ $rc -ne 0 ] && status=1
done
echo "== bench"
case "${2:-all}" in
  all|train) python3 bench/bench_model_gpu.py --build "$B" 2>&1 | tee "${OUT:-/tmp}/bench_model_gpu.txt" | tail -6 ;;
esac
case "${2:-all}" in
  all|grpo) python3 scripts/gpu-grpo-check.py --build "$B" 2>&1 | tee "${OUT:-/tmp}/gpu_grpo.txt" | tail -6 || status=1 ;;
esac
case "${2:-all}" in
  all|serve) python3 bench/bench_serve_gpu.py --build "$B" 2>&1 | tee "${OUT:-/tmp}/bench_serve_gpu.txt" | tail -8 ;;
esac
exit $status
