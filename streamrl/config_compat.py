"""verl compatibility: verl's dotted config keys, and keys streamrl renamed.

- ``VERL_ALIASES``: verl keys accepted as overrides (``actor_rollout_ref.rollout.n=4``),
- ``VERL_VALUES``: the aliased verl keys whose values differ from ours, value by value,
- ``RENAMED_KEYS``: keys that moved; using the old name fails with where it went,
- ``translate_overrides``: applies both to a list of ``key=value`` overrides.

Depends only on ``streamrl.errors``; ``config.load_config`` calls it before composing.
"""

from __future__ import annotations

from collections.abc import Iterable

from streamrl.errors import ConfigError

# verl's dotted keys -> ours. Values are taken as they are, except VERL_VALUES' keys.
VERL_ALIASES: dict[str, str] = {
    "actor_rollout_ref.model.path": "model.path",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "model.gradient_checkpointing",
    "actor_rollout_ref.model.lora_rank": "actor.lora.rank",
    "actor_rollout_ref.model.lora_alpha": "actor.lora.alpha",
    "actor_rollout_ref.model.target_modules": "actor.lora.target_modules",
    "actor_rollout_ref.rollout.n": "rollout.n",
    "actor_rollout_ref.rollout.name": "rollout.backend",
    "actor_rollout_ref.rollout.temperature": "rollout.temperature",
    "actor_rollout_ref.rollout.top_p": "rollout.top_p",
    "actor_rollout_ref.rollout.top_k": "rollout.top_k",
    "actor_rollout_ref.rollout.response_length": "rollout.max_new_tokens",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "actor_rollout_ref.rollout.enforce_eager": "rollout.enforce_eager",
    "actor_rollout_ref.rollout.dtype": "rollout.dtype",
    "actor_rollout_ref.rollout.max_model_len": "rollout.max_model_len",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "actor.ppo_micro_batch_size_per_gpu",
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
    "critic.loss_agg_mode": "critic.loss_agg_mode",
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
    # verl's rollout correction. IS is on when actor.tis_cap is set: verl's rollout_is=token
    # with its default threshold (2.0) needs rollout_is_threshold=2.0 here too.
    "algorithm.rollout_correction.rollout_is": "actor.rollout_is_level",
    "algorithm.rollout_correction.rollout_is_threshold": "actor.tis_cap",
    "algorithm.rollout_correction.rollout_is_batch_normalize": "actor.rollout_is_batch_normalize",
    "algorithm.rollout_correction.rollout_rs": "actor.rollout_rs",
    "algorithm.rollout_correction.rollout_rs_threshold": "actor.rollout_rs_threshold",
    "algorithm.rollout_correction.bypass_mode": "actor.recompute_log_prob",
    "algorithm.rollout_correction.loss_type": "actor.policy_loss",
    # DAPO (verl's recipe keys)
    "algorithm.filter_groups.enable": "rollout.filter_groups",
    "reward_model.overlong_buffer.enable": "rollout.overlong_buffer.enable",
    "reward_model.overlong_buffer.len": "rollout.overlong_buffer.len",
    "reward_model.overlong_buffer.penalty_factor": "rollout.overlong_buffer.penalty_factor",
    "data.train_batch_size": "task.train_batch_size",
    "data.max_prompt_length": "task.max_prompt_length",
    "data.max_response_length": "rollout.max_new_tokens",
    "data.train_files": "task.train_files",
    "data.val_files": "task.val_files",
    "data.shuffle": "task.shuffle",
    "custom_reward_function.path": "reward.custom_path",
    "custom_reward_function.name": "reward.custom_name",
    # verl's reward model: turning it on replaces the rule reward
    "reward_model.enable": "reward.kind",
    "reward_model.model.path": "reward.model.path",
    "reward_model.micro_batch_size_per_gpu": "reward.model.micro_batch_size",
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

# Aliased verl keys whose values are not ours: verl value (any case) -> ours; any other value
# fails naming the verl key. bypass_mode is the negation of recompute_log_prob; loss_type (verl
# reads it in bypass mode only) picks PPO-clip (vanilla) or REINFORCE whatever the mode; verl's
# rollout_is=null (no IS weights) is actor.tis_cap=null here.
VERL_VALUES: dict[str, dict[str, str]] = {
    "algorithm.rollout_correction.rollout_is": {"token": "token", "sequence": "sequence"},
    "algorithm.rollout_correction.bypass_mode": {"true": "false", "false": "true"},
    "algorithm.rollout_correction.loss_type": {"ppo_clip": "vanilla", "reinforce": "reinforce"},
    "reward_model.enable": {"true": "model", "false": "rule"},
}

# Keys that existed under another name: using the old one fails with where it went.
RENAMED_KEYS: dict[str, str] = {
    "rollout.response_length": "rollout.max_new_tokens",
    "buffer.staleness": "buffer.max_staleness",
    "trainer.staleness": "buffer.max_staleness",
    "weight_bus.bucket_size_mb": "weight_bus.bucket_mb",
}


def translate_overrides(overrides: list[str], modes: Iterable[str]) -> list[str]:
    """Map verl-style dotted keys (and the values of VERL_VALUES' keys) to ours; renamed keys
    fail with a migration message.

    Also accepts ``trainer.mode=X`` (X one of ``modes``) as the ``mode=X`` preset selection.
    """
    modes = tuple(modes)
    out: list[str] = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.lstrip("+~"):
            raise ConfigError(f"override {item!r} is not of the form key=value")
        prefix = ""
        while key and key[0] in "+~":
            prefix, key = prefix + key[0], key[1:]
        if key in RENAMED_KEYS:
            raise ConfigError(f"config key {key!r} was renamed to {RENAMED_KEYS[key]!r}")
        if key == "trainer.mode":
            if value not in modes:
                raise ConfigError(f"trainer.mode={value!r}: must be one of {modes}")
            key = "mode"
        if key in VERL_VALUES:
            value = _verl_value(key, value)
        key = VERL_ALIASES.get(key, key)
        if key == "trainer.logger" and value.startswith("[") and "'" in value:
            value = value.replace("'", "")
        out.append(f"{prefix}{key}={value}")
    return out


def _verl_value(key: str, value: str) -> str:
    values = VERL_VALUES[key]
    ours = values.get(value.strip("'\"").lower())
    if ours is None:
        hint = ("; verl's null (no IS weights) is actor.tis_cap=null"
                if key == "algorithm.rollout_correction.rollout_is" else "")
        raise ConfigError(f"{key}={value!r}: must be one of {tuple(values)} "
                          f"(streamrl's {VERL_ALIASES[key]}){hint}")
    return ours
