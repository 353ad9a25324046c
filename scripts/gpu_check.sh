#!/usr/bin/env bash
# The GPU-only paths, for a session with a CUDA machine: NCCL weight bus, SGLang engine and
# receiver, bf16 FSDP2 learner, vLLM (GPU build) engine, the co-located hybrid worker (sleep
# mode and learner offload free device memory; the in-place swap launches no NCCL kernel).
# Everything here skips on CPU machines.
# Install the GPU extras first (they exclude `cpu`): pip install -e '.[vllm,dev]' (+ '.[sglang]').
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
"$python" - <<'PY'
import torch
assert torch.cuda.is_available(), "gpu_check.sh needs a CUDA GPU"
print("GPU:", torch.cuda.get_device_name(0))
PY
export HF_HUB_OFFLINE=1
"$python" -m pytest -q -ra \
  tests/weight_bus/test_gpu.py \
  tests/rollout_fleet/test_sglang_engine.py \
  tests/rollout_fleet/test_vllm_engine.py \
  tests/learner/test_actor.py \
  tests/runtime/test_hybrid.py \
  "$@"
