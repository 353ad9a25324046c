"""Runtime guards that must fail before any process is started."""

from __future__ import annotations

import pytest

from streamrl.config import ConfigError, load_config
from streamrl.runtime import build_runtime


def test_refuses_the_in_process_bus_before_starting_anything() -> None:
    import ray

    cfg = load_config(["weight_bus=colocated", "runtime.placement=colocated"])
    with pytest.raises(ConfigError, match=r"weight_bus.backend='colocated'"), build_runtime(cfg):
        pass
    assert not ray.is_initialized()
