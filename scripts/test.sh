#!/usr/bin/env bash
# The one test command: installs what is missing, builds everything (CUDA code too when nvcc is present),
# runs the C tests (ctest), the reference/end-to-end tests (pytest), then the sanitizer job. Non-zero exit on any
# failure.
#   scripts/test.sh              everything
#   scripts/test.sh --sanitize   the sanitizer job alone: a clang build with AddressSanitizer + UndefinedBehavior-
#                                Sanitizer (CUDA off, -O1 -g; undefined behaviour and leaks fail) in build-san/ that
#                                runs every C unit test (ctest) and every fuzz target for FUZZ_SECONDS over its
#                                corpus (tests/fuzz/README.md)
#   BUILD_DIR=... SAN_BUILD_DIR=...   the build folders (default build/ and build-san/)
#   JOBS=...                          parallelism (default nproc)
#   FUZZ_SECONDS=...                  how long each fuzz target runs in the sanitizer job (default 10)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"

only_sanitize=0
for arg in "$@"; do
  case "$arg" in
    --sanitize) only_sanitize=1 ;;
    -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "scripts/test.sh: unknown option '$arg' (see --help)" >&2; exit 2 ;;
  esac
done
jobs="${JOBS:-$(nproc)}"

# The sanitizer job. One build serves both halves (one compile instead of two on a 2-core machine): TANDEM_FUZZ=ON
# instruments everything for libFuzzer as well as for ASan + UBSan, and the unit tests run in that build too. Only
# the unit tests and fuzz targets are built (target c_tests), not the binaries, tools or benchmarks.
sanitize() {
  local san="${SAN_BUILD_DIR:-$here/build-san}" secs="${FUZZ_SECONDS:-10}" status=0 t0=$SECONDS t1 t2
  echo "== sanitizer build: clang, ASan + UBSan, CUDA off ($san) =="
  # (|| return: the full run calls this in an || list, where set -e does not stop at a failed build.)
  CC=clang cmake -S . -B "$san" -DTANDEM_FUZZ=ON -DTANDEM_CUDA=OFF >/dev/null || return 1
  cmake --build "$san" -j "$jobs" --target c_tests || return 1
  t1=$SECONDS
  # Leaks fail a test (LeakSanitizer runs at exit); UBSan stops at the first report (-fno-sanitize-recover) and
  # says where it came from.
  export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:detect_stack_use_after_return=1}"
  export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1}"
  echo "== ctest under ASan + UBSan =="
  (cd "$san" && ctest --output-on-failure -j "$jobs") || status=1
  t2=$SECONDS

  echo "== fuzz targets under ASan + UBSan: ${secs} s each over tests/fuzz/corpus/<target> =="
  # libFuzzer writes what it finds into its first folder: a scratch one, so the committed corpus stays as it is.
  local work="$san/fuzz-run" t name
  local -a names=() pids=() corpus=()
  rm -rf "$work"
  mkdir -p "$work"
  for t in "$san"/tests/fuzz_*; do
    [ -x "$t" ] || continue
    name=$(basename "$t")
    mkdir -p "$work/$name/new"
    corpus=()
    [ -d "tests/fuzz/corpus/$name" ] && corpus=("tests/fuzz/corpus/$name")
    "$t" -max_total_time="$secs" -timeout=30 -print_final_stats=1 -artifact_prefix="$work/$name/" \
      "$work/$name/new" "${corpus[@]}" >"$work/$name.log" 2>&1 &
    names+=("$name")
    pids+=($!)
    # At most $jobs at a time (their exit codes stay with bash for the wait below).
    while (($(jobs -rp | wc -l) >= jobs)); do wait -n || true; done
  done
  local i rc
  for i in "${!pids[@]}"; do
    rc=0
    wait "${pids[$i]}" || rc=$?
    name="${names[$i]}"
    if ((rc == 0)); then
      echo "$name: $(sed -n 's/^stat::number_of_executed_units: *//p' "$work/$name.log") runs, no failure"
    else
      status=1
      echo "$name: FAILED (exit $rc); input kept under $work/$name/, last lines of $work/$name.log:"
      tail -n 40 "$work/$name.log"
    fi
  done
  echo "sanitizer job: build $((t1 - t0)) s, ctest $((t2 - t1)) s, fuzz targets $((SECONDS - t2)) s"
  return $status
}

if ((only_sanitize)); then
  TANDEM_SETUP_VENV=0 scripts/setup.sh
  sanitize
  exit
fi

venv=$(scripts/setup.sh | tail -n 1)
build="${BUILD_DIR:-$here/build}"

cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j "$jobs"

status=0
echo "== ctest (C unit tests) =="
(cd "$build" && ctest --output-on-failure -j "$jobs") || status=1
echo "== pytest (reference and end-to-end tests) =="
dirs=(); for d in tests/reference tests/e2e; do [ -d "$d" ] && dirs+=("$d"); done
TANDEM_BUILD_DIR="$build" OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-2}" \
  "$venv/bin/python" -m pytest -q -rs "${dirs[@]}" || status=1
sanitize || status=1
exit $status
