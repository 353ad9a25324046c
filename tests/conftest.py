"""Shared fixtures: the offline tiny model, a real redis-server per session, engine env vars."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# Engines and tests run with one OpenMP thread (DESIGN.md §11: unset, vLLM on CPU is ~50x slower).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The offline tiny Qwen2 model + tokenizer (built once per session)."""
    from streamrl.testing import build_tiny_model

    env = os.environ.get("STREAMRL_TINY_MODEL")
    target = Path(env) if env else tmp_path_factory.mktemp("tiny-model")
    return build_tiny_model(target)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on a free loopback port, stopped at the end of the session."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.fail("redis-server is not installed: run scripts/setup.sh")
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    subprocess.run(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
         "--dir", str(workdir), "--daemonize", "yes", "--logfile", str(workdir / "redis.log")],
        check=True,
    )
    import redis

    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    with contextlib.suppress(redis.ConnectionError):  # shutdown drops its own connection
        client.shutdown(nosave=True)


def has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


requires_gpu = pytest.mark.skipif(not has_cuda(), reason="needs a CUDA GPU")
