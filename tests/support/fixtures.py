"""Session fixtures: the offline tiny model and a real redis-server on a free port."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamrl.net import free_port


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
