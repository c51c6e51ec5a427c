#!/usr/bin/env bash
# The demo, from a fresh clone on a fresh Debian machine: installs the Debian packages tandem needs (no Python
# venv), builds tandem (Release; the CUDA backend too when nvcc is on PATH), then runs `tandem-train demo` — a tiny
# Llama made by tandem, SFT-warmed and then trained with GRPO on a + b problems through a rollout server, held-out
# accuracy measured over HTTP before, during and after, a plot in out/demo/demo.svg. Arguments go to the demo
# (`scripts/demo.sh --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
TANDEM_SETUP_VENV=0 scripts/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null   # TANDEM_CUDA=AUTO: the CUDA backend when nvcc is there
cmake --build build -j "$(nproc)" --target tandem-train tandem-serve >/dev/null
exec build/bin/tandem-train demo "$@"
