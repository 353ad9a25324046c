"""Config composition, verl aliases, renamed keys and validation errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from streamrl.config import (
    CONFIG_DIR,
    FULLY_ASYNC_DEFAULT_STALENESS,
    MODE_PRESETS,
    MODES,
    Config,
    ConfigError,
    load_config,
    replace,
    validate,
    with_mode,
)
from streamrl.config_compat import VERL_ALIASES, VERL_VALUES, translate_overrides
from streamrl.runtime.placement import engine_in_process


def test_defaults_compose_and_validate() -> None:
    cfg = load_config()
    assert cfg.trainer.mode == "fully_async"
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.rollout.backend == "vllm"
    assert cfg.buffer.backend == "memory"
    assert cfg.task.source == "toy"
    assert cfg.buffer.max_staleness == 1
    assert cfg.weight_bus.update_policy == "pause"
    assert cfg.trainer.output_dir == "outputs/toy-grpo"  # interpolation resolved


@pytest.mark.parametrize(("mode", "eta", "policy"), [
    ("sync", 0, "drain"), ("one_step_off", 1, "drain"), ("fully_async", 1, "pause"),
])
def test_mode_presets(mode: str, eta: int, policy: str) -> None:
    cfg = load_config([f"trainer.mode={mode}"])
    assert cfg.trainer.mode == mode
    assert cfg.buffer.max_staleness == eta
    assert cfg.weight_bus.update_policy == policy
    assert with_mode(load_config(), mode) == cfg


@pytest.mark.parametrize(("overrides", "in_process"), [
    ([], None), (["trainer.mode=one_step_off"], None), (["trainer.mode=sync"], False),
    (["rollout.engine_in_process=false"], False),
    (["trainer.mode=sync", "rollout.engine_in_process=true"], True),
    (["rollout.backend=hf"], False),
])
def test_replicas_step_vllm_in_process_where_rollout_overlaps_learning(
        overrides: list[str], in_process: bool | None) -> None:
    """None: in process exactly on machines without CUDA (docs/speedup.md)."""
    import torch

    expected = not torch.cuda.is_available() if in_process is None else in_process
    assert engine_in_process(load_config(overrides)) is expected


@pytest.mark.parametrize(("mode", "sync"), [
    ("sync", True), ("one_step_off", False), ("fully_async", False),
])
def test_only_sync_mode_is_sync(mode: str, sync: bool) -> None:
    assert load_config([f"trainer.mode={mode}"]).is_sync is sync


def test_fully_async_takes_its_bound_and_policy_from_the_user() -> None:
    cfg = load_config(["trainer.mode=fully_async", "buffer.max_staleness=3",
                       "weight_bus.update_policy=abort", "weight_bus.sync_every=4"])
    assert (cfg.buffer.max_staleness, cfg.weight_bus.update_policy) == (3, "abort")
    assert with_mode(Config(), "fully_async", 3).buffer.max_staleness == 3


@pytest.mark.parametrize("mode", MODES)
def test_mode_yaml_shows_the_preset(mode: str) -> None:
    shown = yaml.safe_load(Path(CONFIG_DIR, "mode", f"{mode}.yaml").read_text())
    preset = MODE_PRESETS[mode]
    assert shown["trainer"] == {"mode": mode}
    default_eta = FULLY_ASYNC_DEFAULT_STALENESS if preset.max_staleness is None else \
        preset.max_staleness
    assert shown["buffer"] == {"max_staleness": default_eta}
    assert shown["weight_bus"] == {"update_policy": preset.update_policies[0]}


@pytest.mark.parametrize(("overrides", "keys"), [
    (["trainer.mode=sync", "weight_bus.sync_every=2"],
     ("weight_bus.sync_every=2", "buffer.max_staleness")),
    (["trainer.mode=one_step_off", "weight_bus.sync_every=3"],
     ("weight_bus.sync_every=3", "buffer.max_staleness")),
    (["trainer.mode=fully_async", "buffer.max_staleness=2", "weight_bus.sync_every=4"],
     ("weight_bus.sync_every=4", "buffer.max_staleness")),
    (["trainer.mode=sync", "buffer.max_staleness=2"],
     ("buffer.max_staleness=2", "trainer.mode='sync'")),
    (["trainer.mode=one_step_off", "buffer.max_staleness=0"],
     ("buffer.max_staleness=0", "trainer.mode='one_step_off'")),
    (["trainer.mode=sync", "weight_bus.update_policy=pause"],
     ("weight_bus.update_policy='pause'", "trainer.mode='sync'")),
    (["trainer.mode=one_step_off", "weight_bus.update_policy=abort"],
     ("weight_bus.update_policy='abort'", "trainer.mode='one_step_off'")),
    (["trainer.mode=fully_async", "buffer.max_staleness=0"],
     ("buffer.max_staleness=0", "trainer.mode='fully_async'")),
])
def test_contradicting_the_mode_names_both_keys(overrides: list[str], keys: tuple[str, ...]
                                                ) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(overrides)
    for key in keys:
        assert key in str(err.value)


def test_cli_rejects_sync_with_sparse_weight_sync(capsys: pytest.CaptureFixture[str]) -> None:
    from streamrl.cli import main

    assert main(["config", "trainer.mode=sync", "weight_bus.sync_every=2"]) != 0
    err = capsys.readouterr().err
    assert "weight_bus.sync_every=2" in err and "trainer.mode='sync'" in err


def test_group_selection_and_verl_aliases() -> None:
    cfg = load_config([
        "algorithm=rloo", "buffer=redis", "rollout=hf",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "data.train_batch_size=32",
        "trainer.total_epochs=3",
        "actor_rollout_ref.actor.optim.lr=3e-6",
        "trainer.logger=['console','wandb']",
    ])
    assert cfg.algorithm.adv_estimator == "rloo"
    assert cfg.buffer.backend == "redis"
    assert cfg.rollout.backend == "hf"
    assert cfg.rollout.n == 4
    assert cfg.actor.ppo_mini_batch_size == 8
    assert cfg.actor.use_kl_loss and cfg.use_ref
    assert cfg.task.train_batch_size == 32
    assert cfg.trainer.total_epochs == 3
    assert cfg.actor.optim.lr == pytest.approx(3e-6)
    assert cfg.trainer.logger == ("console", "wandb")


def test_every_alias_target_exists() -> None:
    cfg = Config()
    for verl_key, ours in VERL_ALIASES.items():
        obj = cfg
        for part in ours.split("."):
            assert hasattr(obj, part), f"{verl_key} -> {ours}: no field {part!r}"
            obj = getattr(obj, part)
    assert set(VERL_VALUES) <= set(VERL_ALIASES)


def test_verl_rollout_correction_and_critic_aliases() -> None:
    cfg = load_config([
        "algorithm=ppo",
        "critic.loss_agg_mode=token-sum",
        "algorithm.rollout_correction.bypass_mode=true",
        "algorithm.rollout_correction.loss_type=reinforce",
        "algorithm.rollout_correction.rollout_is=sequence",
        "algorithm.rollout_correction.rollout_is_threshold=2.5",
        "algorithm.rollout_correction.rollout_is_batch_normalize=True",
        "algorithm.rollout_correction.rollout_rs=seq_mean_k3",
        "algorithm.rollout_correction.rollout_rs_threshold=0.01",
    ])
    assert cfg.critic.loss_agg_mode == "token-sum"
    assert not cfg.actor.recompute_log_prob and cfg.actor.policy_loss == "reinforce"
    assert (cfg.actor.rollout_is_level, cfg.actor.tis_cap) == ("sequence", 2.5)
    assert cfg.actor.rollout_is_batch_normalize
    assert (cfg.actor.rollout_rs, cfg.actor.rollout_rs_threshold) == ("seq_mean_k3", "0.01")
    decoupled = load_config(["algorithm.rollout_correction.bypass_mode=False",
                             "algorithm.rollout_correction.loss_type=ppo_clip",
                             "algorithm.rollout_correction.rollout_rs='token_k1,seq_max_k2'",
                             "algorithm.rollout_correction.rollout_rs_threshold='0.5_2,0.1'"])
    assert decoupled.actor.recompute_log_prob and decoupled.actor.policy_loss == "vanilla"
    assert decoupled.actor.rollout_rs == "token_k1,seq_max_k2"
    assert decoupled.actor.rollout_rs_threshold == "0.5_2,0.1"


def test_verl_reward_model_aliases() -> None:
    cfg = load_config(["reward_model.enable=True", "reward_model.model.path=tiny",
                       "reward_model.micro_batch_size_per_gpu=4"])
    assert cfg.reward.kinds == ("model",) and cfg.reward.model.path == "tiny"
    assert cfg.reward.model.micro_batch_size == 4
    assert load_config(["reward_model.enable=false"]).reward.kinds == ("rule",)


@pytest.mark.parametrize(("override", "pattern"), [
    ("algorithm.rollout_correction.bypass_mode=maybe",
     r"bypass_mode='maybe': must be one of \('true', 'false'\) "
     r"\(streamrl's actor.recompute_log_prob\)"),
    ("algorithm.rollout_correction.loss_type=gspo", r"loss_type='gspo': must be one of"),
    ("algorithm.rollout_correction.rollout_is=null", r"rollout_is='null'.*actor.tis_cap=null"),
])
def test_verl_value_outside_the_translation_names_the_verl_key(override: str, pattern: str
                                                               ) -> None:
    with pytest.raises(ConfigError, match=pattern):
        translate_overrides([override], MODES)


def test_gae_turns_on_critic() -> None:
    assert load_config(["algorithm=ppo"]).use_critic


def test_renamed_key_fails_with_migration_message() -> None:
    with pytest.raises(ConfigError, match=r"buffer.staleness.*renamed to 'buffer.max_staleness'"):
        translate_overrides(["buffer.staleness=2"], MODES)


def test_unknown_key_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.nn"):
        load_config(["rollout.nn=3"])


def test_wrong_type_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.n"):
        load_config(["rollout.n=many"])


def test_bad_mode_names_value() -> None:
    with pytest.raises(ConfigError, match=r"trainer.mode='turbo'"):
        load_config(["trainer.mode=turbo"])


@pytest.mark.parametrize(("changes", "pattern"), [
    ({"actor.ppo_mini_batch_size": 5}, r"actor.ppo_mini_batch_size=5: must divide"),
    ({"rollout.n": 1}, r"rollout.n=1: must be >= 2 with algorithm.adv_estimator='grpo'"),
    ({"buffer.max_staleness": -1}, r"buffer.max_staleness=-1: must be >= 0"),
    ({"algorithm.adv_estimator": "magic"}, r"algorithm.adv_estimator='magic': must be one of"),
    ({"actor.loss_agg_mode": "token-sum-mean"}, r"actor.loss_agg_mode='token-sum-mean'"),
    ({"actor.policy_loss": "ppo3"}, r"actor.policy_loss='ppo3'"),
    ({"actor.kl_loss_type": "k9"}, r"actor.kl_loss_type='k9'"),
    ({"actor.ppo_micro_batch_size": 32}, r"actor.ppo_micro_batch_size=32: is larger than"),
    ({"rollout.top_p": 0.0}, r"rollout.top_p=0.0"),
    ({"rollout.top_k": 0}, r"rollout.top_k=0"),
    ({"rollout.backend": "sglang", "rollout.top_p": 0.9},
     r"rollout.top_p=0.9: needs rollout.backend=vllm or hf"),
    ({"actor.icepop_level": "row"}, r"actor.icepop_level='row': must be one of"),
    ({"actor.loss_scale_factor": 0.0}, r"actor.loss_scale_factor=0.0: must be > 0"),
    ({"actor.gspo_clip_ratio_high": -1e-4}, r"actor.gspo_clip_ratio_high=-0.0001: must be >= 0"),
    ({"actor.decoupled_weight_cap": 0.0}, r"actor.decoupled_weight_cap=0.0: must be > 0"),
    ({"actor.clip_ratio_c": 1.0}, r"actor.clip_ratio_c=1.0"),
    ({"actor.icepop_low": 0.5}, r"actor.icepop_low=0.5: set both"),
    ({"buffer.max_staleness": 0}, r"buffer.max_staleness=0: must be >= 1 with trainer.mode"),
    ({"weight_bus.backend": "colocated"},
     r"weight_bus.backend='colocated': swaps weights inside a hybrid worker: set "
     r"runtime.placement=colocated"),
    ({"weight_bus.backend": "colocated", "runtime.placement": "colocated",
      "rollout.backend": "hf"}, r"rollout.backend='hf': co-located hybrid workers run vLLM"),
    ({"weight_bus.backend": "colocated", "runtime.placement": "colocated",
      "rollout.num_replicas": 2}, r"rollout.num_replicas=2: must equal learner.world_size=1"),
    ({"reward.name": "custom"}, r"reward.custom_path=None: is required"),
    ({"task.max_prompt_length": 600}, r"rollout.max_model_len=512"),
    ({"task.long_tail": 0.25, "task.long_tail_tokens": 600},
     r"rollout.max_model_len=512: is below task.max_prompt_length \+ task.long_tail_tokens"),
    ({"actor.ppo_max_token_len": 10}, r"actor.ppo_max_token_len=10"),
    ({"actor.recompute_log_prob": False, "actor.tis_cap": 2.0}, r"actor.tis_cap=2.0: cannot"),
    ({"critic.loss_agg_mode": "token-avg"}, r"critic.loss_agg_mode='token-avg': must be one of"),
    ({"actor.rollout_is_level": "seq"}, r"actor.rollout_is_level='seq': must be one of"),
    ({"actor.rollout_is_level": "sequence", "actor.tis_cap": None},
     r"actor.rollout_is_level='sequence': .*tis_cap"),
    ({"actor.rollout_is_batch_normalize": True, "actor.tis_cap": None},
     r"actor.rollout_is_batch_normalize=True: .*tis_cap"),
    ({"actor.rollout_rs": "token_k4", "actor.rollout_rs_threshold": "2"},
     r"actor.rollout_rs='token_k4': must be a comma list"),
    ({"actor.rollout_rs": "token_k2"}, r"actor.rollout_rs_threshold=None: is required"),
    ({"actor.rollout_rs": "token_k2", "actor.rollout_rs_threshold": "1_2"},
     r"actor.rollout_rs_threshold='1_2': '1_2' for token_k2"),
    ({"actor.rollout_rs_threshold": "2"}, r"actor.rollout_rs_threshold='2': is set but"),
    ({"actor.recompute_log_prob": False, "actor.policy_loss": "decoupled", "actor.tis_cap": None},
     r"actor.policy_loss='decoupled': needs recomputed"),
    ({"actor.policy_loss": "decoupled", "actor.tis_cap": 2.0}, r"already weights"),
    ({"learner.world_size": 3}, r"must be divisible by learner.world_size=3"),
    ({"trainer.logger": ("console", "mlflow")}, r"trainer.logger='mlflow'"),
    ({"trainer.log_level": "loud"}, r"trainer.log_level='loud'"),
    ({"rollout.num_replicas": 0}, r"rollout.num_replicas=0: needs buffer=redis"),
    ({"buffer.lease_ttl_s": 0.0}, r"buffer.lease_ttl_s=0.0: must be > 0"),
    # a trainer fed by streamrl serve's episodes (no replicas of its own)
    ({"rollout.num_replicas": 0, "buffer.backend": "redis", "algorithm.adv_estimator": "remax",
      "rollout.greedy_baseline": True},
     r"algorithm.adv_estimator='remax': cannot train on streamrl serve's episodes"),
    ({"rollout.num_replicas": 0, "buffer.backend": "redis", "actor.ppo_max_token_len": 256},
     r"actor.ppo_max_token_len=256: is below rollout.max_model_len=512"),
    ({"serve.max_tokens": 0}, r"serve.max_tokens=0: must be > 0"),
    ({"rollout.backend": "hf", "rollout.engine_in_process": True},
     r"rollout.engine_in_process=True: only vLLM runs in the replica's process"),
])
def test_validate_names_key_and_value(changes: dict, pattern: str) -> None:
    cfg = replace(Config(), **changes)
    with pytest.raises(ConfigError, match=pattern):
        validate(cfg)


def test_valid_default_dataclass_passes() -> None:
    assert validate(Config()) == Config()


def test_config_imports_neither_torch_nor_the_rollout_fleet() -> None:
    """Config sits below the components: importing it stays light, and checking names (agent
    environments included) reads registries, never the fleet (``algos``' registries need
    torch, so validation may import that)."""
    code = """if True:
        import sys
        import streamrl.config as c
        fleet = lambda: any(m.startswith("streamrl.rollout_fleet") for m in sys.modules)
        print("torch" in sys.modules, fleet())
        agent = {"rollout.agent": "relay", "rollout.max_model_len": 1024}
        c.validate(c.replace(c.Config(), **agent))
        print(fleet())
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "False"]


@pytest.mark.parametrize(("agent", "ok"), [
    ("relay", True), ("calculator", True), ("my_pkg.envs:MyEnv", True), ("envs.py:MyEnv", True),
    ("nosuchenv", False),
])
def test_agent_names_a_builtin_environment_or_an_import_path(agent: str, ok: bool) -> None:
    cfg = replace(Config(), **{"rollout.agent": agent, "rollout.max_model_len": 1024})
    if ok:
        validate(cfg)
    else:
        with pytest.raises(ConfigError, match=r"rollout.agent='nosuchenv': must be a built-in "
                           r"environment \['calculator', 'reasoning_gym', 'relay'\]"):
            validate(cfg)


def test_loss_aggregation_and_rollout_correction_overrides_compose() -> None:
    cfg = load_config([
        "actor.loss_agg_mode=token-sum",
        "critic.loss_agg_mode=token-sum",
        "actor.policy_loss=reinforce",
        "actor.recompute_log_prob=false",  # bypass takes truncated IS weights with reinforce
        "actor.tis_cap=2.0",
        "actor.rollout_is_level=sequence",
        "actor.rollout_is_batch_normalize=true",
        "actor.rollout_rs='token_k1,seq_max_k3'",
        "actor.rollout_rs_threshold='0.5_2.0,0.1'",
    ])
    assert (cfg.actor.loss_agg_mode, cfg.critic.loss_agg_mode) == ("token-sum", "token-sum")
    assert cfg.actor.policy_loss == "reinforce" and not cfg.actor.recompute_log_prob
    assert (cfg.actor.tis_cap, cfg.actor.rollout_is_level) == (2.0, "sequence")
    assert cfg.actor.rollout_is_batch_normalize
    assert cfg.actor.rollout_rs == "token_k1,seq_max_k3"
    assert cfg.actor.rollout_rs_threshold == "0.5_2.0,0.1"
    assert Config().critic.loss_agg_mode == "token-mean"


def test_cli_reports_config_error_without_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    from streamrl.cli import main

    assert main(["config", "rollout.n=1"]) == 2
    err = capsys.readouterr().err
    assert "config error" in err and "rollout.n=1" in err
    assert "Traceback" not in err



@pytest.mark.parametrize(("overrides", "line"), [
    (["algorithm=remax"], "algorithm.adv_estimator='remax': cannot train on streamrl serve's"),
    (["actor.ppo_max_token_len=256"],
     "actor.ppo_max_token_len=256: is below rollout.max_model_len=512"),
])
def test_serve_refuses_what_would_kill_its_learner_at_start(
        overrides: list[str], line: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The service's learner trains on its clients' episodes: a setting that would kill its
    thread on the first such batch is one line at start (exit 2), before anything starts."""
    from streamrl.cli import main

    monkeypatch.setattr("streamrl.logs.configure", lambda level: None)  # this process's logging
    monkeypatch.setattr("streamrl.serve.run_serve", lambda cfg: 0)  # never start a service here

    assert main(["serve", *overrides]) == 2
    err = capsys.readouterr().err
    assert line in err and len(err.strip().splitlines()) == 1
    assert main(["config", *overrides]) == 0  # a trainer with replicas of its own may
