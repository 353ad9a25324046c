"""``streamrl sft``'s configuration: its own small root, reusing the RL config's sections.

``model``, ``optim`` and ``learner`` are the RL config's dataclasses (the same ``model.path``
resolution, AdamW + schedule and rank layout); ``data`` and ``trainer`` are SFT's own. Keys
follow verl's SFT trainer where it has one (``data.train_files``, ``data.max_length``,
``data.train_batch_size``, ``trainer.total_epochs``; its other names are translated, see
``VERL_KEYS``). Overrides are ``key=value`` (no Hydra groups: SFT has no presets to pick); an
unknown key, a wrongly typed value or an inconsistent setting is one ``ConfigError`` line
naming key and value.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from streamrl.config import (
    LearnerConfig,
    ModelConfig,
    OptimConfig,
    _all_keys,
    _check_positive,
    _fail,
    _schema,
    _tuples,
)
from streamrl.errors import ConfigError

RESUME_MODES = ("disable", "auto")

VERL_KEYS = {
    "model.partial_pretrain": "model.path",
    "data.micro_batch_size_per_gpu": "data.micro_batch_size",
    "data.multiturn.messages_key": "data.messages_key",
    "optim.clip_grad": "trainer.grad_clip",
    "trainer.default_local_dir": "trainer.output_dir",
    "trainer.total_training_steps": "trainer.total_steps",
}
"""verl's SFT trainer keys that are named differently here: translated, so its command lines
work. (verl's micro batch is per GPU, as ours is per rank.)"""


@dataclass(frozen=True)
class SFTDataConfig:
    train_files: tuple[str, ...] = ()
    messages_key: str = "messages"
    """Column of chat messages ``[{role, content}, ...]`` (verl's multi-turn SFT dataset)."""
    prompt_key: str = "prompt"
    """Single-turn files without ``messages_key``: the user text (or a list of messages) ..."""
    response_key: str = "response"
    """... and the assistant's answer."""
    max_length: int = 512
    """Longer conversations are skipped (logged per row), never truncated mid-answer."""
    train_batch_size: int = 32
    """Conversations per optimizer step, all ranks together."""
    micro_batch_size: int = 8
    """Conversations per forward on one rank (gradients accumulate over micro-batches)."""
    shuffle: bool = True
    seed: int = 0

    def validate(self) -> None:
        if not self.train_files:
            raise ConfigError("data.train_files=[]: give one or more parquet files")
        _check_positive(self, "data", "max_length", "train_batch_size", "micro_batch_size")


@dataclass(frozen=True)
class SFTTrainerConfig:
    output_dir: str = "outputs/sft"
    """Checkpoints (global_step_<N>/), metrics.jsonl and the final HF export (hf/)."""
    total_epochs: int = 1
    total_steps: int = 0
    """0: total_epochs x (conversations // train_batch_size)."""
    save_freq: int = 0
    """Checkpoint every N steps (0: only at the end); the last step always saves."""
    max_to_keep: int = 2
    resume: str = "disable"
    """``auto``: continue from the latest complete checkpoint under output_dir, if any."""
    grad_clip: float = 1.0

    def validate(self) -> None:
        _check_positive(self, "trainer", "total_epochs")
        _check_positive(self, "trainer", "total_steps", "save_freq", "max_to_keep",
                        allow_zero=True)
        if self.resume not in RESUME_MODES:
            _fail("trainer.resume", self.resume, f"must be one of {list(RESUME_MODES)}")


@dataclass(frozen=True)
class SFTConfig:
    model: ModelConfig = field(default_factory=lambda: ModelConfig(path="tiny"))
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3))
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    trainer: SFTTrainerConfig = field(default_factory=SFTTrainerConfig)


def load_sft_config(overrides: list[str] | None = None) -> SFTConfig:
    """Defaults + ``key=value`` overrides, type-checked and validated."""
    known = _all_keys(SFTConfig())
    values: dict[str, str] = {}
    translated = []
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r}: write key=value")
        key = VERL_KEYS.get(key, key)
        translated.append(f"{key}={value}")
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {close[0]}?" if close else f"keys: {', '.join(known)}"
            raise ConfigError(f"{key}={value!r}: no such sft config key: {hint}")
        values[key] = value
    try:
        merged = OmegaConf.merge(_schema(SFTConfig), OmegaConf.from_dotlist(translated))
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        key = str(exc.full_key)
        raise ConfigError(f"{key}={values.get(key)!r}: {' '.join(str(exc.msg).split())}") from exc
    assert isinstance(cfg, SFTConfig)
    return validate_sft(_tuples(cfg))


def validate_sft(cfg: SFTConfig) -> SFTConfig:
    """Raise ConfigError for the first inconsistent setting; return cfg unchanged otherwise.
    Each section checks its own keys (the RL config's sections with the RL config's checks)."""
    cfg.data.validate()
    cfg.model.validate()
    cfg.optim.validate("optim")
    cfg.learner.validate()
    cfg.trainer.validate()
    if cfg.data.train_batch_size % cfg.learner.world_size:
        # Every rank takes the same number of rows, so FSDP's collectives line up.
        _fail("data.train_batch_size", cfg.data.train_batch_size,
              f"must be a multiple of learner.world_size={cfg.learner.world_size}")
    return cfg
