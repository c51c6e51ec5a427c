#!/usr/bin/env bash
# Installs what tandem's build and tests need; safe to run again (it skips what is already there).
#   - Debian packages (compiler, CMake, jansson, libmicrohttpd, ZeroMQ, OpenBLAS, PCRE2, utf8proc; clang and its
#     sanitizer + libFuzzer runtimes for the sanitizer job of scripts/test.sh; iproute2 for the `ip netns` of
#     tests/e2e/test_two_node_netns.py)
#   - the reference-test Python venv, cached outside the clone and keyed by tests/requirements.txt's hash
#     (PyPI's torch wheel brings several GB of CUDA libraries: one install per machine, reused by every run).
#   - into that venv, tests/requirements-k8s.txt (kubectl for `kubectl kustomize`, kubernetes-validate), once
#     per hash of that file (a stamp in the venv), so changing it never rebuilds the venv.
# Prints the venv path on its last line.
# TANDEM_SETUP_VENV=0 scripts/setup.sh installs the Debian packages only: all that building and running tandem
# need (the venv, about 6 GB, is for the tests alone).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)

debs=(build-essential cmake pkg-config clang libjansson-dev libmicrohttpd-dev libzmq3-dev libopenblas-dev
      libpcre2-dev libutf8proc-dev python3 python3-venv iproute2)
missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
sudo_cmd=""; [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}" >&2
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# clang links a sanitized program only with its ASan / UBSan / libFuzzer runtimes. Since Debian 12 and Ubuntu 23.04
# they are a package of their own (libclang-rt-dev) that clang merely recommends, so an installer that skips
# recommended packages leaves them out; before, clang's own packages carried them. A trial link decides.
probe=$(mktemp)
if ! echo 'int main(void) { return 0; }' | clang -x c -fsanitize=address,undefined -o "$probe" - 2>/dev/null; then
  echo "setup: installing Debian packages: libclang-rt-dev (clang's sanitizer runtimes)" >&2
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq libclang-rt-dev >/dev/null
fi
rm -f "$probe"

# TANDEM_SETUP_VENV=0: the Debian packages only (what building and running tandem need; scripts/demo.sh).
if [ "${TANDEM_SETUP_VENV:-1}" = "0" ]; then
  exit 0
fi

req="$here/tests/requirements.txt"
hash=$(sha256sum "$req" | cut -c1-16)
cache="${TANDEM_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tandem}"
venv="$cache/venv-$hash"
mkdir -p "$cache"
exec 9>"$cache/.setup.lock"
flock 9   # one installer at a time per machine; the others wait and then find the venv complete
if [ ! -f "$venv/.complete" ]; then
  echo "setup: creating the reference venv at $venv (first time on this machine: a few minutes, ~6 GB)" >&2
  rm -rf "$venv"
  mkdir -p "$cache"
  py=python3
  command -v python3.11 >/dev/null && py=python3.11
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  "$venv/bin/python" -m pip install -q -r "$req" >&2
  touch "$venv/.complete"
fi
req_k8s="$here/tests/requirements-k8s.txt"
stamp="$venv/.k8s-$(sha256sum "$req_k8s" | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "setup: installing the Kubernetes manifest test tools into $venv" >&2
  "$venv/bin/python" -m pip install -q -r "$req_k8s" >&2
  rm -f "$venv"/.k8s-*
  touch "$stamp"
fi
echo "$venv"
