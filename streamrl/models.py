"""Where a run's model comes from: ``model.path`` resolution, shared by every process.

``model.path=tiny`` is the offline tiny model (built on first use by ``streamrl.testing``);
anything else is an HF model directory (or hub id where a hub is reachable), used as given.
"""

from __future__ import annotations

import os
from pathlib import Path


def default_tiny_model_dir() -> Path:
    """Where ``model.path=tiny`` builds its model (overridable with STREAMRL_TINY_MODEL)."""
    env = os.environ.get("STREAMRL_TINY_MODEL")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "streamrl" / "tiny"


def resolve_model_path(path: str) -> str:
    """``tiny`` means the offline tiny model (built on first use); anything else is as given."""
    if path == "tiny":
        from streamrl.testing import build_tiny_model

        return str(build_tiny_model(default_tiny_model_dir()))
    return path
