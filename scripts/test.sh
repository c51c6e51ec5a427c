#!/usr/bin/env bash
# The one test command: installs what is missing, builds everything (CUDA code too when nvcc is present),
# runs the C tests (ctest) and the reference/end-to-end tests (pytest). Non-zero exit on any failure.
#   scripts/test.sh            everything
#   BUILD_DIR=... JOBS=...     override the build folder (default build/) and parallelism (default nproc)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
venv=$(scripts/setup.sh | tail -n 1)
build="${BUILD_DIR:-$here/build}"
jobs="${JOBS:-$(nproc)}"

cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j "$jobs"

status=0
echo "== ctest (C unit tests) =="
(cd "$build" && ctest --output-on-failure -j "$jobs") || status=1
echo "== pytest (reference and end-to-end tests) =="
dirs=(); for d in tests/reference tests/e2e; do [ -d "$d" ] && dirs+=("$d"); done
TANDEM_BUILD_DIR="$build" OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-2}" \
  "$venv/bin/python" -m pytest -q -rs "${dirs[@]}" || status=1
exit $status
