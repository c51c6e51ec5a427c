#!/usr/bin/env bash
# Nsight Compute on the GPU machine (its CUDA install has `ncu`; the development machine has none): where the time
# of one decode step goes, kernel by kernel, and why the paged attention moves the bytes it does.
#   scripts/gpu-ncu.sh CARRY_DIR step  [SHAPE=0.5b BATCH=512 CTX=512]  per-kernel GPU time of one decode step
#   scripts/gpu-ncu.sh CARRY_DIR attn  [HQ=14 HKV=2 D=64 BATCH=512 CTX=512]  full report of one paged-attention call
#   scripts/gpu-ncu.sh CARRY_DIR train [SHAPE=1.5b FLAGS=--adamw BATCH=8 SEQ=1024]  per-kernel GPU time of one
#                                                                           training step (bench_model_step)
#   KERNEL=regex [SKIP=3] scripts/gpu-ncu.sh CARRY_DIR kernel COMMAND [ARGS]  full report of one launch of a kernel
# CARRY_DIR is what scripts/gpu-check.sh unpacked (e.g. /tmp/tandem-gpu-carry). Kernels are profiled one at a
# time with warm caches and boost clocks left alone (--cache-control none --clock-control none), so the step's
# per-kernel times add up close to its graph replay; the raw CSV lands in $OUT (or /tmp) for later reading.
set -euo pipefail
B=${1:?carry dir}
WHAT=${2:-step}
OUT=${OUT:-/tmp}
export LD_LIBRARY_PATH="$B/devlib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
cd "$(dirname "$0")/.."

# Per-kernel table of the last step in an ncu CSV: kernel_table CSV MARK end|start.
kernel_table() {
  python3 - "$@" <<'EOF'
import csv, sys, collections
rows = [r for r in csv.DictReader(l for l in open(sys.argv[1]) if l.startswith('"'))]
rows = [r for r in rows if r.get("gpu__time_duration.sum", "").replace(".", "").replace(",", "").isdigit()]
def num(r, k): return float(r[k].replace(",", ""))
# The last step: MARK names a step's last kernel (end: the launches between the last two) or its first (start:
# the launches from the last one on).
mark, where = sys.argv[2], sys.argv[3]
ms = [i for i, r in enumerate(rows) if mark in r["Kernel Name"]]
if where == "end":
    step = rows[ms[-2] + 1: ms[-1] + 1] if len(ms) >= 2 else rows
else:
    step = rows[ms[-1]:] if ms else rows
by = collections.OrderedDict()
for r in step:
    name = r["Kernel Name"].split("(")[0].split("<")[0][:60]
    t = num(r, "gpu__time_duration.sum")  # ns
    byt = num(r, "dram__bytes_read.sum") + num(r, "dram__bytes_write.sum")
    a = by.setdefault(name, [0, 0.0, 0.0])
    a[0] += 1; a[1] += t; a[2] += byt
total = sum(a[1] for a in by.values())
print(f"{'kernel':60} {'calls':>5} {'us':>9} {'share':>6} {'GB/s':>7}")
for name, (n, t, byt) in sorted(by.items(), key=lambda kv: -kv[1][1]):
    print(f"{name:60} {n:5d} {t/1e3:9.1f} {100*t/total:5.1f}% {byt/t if t else 0:7.0f}")
print(f"{'total (kernels back to back)':60} {len(step):5d} {total/1e3:9.1f}")
EOF
}


if [ "$WHAT" = step ]; then
  SHAPE=${SHAPE:-0.5b} BATCH=${BATCH:-512} CTX=${CTX:-512}
  d=$(mktemp -d)
  python3 - "$d" "$SHAPE" <<'EOF'
import json, pathlib, sys
sys.path.insert(0, "bench")
from bench_decode_gpu import write_config
write_config(pathlib.Path(sys.argv[1]), sys.argv[2])
EOF
  csv="$OUT/ncu-step-$SHAPE-b$BATCH.csv"
  # Warm-up 1 + 2 timed steps: the last step's kernels are the last third of the launches after start-up.
  "$NCU" --graph-profiling node --cache-control none --clock-control none --csv --page raw \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
    "$B/bench/bench_decode_step" "$d" --device cuda --batches "$BATCH" --ctx "$CTX" --steps 2 --warmup 1 \
    > "$csv" 2> "$OUT/ncu-step-$SHAPE-b$BATCH.err" || { tail -20 "$OUT/ncu-step-$SHAPE-b$BATCH.err"; exit 1; }
  kernel_table "$csv" greedy_combine end
elif [ "$WHAT" = train ]; then
  SHAPE=${SHAPE:-1.5b} FLAGS=${FLAGS:---adamw} BATCH=${BATCH:-8} SEQ=${SEQ:-1024}
  d=$(mktemp -d)
  python3 - "$d" "$SHAPE" <<'EOF'
import json, pathlib, sys
sys.path.insert(0, "bench")
from bench_decode_gpu import write_config
write_config(pathlib.Path(sys.argv[1]), sys.argv[2])
EOF
  tag="train-$SHAPE-b$BATCH-s$SEQ$(echo "$FLAGS" | tr -d ' ')"
  csv="$OUT/ncu-$tag.csv"
  # Warm-up 1 (which also autotunes the GEMMs) + 1 timed step; the step starts at its embedding lookup.
  # shellcheck disable=SC2086
  "$NCU" --cache-control none --clock-control none --csv --page raw \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
    "$B/bench/bench_model_step" "$d" --device cuda --batch "$BATCH" --seq "$SEQ" --steps 1 --warmup 1 $FLAGS \
    > "$csv" 2> "$OUT/ncu-$tag.err" || { tail -20 "$OUT/ncu-$tag.err"; exit 1; }
  kernel_table "$csv" embedding_fwd start
elif [ "$WHAT" = attn ]; then
  HQ=${HQ:-14} HKV=${HKV:-2} D=${D:-64} BATCH=${BATCH:-512} CTX=${CTX:-512}
  rep="$OUT/ncu-attn-h$HQ-$HKV-d$D-b$BATCH-c$CTX.txt"
  "$NCU" --set full --cache-control all --clock-control none -k regex:paged_mma_kernel --launch-skip 3 \
    --launch-count 1 "$B/bench/bench_attention_paged" --hq "$HQ" --hkv "$HKV" --d "$D" --batch "$BATCH" \
    --ctx "$CTX" --iters 4 > "$rep" 2>&1 || { tail -20 "$rep"; exit 1; }
  # Per-instruction view (SASS with stall samples and sector counts) for reading back on the development machine.
  "$NCU" --set full --import-source no --cache-control all --clock-control none -k regex:paged_mma_kernel \
    --launch-skip 3 --launch-count 1 -f -o "$OUT/ncu-attn" "$B/bench/bench_attention_paged" --hq "$HQ" --hkv "$HKV" \
    --d "$D" --batch "$BATCH" --ctx "$CTX" --iters 4 > /dev/null 2>&1 &&
    "$NCU" -i "$OUT/ncu-attn.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu-attn-sass.csv" 2>&1 || true
  grep -E "Duration|DRAM Throughput|Memory Throughput|L2 Hit|L1/TEX Hit|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Waves Per SM|Stall|stall|cycles being stalled|Issued Ipc|Eligible|No Eligible|Active Warps|Mem Busy|Max Bandwidth|Mem Pipes" "$rep" | head -60
elif [ "$WHAT" = kernel ]; then
  # Any kernel of any command: KERNEL=regex SKIP=launches to skip, then the command and its arguments.
  shift 2
  rep="$OUT/ncu-kernel"
  "$NCU" --set full --import-source no --cache-control all --clock-control none -k "regex:${KERNEL:?KERNEL=regex}" \
    --launch-skip "${SKIP:-3}" --launch-count 1 -f -o "$rep" "$@" > "$rep.log" 2>&1 || { tail -20 "$rep.log"; exit 1; }
  "$NCU" -i "$rep.ncu-rep" --page details > "$rep.txt" 2>&1
  "$NCU" -i "$rep.ncu-rep" --page source --csv --print-source sass > "$rep-sass.csv" 2>&1 || true
  grep -E "Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Issued Ipc|Eligible Warps" "$rep.txt" | head -20
else
  echo "gpu-ncu.sh: WHAT is step, train, attn or kernel" >&2
  exit 2
fi
