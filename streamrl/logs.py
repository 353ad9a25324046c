"""Quiet by default: the engine and library noise a user cannot act on is dropped at its source.

- ``LOG_LEVELS``: ``trainer.log_level`` values; ``debug`` shows everything, unfiltered,
- ``KNOWN_NOISE``: what vLLM, torch and the HF loaders print on every CPU run (eager mode, no
  Triton, no tcmalloc, ...): facts of the platform, not problems of the run,
- ``KnownNoise``: the logging filter that drops them,
- ``worker_env(level)``: environment for Ray workers. vLLM reads its logging config from
  ``VLLM_LOGGING_CONFIG_PATH`` in every process it starts, the engine-core child included
  (which no filter installed from our side could reach), so the filter goes in there,
- ``configure(level)``: the same for the driver process.

Depends on nothing of streamrl (vLLM imports it while configuring its loggers).
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from pathlib import Path

LOG_LEVELS = ("debug", "info", "warning")

KNOWN_NOISE = re.compile("|".join((
    r"The global random seed is set to",
    r"Enforce eager set",
    r"Inductor compilation was disabled",
    r"TORCH_COMPILE_DISABLE is set",  # ours, on CPU: rollout_fleet.vllm_engine
    r"Triton is not installed",
    r"Triton not available",
    r"Reset SSM cache type",
    r"Model Runner V2 requires Triton",
    r"is not found in LD_PRELOAD",
    r"Passing raw prompts to InputProcessor is deprecated",
    r"\[shutdown\] Process manager",
)))
VLLM_LOGGING_CONFIG = Path(__file__).with_name("vllm_logging.json")
CPU_MODE_NOTE = ("vLLM on CPU: eager mode, no Triton or torch.compile; its start-up warnings "
                 "about that are hidden (trainer.log_level=debug shows them)")


class KnownNoise(logging.Filter):
    """Drops the records ``KNOWN_NOISE`` matches; everything else passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return KNOWN_NOISE.search(record.getMessage()) is None


def worker_env(level: str) -> dict[str, str]:
    """Environment variables that make a Ray worker (and the processes it starts) quiet at
    ``level``; ``debug`` leaves every library at its own defaults."""
    if level == "debug":
        return {"VLLM_LOGGING_LEVEL": "INFO"}
    return {
        "VLLM_LOGGING_LEVEL": level.upper(),
        "VLLM_LOGGING_CONFIG_PATH": str(VLLM_LOGGING_CONFIG),
        # Library deprecations are for the library's users, not ours.
        "PYTHONWARNINGS": "ignore::FutureWarning,ignore::DeprecationWarning",
        "TORCH_CPP_LOG_LEVEL": "ERROR",  # c10 warnings: NUMA binding, ...
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' "Loading weights" bars
        "RAY_DEDUP_LOGS": "1",
    }


def configure(level: str) -> None:
    """The driver's logging at ``level`` (root format, known noise dropped unless debug)."""
    logging.basicConfig(level=logging.DEBUG if level == "debug" else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    logging.getLogger().setLevel(level.upper())
    if level == "debug":
        return
    for handler in logging.getLogger().handlers:
        handler.addFilter(KnownNoise())
    logging.getLogger("torch._library").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    os.environ.update(worker_env(level))
