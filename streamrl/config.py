"""Structured configuration: one frozen dataclass per component, composed by Hydra.

Parts:
- the dataclasses (``Config`` is the root; one field per component),
- ``register_configs()``: puts them in Hydra's ConfigStore (``configs/`` YAML groups build on them),
- ``VERL_ALIASES``: verl's dotted keys accepted as overrides, and ``translate_overrides``,
- ``RENAMED_KEYS``: keys that moved, failing with a migration message,
- ``validate(cfg)``: every inconsistent setting becomes one ``ConfigError`` naming key and value,
- ``load_config(overrides)``: compose ``configs/config.yaml`` + overrides into a validated Config.

Defaults live here, in the dataclasses, never in ``cfg.get(key, default)`` calls elsewhere.
This module depends on nothing else in streamrl except the name lists of ``algos``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

MODES = ("sync", "one_step_off", "fully_async")
UPDATE_POLICIES = ("drain", "pause", "abort")
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class ConfigError(ValueError):
    """An invalid or inconsistent setting; the message names the key and the value."""


@dataclass(frozen=True)
class ModelConfig:
    path: str = MISSING
    """HF model directory (a tiny random model is built on the fly when ``path=tiny``)."""
    tokenizer_path: str | None = None
    dtype: str = "float32"
    """Training master dtype on CPU; on GPU the learner uses bf16 mixed precision."""
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False


@dataclass(frozen=True)
class RolloutConfig:
    backend: str = "vllm"
    """vllm | hf | sglang"""
    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 8
    stop: tuple[str, ...] = ()
    num_replicas: int = 1
    max_inflight_groups: int = 8
    """Groups a replica keeps in flight at once so the engine batches continuously."""
    dtype: str = "float32"
    max_model_len: int = 512
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = True
    seed: int = 0
    max_retries: int = 3
    agent: str | None = None
    """Multi-turn agent environment: a built-in name or ``module:Class`` (None: single turn)."""
    max_turns: int = 4
    """Assistant turns per agent episode."""
    max_episode_tokens: int = 64
    """Response-token budget of an agent episode (sampled + observation tokens), carried
    across turns and aborts; single-turn groups use max_new_tokens."""
    tool_timeout_s: float = 10.0
    tools: tuple[str, ...] = ()
    """Extra tools for the agent environment, as ``module:function`` names."""


@dataclass(frozen=True)
class RewardConfig:
    name: str = "auto"
    """auto (by data_source) | toy | gsm8k | math_verify | reasoning_gym | custom"""
    custom_path: str | None = None
    custom_name: str = "compute_score"
    timeout_s: float = 10.0
    num_workers: int = 1


@dataclass(frozen=True)
class TaskConfig:
    source: str = "toy"
    """toy | parquet | reasoning_gym"""
    name: str = "rep"
    """toy task name, or comma-separated reasoning-gym dataset names"""
    train_files: tuple[str, ...] = ()
    val_files: tuple[str, ...] = ()
    train_batch_size: int = 16
    """Groups (prompts) per training step."""
    max_prompt_length: int = 64
    size: int = 1024
    """Number of generated prompts for toy / reasoning-gym sources."""
    val_size: int = 64
    seed: int = 0
    shuffle: bool = True


@dataclass(frozen=True)
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl_type: str = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    """constant | cosine"""
    min_lr_ratio: float = 0.0
    total_steps: int = 0
    """0: take trainer.total_steps."""


@dataclass(frozen=True)
class ActorConfig:
    ppo_mini_batch_size: int = 16
    """Groups per optimizer step (verl counts prompts); must divide task.train_batch_size."""
    ppo_micro_batch_size: int = 4
    """Groups per forward/backward when use_dynamic_bsz is off."""
    use_dynamic_bsz: bool = True
    ppo_max_token_len: int = 4096
    """Token budget of a packed micro-batch when use_dynamic_bsz is on."""
    ppo_epochs: int = 2
    policy_loss: str = "vanilla"
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    grad_clip: float = 1.0
    tis_cap: float | None = None
    """Truncated importance sampling cap on pi_proximal / pi_behaviour (None: off)."""
    icepop_low: float | None = None
    icepop_high: float | None = None
    rejection_low: float | None = None
    rejection_high: float | None = None
    recompute_log_prob: bool = True
    """False is 'bypass' mode: the behaviour log-probs serve as the old log-probs."""
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass(frozen=True)
class CriticConfig:
    enable: bool = False
    """Forced on by adv_estimator=gae."""
    cliprange_value: float = 0.5
    ppo_epochs: int = 2
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3))


@dataclass(frozen=True)
class LearnerConfig:
    world_size: int = 1
    """FSDP2 ranks (gloo on CPU, NCCL on GPU)."""
    device: str = "auto"
    """auto | cpu | cuda"""
    seed: int = 0


@dataclass(frozen=True)
class BufferConfig:
    backend: str = "memory"
    """memory | redis"""
    redis_url: str = "redis://127.0.0.1:6379/0"
    run: str = "default"
    """Key namespace: streamrl:<run>:groups, streamrl:<run>:stats."""
    max_staleness: int = 1
    """eta for fully_async; sync forces 0 and one_step_off forces 1."""
    take_timeout_s: float = 600.0


@dataclass(frozen=True)
class WeightBusConfig:
    backend: str = "collective"
    """collective (torch.distributed broadcast) | colocated (in-place swap)"""
    bucket_mb: int = 64
    timeout_s: float = 60.0
    sync_every: int = 1
    update_policy: str = "pause"
    """drain | pause | abort (fully_async only; sync and one_step_off always drain)"""
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    """0: pick a free port."""


@dataclass(frozen=True)
class TrainerConfig:
    mode: str = "fully_async"
    total_steps: int = 200
    total_epochs: int = 0
    """>0 overrides total_steps with epochs x (prompts / train_batch_size)."""
    test_freq: int = 0
    save_freq: int = 0
    max_to_keep: int = 2
    resume: str = "disable"
    """disable | auto | <checkpoint dir>"""
    output_dir: str = "outputs/${trainer.experiment_name}"
    project_name: str = "streamrl"
    experiment_name: str = "toy-grpo"
    logger: tuple[str, ...] = ("console", "jsonl")
    """console | jsonl | wandb"""
    seed: int = 0


@dataclass(frozen=True)
class RuntimeConfig:
    use_ray: bool = True
    address: str | None = None
    """None: start a local Ray cluster."""
    placement: str = "disaggregated"
    """colocated | disaggregated"""
    num_cpus: int | None = None
    cpus_per_replica: float = 1.0
    cpus_per_learner: float = 1.0
    pin_cpus: bool = False
    """Pin learner rank r to core r and replica i to core world_size + i (modulo the cores)."""


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=lambda: ModelConfig(path="tiny"))
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    weight_bus: WeightBusConfig = field(default_factory=WeightBusConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    @property
    def max_staleness(self) -> int:
        """The staleness bound eta the mode implies (DESIGN.md §1 table)."""
        return {"sync": 0, "one_step_off": 1}.get(self.trainer.mode, self.buffer.max_staleness)

    @property
    def update_policy(self) -> str:
        return self.weight_bus.update_policy if self.trainer.mode == "fully_async" else "drain"

    @property
    def use_critic(self) -> bool:
        return self.critic.enable or self.algorithm.adv_estimator == "gae"

    @property
    def use_ref(self) -> bool:
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward


# verl's dotted keys -> ours. Values are taken as they are.
VERL_ALIASES: dict[str, str] = {
    "actor_rollout_ref.model.path": "model.path",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "model.gradient_checkpointing",
    "actor_rollout_ref.rollout.n": "rollout.n",
    "actor_rollout_ref.rollout.name": "rollout.backend",
    "actor_rollout_ref.rollout.temperature": "rollout.temperature",
    "actor_rollout_ref.rollout.top_p": "rollout.top_p",
    "actor_rollout_ref.rollout.top_k": "rollout.top_k",
    "actor_rollout_ref.rollout.response_length": "rollout.max_new_tokens",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "actor_rollout_ref.rollout.enforce_eager": "rollout.enforce_eager",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "actor.ppo_micro_batch_size",
    "actor_rollout_ref.actor.use_dynamic_bsz": "actor.use_dynamic_bsz",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "actor.ppo_max_token_len",
    "actor_rollout_ref.actor.ppo_epochs": "actor.ppo_epochs",
    "actor_rollout_ref.actor.clip_ratio": "actor.clip_ratio",
    "actor_rollout_ref.actor.clip_ratio_low": "actor.clip_ratio_low",
    "actor_rollout_ref.actor.clip_ratio_high": "actor.clip_ratio_high",
    "actor_rollout_ref.actor.clip_ratio_c": "actor.clip_ratio_c",
    "actor_rollout_ref.actor.loss_agg_mode": "actor.loss_agg_mode",
    "actor_rollout_ref.actor.policy_loss.loss_mode": "actor.policy_loss",
    "actor_rollout_ref.actor.entropy_coeff": "actor.entropy_coeff",
    "actor_rollout_ref.actor.use_kl_loss": "actor.use_kl_loss",
    "actor_rollout_ref.actor.kl_loss_coef": "actor.kl_loss_coef",
    "actor_rollout_ref.actor.kl_loss_type": "actor.kl_loss_type",
    "actor_rollout_ref.actor.grad_clip": "actor.grad_clip",
    "actor_rollout_ref.actor.optim.lr": "actor.optim.lr",
    "actor_rollout_ref.actor.optim.weight_decay": "actor.optim.weight_decay",
    "actor_rollout_ref.actor.optim.lr_warmup_steps": "actor.optim.warmup_steps",
    "critic.optim.lr": "critic.optim.lr",
    "critic.cliprange_value": "critic.cliprange_value",
    "critic.ppo_epochs": "critic.ppo_epochs",
    "algorithm.adv_estimator": "algorithm.adv_estimator",
    "algorithm.gamma": "algorithm.gamma",
    "algorithm.lam": "algorithm.lam",
    "algorithm.norm_adv_by_std_in_grpo": "algorithm.norm_adv_by_std_in_grpo",
    "algorithm.use_kl_in_reward": "algorithm.use_kl_in_reward",
    "algorithm.kl_penalty": "algorithm.kl_penalty",
    "algorithm.kl_ctrl.type": "algorithm.kl_ctrl_type",
    "algorithm.kl_ctrl.kl_coef": "algorithm.kl_coef",
    "algorithm.kl_ctrl.target_kl": "algorithm.target_kl",
    "algorithm.kl_ctrl.horizon": "algorithm.horizon",
    "data.train_batch_size": "task.train_batch_size",
    "data.max_prompt_length": "task.max_prompt_length",
    "data.max_response_length": "rollout.max_new_tokens",
    "data.train_files": "task.train_files",
    "data.val_files": "task.val_files",
    "data.shuffle": "task.shuffle",
    "custom_reward_function.path": "reward.custom_path",
    "custom_reward_function.name": "reward.custom_name",
    "trainer.total_epochs": "trainer.total_epochs",
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.test_freq": "trainer.test_freq",
    "trainer.save_freq": "trainer.save_freq",
    "trainer.project_name": "trainer.project_name",
    "trainer.experiment_name": "trainer.experiment_name",
    "trainer.default_local_dir": "trainer.output_dir",
    "trainer.logger": "trainer.logger",
    "trainer.n_gpus_per_node": "learner.world_size",
}

# Keys that existed under another name: using the old one fails with where it went.
RENAMED_KEYS: dict[str, str] = {
    "rollout.response_length": "rollout.max_new_tokens",
    "buffer.staleness": "buffer.max_staleness",
    "trainer.staleness": "buffer.max_staleness",
    "weight_bus.bucket_size_mb": "weight_bus.bucket_mb",
}


def translate_overrides(overrides: list[str]) -> list[str]:
    """Map verl-style dotted keys to ours; renamed keys fail with a migration message.

    Also accepts ``trainer.mode=X`` as the ``mode=X`` preset group selection.
    """
    out: list[str] = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, value = item.split("=", 1)
        prefix = ""
        while key and key[0] in "+~":
            prefix, key = prefix + key[0], key[1:]
        if key in RENAMED_KEYS:
            raise ConfigError(f"config key {key!r} was renamed to {RENAMED_KEYS[key]!r}")
        if key == "trainer.mode":
            if value not in MODES:
                raise ConfigError(f"trainer.mode={value!r}: must be one of {MODES}")
            key = "mode"
        key = VERL_ALIASES.get(key, key)
        if key == "trainer.logger" and value.startswith("[") and "'" in value:
            value = value.replace("'", "")
        out.append(f"{prefix}{key}={value}")
    return out


def _fail(key: str, value: Any, why: str) -> None:
    raise ConfigError(f"{key}={value!r}: {why}")


def _check_choice(key: str, value: Any, choices: tuple[str, ...] | list[str]) -> None:
    if value not in choices:
        _fail(key, value, f"must be one of {sorted(choices)}")


def _check_positive(cfg: Config, keys: list[str], *, allow_zero: bool = False) -> None:
    for key in keys:
        value = _lookup(cfg, key)
        if value < 0 or (value == 0 and not allow_zero):
            _fail(key, value, "must be >= 0" if allow_zero else "must be > 0")


def _lookup(cfg: Config, key: str) -> Any:
    obj: Any = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def validate(cfg: Config) -> Config:
    """Raise ConfigError for the first inconsistent setting; return cfg unchanged otherwise."""
    from streamrl import algos  # the estimator / loss registries are the single source of names

    _check_choice("trainer.mode", cfg.trainer.mode, MODES)
    _check_choice("rollout.backend", cfg.rollout.backend, ("vllm", "hf", "sglang"))
    _check_choice("buffer.backend", cfg.buffer.backend, ("memory", "redis"))
    _check_choice("weight_bus.backend", cfg.weight_bus.backend, ("collective", "colocated"))
    _check_choice("weight_bus.update_policy", cfg.weight_bus.update_policy, UPDATE_POLICIES)
    _check_choice("task.source", cfg.task.source, ("toy", "parquet", "reasoning_gym"))
    _check_choice("reward.name", cfg.reward.name,
                  ("auto", "toy", "gsm8k", "math_verify", "reasoning_gym", "custom"))
    _check_choice("algorithm.adv_estimator", cfg.algorithm.adv_estimator,
                  list(algos.ADV_ESTIMATORS))
    _check_choice("actor.policy_loss", cfg.actor.policy_loss, list(algos.POLICY_LOSSES))
    _check_choice("actor.loss_agg_mode", cfg.actor.loss_agg_mode, algos.LOSS_AGG_MODES)
    _check_choice("actor.kl_loss_type", cfg.actor.kl_loss_type, algos.KL_PENALTY_TYPES)
    _check_choice("algorithm.kl_penalty", cfg.algorithm.kl_penalty, algos.KL_PENALTY_TYPES)
    _check_choice("algorithm.kl_ctrl_type", cfg.algorithm.kl_ctrl_type, ("fixed", "adaptive"))
    _check_choice("runtime.placement", cfg.runtime.placement, ("colocated", "disaggregated"))
    _check_choice("learner.device", cfg.learner.device, ("auto", "cpu", "cuda"))
    _check_choice("actor.optim.lr_schedule", cfg.actor.optim.lr_schedule, ("constant", "cosine"))
    _check_choice("critic.optim.lr_schedule", cfg.critic.optim.lr_schedule, ("constant", "cosine"))
    for sink in cfg.trainer.logger:
        _check_choice("trainer.logger", sink, ("console", "jsonl", "wandb"))

    _check_positive(cfg, [
        "rollout.n", "rollout.max_new_tokens", "rollout.num_replicas",
        "rollout.max_inflight_groups", "rollout.max_model_len", "task.train_batch_size",
        "task.max_prompt_length", "actor.ppo_mini_batch_size", "actor.ppo_micro_batch_size",
        "actor.ppo_max_token_len", "actor.ppo_epochs", "actor.optim.lr", "learner.world_size",
        "weight_bus.bucket_mb", "weight_bus.timeout_s", "weight_bus.sync_every",
        "trainer.total_steps", "rollout.temperature", "reward.timeout_s", "reward.num_workers",
        "buffer.take_timeout_s",
    ])
    _check_positive(cfg, [
        "buffer.max_staleness", "trainer.test_freq", "trainer.save_freq", "trainer.total_epochs",
        "actor.entropy_coeff", "actor.kl_loss_coef", "actor.grad_clip", "actor.clip_ratio",
        "actor.optim.warmup_steps", "actor.optim.weight_decay", "rollout.max_retries",
        "algorithm.kl_coef", "trainer.max_to_keep",
    ], allow_zero=True)

    if not 0.0 < cfg.rollout.top_p <= 1.0:
        _fail("rollout.top_p", cfg.rollout.top_p, "must be in (0, 1]")
    if cfg.rollout.top_k == 0 or cfg.rollout.top_k < -1:
        _fail("rollout.top_k", cfg.rollout.top_k, "must be -1 (off) or > 0")
    if not 0.0 <= cfg.algorithm.gamma <= 1.0:
        _fail("algorithm.gamma", cfg.algorithm.gamma, "must be in [0, 1]")
    if not 0.0 <= cfg.algorithm.lam <= 1.0:
        _fail("algorithm.lam", cfg.algorithm.lam, "must be in [0, 1]")
    group_estimators = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline")
    if cfg.algorithm.adv_estimator in group_estimators and cfg.rollout.n < 2:
        _fail("rollout.n", cfg.rollout.n,
              f"must be >= 2 with algorithm.adv_estimator={cfg.algorithm.adv_estimator!r} "
              "(a group baseline needs at least two samples)")
    if cfg.task.train_batch_size % cfg.actor.ppo_mini_batch_size:
        _fail("actor.ppo_mini_batch_size", cfg.actor.ppo_mini_batch_size,
              f"must divide task.train_batch_size={cfg.task.train_batch_size}")
    if cfg.actor.ppo_micro_batch_size > cfg.actor.ppo_mini_batch_size:
        _fail("actor.ppo_micro_batch_size", cfg.actor.ppo_micro_batch_size,
              f"is larger than actor.ppo_mini_batch_size={cfg.actor.ppo_mini_batch_size}")
    if cfg.actor.ppo_mini_batch_size % cfg.learner.world_size:
        _fail("actor.ppo_mini_batch_size", cfg.actor.ppo_mini_batch_size,
              f"must be divisible by learner.world_size={cfg.learner.world_size}")
    longest = cfg.task.max_prompt_length + cfg.rollout.max_new_tokens
    if cfg.actor.use_dynamic_bsz and cfg.actor.ppo_max_token_len < longest:
        _fail("actor.ppo_max_token_len", cfg.actor.ppo_max_token_len,
              f"is below the longest sequence task.max_prompt_length + rollout.max_new_tokens"
              f" = {longest}")
    if longest > cfg.rollout.max_model_len:
        _fail("rollout.max_model_len", cfg.rollout.max_model_len,
              f"is below task.max_prompt_length + rollout.max_new_tokens = {longest}")
    low, high = cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high
    for key, value in (("actor.clip_ratio_low", low), ("actor.clip_ratio_high", high)):
        if value is not None and value < 0:
            _fail(key, value, "must be >= 0")
    if cfg.actor.clip_ratio_c <= 1.0:
        _fail("actor.clip_ratio_c", cfg.actor.clip_ratio_c, "must be > 1 (dual-clip bound)")
    if cfg.actor.tis_cap is not None and cfg.actor.tis_cap <= 0:
        _fail("actor.tis_cap", cfg.actor.tis_cap, "must be > 0 or null")
    for lo_key, hi_key in (("actor.icepop_low", "actor.icepop_high"),
                           ("actor.rejection_low", "actor.rejection_high")):
        lo, hi = _lookup(cfg, lo_key), _lookup(cfg, hi_key)
        if (lo is None) != (hi is None):
            _fail(lo_key, lo, f"set both {lo_key} and {hi_key}, or neither")
        if lo is not None and not 0 <= lo < hi:
            _fail(lo_key, lo, f"must satisfy 0 <= {lo_key} < {hi_key}={hi}")
    # Importance weights must be applied once: bypass already uses the behaviour policy as the
    # old policy, and decoupled PPO carries its own proximal/behaviour weight.
    if not cfg.actor.recompute_log_prob and cfg.actor.tis_cap is not None:
        _fail("actor.tis_cap", cfg.actor.tis_cap,
              "cannot be combined with actor.recompute_log_prob=false (bypass)")
    if not cfg.actor.recompute_log_prob and cfg.actor.policy_loss == "decoupled":
        _fail("actor.policy_loss", cfg.actor.policy_loss,
              "needs recomputed proximal log-probs: set actor.recompute_log_prob=true")
    if cfg.actor.policy_loss == "decoupled" and (
        cfg.actor.tis_cap is not None or cfg.actor.icepop_low is not None
    ):
        _fail("actor.policy_loss", cfg.actor.policy_loss,
              "already weights by proximal/behaviour: unset actor.tis_cap and actor.icepop_*")
    if cfg.trainer.mode == "fully_async" and cfg.buffer.max_staleness < 1:
        _fail("buffer.max_staleness", cfg.buffer.max_staleness,
              "must be >= 1 with trainer.mode='fully_async' (0 is trainer.mode=sync)")
    if cfg.weight_bus.backend == "colocated" and cfg.runtime.placement != "colocated":
        _fail("weight_bus.backend", cfg.weight_bus.backend,
              "needs runtime.placement='colocated' (learner and engine share a device)")
    if cfg.reward.name == "custom" and not cfg.reward.custom_path:
        _fail("reward.custom_path", cfg.reward.custom_path, "is required with reward.name=custom")
    if cfg.task.source == "parquet" and not cfg.task.train_files:
        _fail("task.train_files", cfg.task.train_files, "is required with task.source=parquet")
    if cfg.trainer.resume not in ("disable", "auto") and not Path(cfg.trainer.resume).exists():
        _fail("trainer.resume", cfg.trainer.resume, "is neither disable, auto nor a checkpoint dir")
    return cfg


def register_configs() -> None:
    """Register the structured schema so every YAML group file is type-checked against it."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="streamrl_schema", node=_schema(Config))
    groups = {
        "rollout": RolloutConfig, "buffer": BufferConfig, "algorithm": AlgorithmConfig,
        "task": TaskConfig, "weight_bus": WeightBusConfig,
    }
    for group, node in groups.items():
        cs.store(group=group, name=f"{group}_schema", node=_schema(node))


def _schema(node_type: type) -> DictConfig:
    """A typed but writable schema node: OmegaConf marks frozen dataclasses read-only, which
    would stop Hydra from composing overrides; frozenness is restored by ``to_object``."""
    node = OmegaConf.structured(node_type)
    _set_writable(node)
    return node


def _set_writable(node: Any) -> None:
    OmegaConf.set_readonly(node, False)
    if isinstance(node, DictConfig):
        for key in node:
            child = node._get_node(key)
            if isinstance(child, DictConfig):
                _set_writable(child)


def to_config(container: Any) -> Config:
    """Turn a composed OmegaConf node into the frozen Config, with clear type errors."""
    schema = _schema(Config)
    try:
        merged = OmegaConf.merge(schema, container)
        OmegaConf.resolve(merged)
        cfg = OmegaConf.to_object(merged)
    except Exception as exc:  # omegaconf raises several unrelated types for bad values
        raise ConfigError(str(exc).split("\n    full_key")[0]) from exc
    assert isinstance(cfg, Config)
    return _tuples(cfg)


def _tuples(obj: Any) -> Any:
    """OmegaConf hands back lists for tuple fields; restore tuples so configs stay hashable."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: _tuples(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, list):
        return tuple(_tuples(v) for v in obj)
    return obj


def load_config(overrides: list[str] | None = None, config_dir: Path = CONFIG_DIR) -> Config:
    """Compose ``configs/config.yaml`` with (verl-style or native) overrides and validate it."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        try:
            composed = compose(config_name="config", overrides=translate_overrides(overrides or []))
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(str(exc)) from exc
    return validate(to_config(composed))


def replace(cfg: Any, **changes: Any) -> Any:
    """dataclasses.replace with dotted keys: ``replace(cfg, **{"rollout.n": 4})``."""
    nested: dict[str, dict[str, Any]] = {}
    flat: dict[str, Any] = {}
    for key, value in changes.items():
        head, _, rest = key.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            flat[head] = value
    for head, sub in nested.items():
        flat[head] = replace(getattr(cfg, head), **sub)
    return dataclasses.replace(cfg, **flat)
