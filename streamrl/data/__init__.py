"""Prompt sources: verl-format parquet, reasoning-gym (generated offline), the built-in toy task.

``make_prompt_source(cfg.task, tokenizer, split)`` picks the loader by ``task.source``;
``PromptStream`` walks a source endlessly and resumably. Loaders are imported on use so that
importing ``streamrl.data`` (e.g. in a reward worker) stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from streamrl.data.base import ListPromptSource, Prompt, PromptSource, PromptStream
from streamrl.errors import ConfigError

if TYPE_CHECKING:
    from streamrl.config import TaskConfig

__all__ = ["ListPromptSource", "Prompt", "PromptSource", "PromptStream", "make_prompt_source"]

VAL_SEED_OFFSET = 1_000_003
"""Generated sources draw the validation split from ``task.seed + VAL_SEED_OFFSET``."""


def make_prompt_source(cfg: TaskConfig, tokenizer: Any, split: str = "train") -> PromptSource:
    """Load the ``split`` ("train" | "val") prompts of the task ``cfg`` describes.

    A parquet task without ``val_files`` has an empty val source (no validation); with them,
    the first ``task.val_size`` prompts (a validation pass answers each greedily). A train
    source without any usable prompt is an error naming the task and the skip reasons.
    """
    if split not in ("train", "val"):
        raise ValueError(f"make_prompt_source: split={split!r} must be 'train' or 'val'")
    train = split == "train"
    if cfg.source == "parquet":
        from streamrl.data.parquet import load_parquet_source

        files = cfg.train_files if train else cfg.val_files
        if not files:
            if train:
                raise ConfigError("task.train_files: required with task.source=parquet")
            return ListPromptSource([], name="no val_files")
        source: PromptSource = load_parquet_source(
            files, tokenizer, cfg.max_prompt_length, f"task.{split}_files")
        if not train and len(source) > cfg.val_size:  # validation is bounded (task.val_size)
            source = ListPromptSource([source[i] for i in range(cfg.val_size)],
                                      name=f"{source.name}[:{cfg.val_size}]",
                                      skipped=source.skipped)
    elif not train and cfg.val_size == 0:
        return ListPromptSource([], name="task.val_size=0")
    elif cfg.source in ("toy", "reasoning_gym"):
        size = cfg.size if train else cfg.val_size
        seed = cfg.seed if train else cfg.seed + VAL_SEED_OFFSET
        if cfg.source == "toy":
            from streamrl.data.toy import load_toy_source

            # Validation keeps the plain budget: it measures the policy, not what steps cost.
            source = load_toy_source(cfg.name, size, seed, tokenizer, cfg.max_prompt_length,
                                     cfg.long_tail if train else 0.0, cfg.long_tail_tokens)
        else:
            from streamrl.data.reasoning_gym import load_reasoning_gym_source

            names = [n.strip() for n in cfg.name.split(",") if n.strip()]
            source = load_reasoning_gym_source(names, size, seed, tokenizer,
                                               cfg.max_prompt_length)
    else:
        raise ValueError(f"task.source={cfg.source!r}: must be one of toy, parquet, reasoning_gym")
    if train and len(source) == 0:
        raise ConfigError(f"task.source={cfg.source!r}: no usable training prompt in "
                          f"{source.name!r} (skipped: {source.skipped}; "
                          f"task.max_prompt_length={cfg.max_prompt_length})")
    return source
