"""Where a run's model comes from: ``model.path`` resolution, shared by every process.

``model.path=tiny`` is the offline tiny model (built on first use by ``streamrl.testing``);
anything else is an HF model directory, or a hub id where a hub is reachable or has it cached,
used as given. Anything else fails as a ``ConfigError`` before a process loads it.
"""

from __future__ import annotations

import os
from pathlib import Path

from streamrl.errors import ConfigError


def default_tiny_model_dir() -> Path:
    """Where ``model.path=tiny`` builds its model (overridable with STREAMRL_TINY_MODEL)."""
    env = os.environ.get("STREAMRL_TINY_MODEL")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "streamrl" / "tiny"


def resolve_model_path(path: str, key: str = "model.path", marker: str = "config.json") -> str:
    """``tiny`` means the offline tiny model (built on first use); a directory holding
    ``marker`` or a usable hub id is returned as given; anything else is a ConfigError naming
    ``key`` (``model.tokenizer_path`` passes ``tokenizer_config.json``)."""
    if path == "tiny":
        from streamrl.testing import build_tiny_model

        return str(build_tiny_model(default_tiny_model_dir()))
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / marker).is_file():
            raise ConfigError(f"{key}={path!r}: the directory has no {marker}: give a Hugging "
                              f"Face model directory, or {key}=tiny for the offline tiny model")
        return path
    if _on_hub(path, marker):
        return path
    from huggingface_hub import constants

    where = "nor a hub id cached here (HF_HUB_OFFLINE is on)" if constants.HF_HUB_OFFLINE else \
        "nor a hub id"
    raise ConfigError(f"{key}={path!r}: not a directory, {where}: give a Hugging Face model "
                      f"directory, or {key}=tiny for the offline tiny model")


def _on_hub(repo_id: str, marker: str) -> bool:
    """Whether ``repo_id`` can be loaded from the hub: cached here, or the hub is online."""
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        cached = try_to_load_from_cache(repo_id, marker)
    except HFValidationError:  # not shaped like a repo id (e.g. a path)
        return False
    return isinstance(cached, str) or not constants.HF_HUB_OFFLINE
