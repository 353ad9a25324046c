#!/usr/bin/env bash
# Install everything (scripts/setup.sh) and run the whole test suite. `.ci/run` calls this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check streamrl tests benchmarks
.venv/bin/python -m pytest -q -ra --durations=40 -m "not manual" "$@"
