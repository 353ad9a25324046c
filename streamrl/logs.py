"""What a run writes out is quiet and keeps secrets: the engine and library noise a user cannot act
on is dropped at its source, and no sink gets a password or an API key.

- ``LOG_LEVELS``: ``trainer.log_level`` values; ``debug`` shows everything, unfiltered,
- ``KNOWN_NOISE``: what vLLM, torch and the HF loaders print on every CPU run (eager mode, no
  Triton, no tcmalloc, ...): facts of the platform, not problems of the run,
- ``KnownNoise``: the logging filter that drops them,
- ``worker_env(level)``: environment for Ray workers. vLLM reads its logging config from
  ``VLLM_LOGGING_CONFIG_PATH`` in every process it starts, the engine-core child included
  (which no filter installed from our side could reach), so the filter goes in there,
- ``configure(level)``: the same for the driver process,
- ``redacted(cfg)``: the config as plain data with its secrets masked, what every sink that
  takes the config out of the process writes (``streamrl config``, wandb); ``redact_url(text)``
  masks the password of each URL in a line (a ``buffer.redis_url`` quoted by an error).

Depends on nothing of streamrl (vLLM imports it while configuring its loggers).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

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


MASK = "***"
# Keys whose value is a secret wherever they sit (serve.api_key, a password key); names that
# merely contain "token" (max_tokens, stop_token_ids) are not.
SECRET_KEY = re.compile(r"(^|_)(api_key|password|passwd|secret|token)$", re.IGNORECASE)
# The password of a URL (scheme://user:password@host) and a password in its query
# (redis-py also reads ?password=...).
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*:)[^@/\s]+@")
_QUERY_SECRET = re.compile(r"(?P<head>[?&](?:password|passwd|api_key|token)=)[^&#\s]*",
                           re.IGNORECASE)


def redact_url(text: str) -> str:
    """``text`` with the password of every URL in it masked (``redis://user:***@host``)."""
    text = _URL_PASSWORD.sub(lambda m: f"{m['head']}{MASK}@", text)
    return _QUERY_SECRET.sub(lambda m: f"{m['head']}{MASK}", text)


def redacted(cfg: Any) -> Any:
    """A config (a dataclass, or already a dict of one) as plain dicts, lists and scalars, with
    secrets masked: the value of every secret key (``SECRET_KEY``) that is set, and URL
    passwords in every string. What every sink that takes the config out of the process
    writes, so one function decides what is secret."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        cfg = dataclasses.asdict(cfg)
    if isinstance(cfg, Mapping):
        return {key: MASK if SECRET_KEY.search(str(key)) and value not in (None, "")
                else redacted(value) for key, value in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return [redacted(value) for value in cfg]
    if isinstance(cfg, str):
        return redact_url(cfg)
    return cfg
