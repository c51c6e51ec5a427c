#!/usr/bin/env bash
# Builds the CUDA tests, benchmarks and binaries for sm_90 into BUILD (default build-gpu) and packs what the GPU
# machine needs into BUILD.carry/carry.tar.xz (bin/, tests/, bench/, and devlib/: the shared libraries that machine
# lacks, ../shared/gpu/README.md). Then: run the device tool with carry=["build-gpu.carry"] and
# `scripts/gpu-check.sh build-gpu.carry [all|tests|train|grpo|serve|sync|zero3|devices|kernels|demo]`, which unpacks
# it first (the bench scripts expect the unpacked folder: start them through gpu-check.sh, or unpack by hand).
#   scripts/gpu-build.sh [BUILD]
# Optional pieces (tests and benchmarks other people are still writing) are built when their source exists.
set -euo pipefail
cd "$(dirname "$0")/.."
B=${1:-build-gpu}
TESTS=(test_cuda_vs_cpu test_model_cuda)
for t in test_model_lora_cuda test_model_lora_rows test_cuda_qkv_rope test_cuda_matmul_fused test_cuda_attention test_cuda_attention_paged test_cuda_attention_decode test_cuda_sample test_comm_nccl test_comm_nccl_watch test_comm_nccl_graph test_cuda_peer_all_reduce test_trainer_zero3_cuda test_cuda_graph_decode test_rollout_engine_group test_rollout_model_runner test_decode_narrow_tables; do
  if [ -f "tests/unit/$t.c" ]; then TESTS+=("$t"); else echo "gpu-build: tests/unit/$t.c not there; left out"; fi
done
BENCHES=(bench_model_step)
for b in bench_attention bench_gemm bench_elementwise bench_attention_paged bench_decode_step bench_sample; do
  if [ -f "bench/$b.c" ]; then BENCHES+=("$b"); else echo "gpu-build: bench/$b.c not there; left out"; fi
done
cmake -S . -B "$B" -DCMAKE_BUILD_TYPE=Release -DTANDEM_CUDA=ON -DTANDEM_CPU_ARCH=x86-64-v3 -DCMAKE_CUDA_ARCHITECTURES=90 >/dev/null
cmake --build "$B" -j "$(nproc)" --target tandem-serve tandem-train "${TESTS[@]}" "${BENCHES[@]}"
# Keep only what the GPU machine needs (the carried folder must stay small).
keep=$(mktemp -d)
mkdir -p "$keep/tests" "$keep/bench" "$keep/bin"
cp "$B/bin/tandem-serve" "$B/bin/tandem-train" "$keep/bin/"
for t in "${TESTS[@]}"; do cp "$B/tests/$t" "$keep/tests/"; done
for b in "${BENCHES[@]}"; do cp "$B/bench/$b" "$keep/bench/"; done
rm -rf "$B.carry" && mv "$keep" "$B.carry"
"${BUNDLE_LIBS:-../shared/gpu/bundle-libs}" "$B.carry/devlib" "$B.carry"/tests/* "$B.carry"/bench/* "$B.carry"/bin/*
# The libraries are 50 MB (OpenBLAS alone 36 MB) and every binary carries the same ~4 MB of CUDA kernels, while the
# carry limit is 64 MiB: ship everything as one solid xz archive (about 15 MB); scripts/gpu-check.sh unpacks it there.
tar -C "$B.carry" -cJf "$B.carry.tar.xz" bin tests bench devlib
rm -rf "$B.carry"/* && mv "$B.carry.tar.xz" "$B.carry/carry.tar.xz"
echo "gpu-build: carried tests: ${TESTS[*]}; benches: ${BENCHES[*]}"
du -sh "$B.carry"
