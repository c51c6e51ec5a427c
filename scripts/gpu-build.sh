#!/usr/bin/env bash
# Builds the CUDA tests and benchmarks for sm_90 into build-gpu/ and bundles the shared libraries the GPU
# machine lacks (../shared/gpu/README.md). Then: run the device tool with carry=["build-gpu"] and
# `scripts/gpu-check.sh build-gpu`.
set -euo pipefail
cd "$(dirname "$0")/.."
B=build-gpu
cmake -S . -B $B -DCMAKE_BUILD_TYPE=Release -DTANDEM_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 >/dev/null
cmake --build $B -j "$(nproc)" --target test_cuda_vs_cpu test_model_cuda bench_model_step tandem-serve tandem-train
# Keep only what the GPU machine needs (the carried folder must stay small).
keep=$(mktemp -d)
mkdir -p "$keep/tests" "$keep/bench" "$keep/bin"
cp $B/bin/tandem-serve $B/bin/tandem-train "$keep/bin/"
cp $B/tests/test_cuda_vs_cpu $B/tests/test_model_cuda "$keep/tests/"
cp $B/bench/bench_model_step "$keep/bench/"
rm -rf "$B.carry" && mv "$keep" "$B.carry"
"${BUNDLE_LIBS:-../shared/gpu/bundle-libs}" "$B.carry/devlib" "$B.carry"/tests/* "$B.carry"/bench/* "$B.carry"/bin/*
du -sh "$B.carry"
