"""Model presets (configs/model/) and the config keys a real pretrained model needs."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from streamrl.config import CONFIG_DIR, Config, ConfigError, load_config
from streamrl.learner.batching import MicroBatching, plan_update
from streamrl.models import padding_id, resolve_model_path

PRESETS = sorted(p.stem for p in (CONFIG_DIR / "model").glob("*.yaml"))


def _dotted(node: dict, prefix: str = "") -> set[str]:
    keys = set()
    for key, value in node.items():
        keys |= _dotted(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key}
    return keys


def _preset_keys(name: str) -> set[str]:
    return _dotted(yaml.safe_load((CONFIG_DIR / "model" / f"{name}.yaml").read_text()))


def test_every_preset_sets_the_same_model_dependent_keys() -> None:
    assert {"tiny", "smollm2-135m", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b",
            "llama-3.2-1b", "custom"} <= set(PRESETS)
    tiny = _preset_keys("tiny")
    assert {"actor.optim.lr", "rollout.max_new_tokens", "rollout.dtype", "rollout.max_model_len",
            "rollout.stop_token_ids", "model.gradient_checkpointing", "buffer.take_timeout_s",
            "runtime.stall_timeout_s", "task.train_batch_size"} <= tiny
    for name in PRESETS:
        # custom leaves model.path to the user
        assert _preset_keys(name) | ({"model.path"} if name == "custom" else set()) == tiny, name


def test_tiny_preset_is_the_dataclass_defaults() -> None:
    """The embedded defaults and model=tiny are one set of values (Config() in Python equals
    `streamrl train` with no override)."""
    composed, default = load_config(["model=tiny"]), Config()
    for key in _preset_keys("tiny"):
        obj_a, obj_b = composed, default
        for part in key.split("."):
            obj_a, obj_b = getattr(obj_a, part), getattr(obj_b, part)
        assert obj_a == obj_b, key


@pytest.mark.parametrize("name", [p for p in PRESETS if p != "custom"])
def test_each_preset_validates_on_its_own_and_with_each_task(name: str) -> None:
    for task in ("toy", "gsm8k", "reasoning_gym"):
        cfg = load_config([f"model={name}", f"task={task}"])
        assert cfg.task.max_prompt_length + cfg.rollout.max_new_tokens <= cfg.rollout.max_model_len
        assert cfg.mini_batch_groups == cfg.task.train_batch_size


def test_smollm2_preset_is_sized_for_a_real_model() -> None:
    cfg = load_config(["model=smollm2-135m", "task=gsm8k"])
    assert cfg.model.path == "smollm2-135m"
    assert cfg.rollout.max_new_tokens >= 128
    assert cfg.actor.optim.lr <= 1e-5
    assert cfg.buffer.take_timeout_s >= 1800 and cfg.runtime.stall_timeout_s >= 900
    # a user override still wins over the preset
    assert load_config(["model=smollm2-135m", "actor.optim.lr=3e-6"]).actor.optim.lr == 3e-6


def test_llama_preset_stops_at_end_of_turn() -> None:
    cfg = load_config(["model=llama-3.2-1b"])
    assert 128009 in cfg.rollout.stop_token_ids  # <|eot_id|>


def test_custom_preset_needs_a_path() -> None:
    with pytest.raises(ConfigError, match=r"model='custom': .*model.path=DIR"):
        load_config(["model=custom"])
    cfg = load_config(["model=custom", "model.path=/some/dir"])
    assert cfg.model.path == "/some/dir" and cfg.rollout.max_new_tokens >= 512


def _model_dir(tmp_path: Path, vocab: int) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": vocab}))
    return tmp_path


def test_a_real_model_under_the_toy_preset_is_one_clear_error(tmp_path: Path) -> None:
    path = _model_dir(tmp_path, 49152)
    with pytest.raises(ConfigError, match=r"model.path=.*vocabulary 49152.*model=tiny.*"
                                          r"actor.optim.lr=0.001.*smollm2-135m"):
        load_config([f"model.path={path}"])
    with pytest.raises(ConfigError, match="a hub model"):
        load_config(["model.path=Qwen/Qwen2.5-0.5B-Instruct"])
    # the issue's own command: both toy values overridden by hand
    cfg = load_config([f"model.path={path}", "rollout.max_new_tokens=128", "actor.optim.lr=1e-6"])
    assert cfg.rollout.max_new_tokens == 128
    toy = tmp_path / "toy"
    toy.mkdir()
    assert load_config([f"model.path={_model_dir(toy, 320)}"]).actor.optim.lr == 1e-3


def test_unset_batch_keys_derive_from_the_batch() -> None:
    cfg = load_config(["task.train_batch_size=8"])
    assert cfg.actor.ppo_mini_batch_size is None
    assert cfg.mini_batch_groups == 8 and cfg.micro_batch_groups == 8
    assert not cfg.proximal_before_update  # one optimizer step per epoch: no separate pass
    cfg = load_config(["task.train_batch_size=8", "actor.ppo_mini_batch_size=4"])
    assert cfg.mini_batch_groups == 4 and cfg.proximal_before_update
    with pytest.raises(ConfigError, match=r"actor.ppo_mini_batch_size=3: must divide "
                                          r"task.train_batch_size=8"):
        load_config(["task.train_batch_size=8", "actor.ppo_mini_batch_size=3"])
    with pytest.raises(ConfigError, match=r"actor.ppo_micro_batch_size=8: is larger than the "
                                          r"mini-batch's 4 groups"):
        load_config(["actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size=8"])
    with pytest.raises(ConfigError, match=r"actor\.ppo_mini_batch_size=0: must be > 0, or null"):
        load_config(["actor.ppo_mini_batch_size=0"])


def test_verl_micro_batch_per_gpu_counts_samples_per_rank() -> None:
    cfg = load_config(["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
                       "actor.use_dynamic_bsz=false"])
    assert cfg.actor.ppo_micro_batch_size_per_gpu == 3 and cfg.actor.ppo_micro_batch_size is None
    with pytest.raises(ConfigError, match=r"both size the micro-batch"):
        load_config(["actor.ppo_micro_batch_size_per_gpu=3", "actor.ppo_micro_batch_size=1"])
    # 2 groups of 4 samples, 2 ranks: each rank holds 4 rows, in micro-batches of 3 samples
    group_ids = np.array([0] * 4 + [1] * 4)
    policy = MicroBatching(dynamic=False, max_token_len=0, micro_groups=2, micro_rows=3)
    for rank in (0, 1):
        [micros] = plan_update(group_ids, [10] * 8, groups_per_mini=2, policy=policy,
                               rank=rank, world_size=2)
        assert [len(m) for m in micros] == [2, 2]  # ceil(4 / 3) = 2 micro-batches, balanced
    policy = MicroBatching(dynamic=False, max_token_len=0, micro_groups=2, micro_rows=1)
    [micros] = plan_update(group_ids, [10] * 8, groups_per_mini=2, policy=policy, rank=0,
                           world_size=2)
    assert [len(m) for m in micros] == [1, 1, 1, 1]


def test_rollout_dtype_and_kv_cache_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"rollout.dtype='bf16': must be one of "
                                          r"\['bfloat16', 'float16', 'float32'\]"):
        load_config(["rollout.dtype=bf16"])
    with pytest.raises(ConfigError, match=r"rollout\.kv_cache_gb=0\.0: must be > 0"):
        load_config(["rollout.kv_cache_gb=0"])
    with pytest.raises(ConfigError, match=r"rollout\.stop_token_ids"):
        load_config(["rollout.stop_token_ids=[-1]"])


@pytest.mark.vllm
def test_kv_cache_and_stop_ids_reach_vllm(tiny_model_dir: Path) -> None:
    from streamrl.rollout_fleet.replica import greedy_params, sampling_params
    from streamrl.rollout_fleet.vllm_engine import engine_args, vllm_sampling

    cfg = load_config(["rollout.kv_cache_gb=1.5", "rollout.stop_token_ids=[7,9]"])
    model = str(tiny_model_dir)
    args = engine_args(model, cfg.rollout, model)
    assert args.kv_cache_memory_bytes == int(1.5 * 2**30)
    assert engine_args(model, load_config().rollout).kv_cache_memory_bytes is None
    for params in (sampling_params(cfg.rollout), greedy_params(cfg.rollout)):
        sampling, _ = vllm_sampling(params, stream=False)
        assert sampling.stop_token_ids == [7, 9]


def test_replica_gives_vllm_the_tokenizer_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    """model.tokenizer_path reaches the engine (a loaded tokenizer object was passed, which
    vLLM ignored, loading the model directory's tokenizer instead)."""
    import streamrl.rollout_fleet as fleet
    from streamrl.config import replace
    from streamrl.runtime.actors import ReplicaActor

    seen = {}
    monkeypatch.setattr(fleet, "make_engine",
                        lambda rollout, path, tokenizer, **kw: seen.update(tok=tokenizer))
    cfg = replace(Config(), **{"model.path": "/m", "model.tokenizer_path": "/tok"})
    ReplicaActor(cfg, 0, None, None)._make_engine()
    assert seen["tok"] == "/tok"


def test_padding_id_without_a_pad_token() -> None:
    tok = SimpleNamespace(pad_token_id=None, eos_token_id=128009)
    assert padding_id(tok) == 128009
    assert padding_id(SimpleNamespace(pad_token_id=3, eos_token_id=1)) == 3
    assert padding_id(SimpleNamespace(pad_token_id=None, eos_token_id=None)) == 0


def _fake_hub_cache(root: Path, repo: str) -> Path:
    folder = root / f"models--{repo.replace('/', '--')}"
    commit = "a" * 40
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    return snapshot


def test_hub_ids_resolve_to_their_cached_snapshot(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    snapshot = _fake_hub_cache(tmp_path, "org/cached-model")
    assert resolve_model_path("org/cached-model") == str(snapshot)
    with pytest.raises(ConfigError, match=r"model.path='org/absent': not a directory, nor a hub "
                                          r"id .*huggingface-cli download org/absent"):
        resolve_model_path("org/absent")


def test_workers_keep_the_drivers_hub_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    from streamrl.runtime.placement import WORKER_ENV, worker_env_vars

    assert "HF_HUB_OFFLINE" not in WORKER_ENV
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert "HF_HUB_OFFLINE" not in worker_env_vars(Config())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", "/data/hf")
    env = worker_env_vars(Config())
    assert env["HF_HUB_OFFLINE"] == "1" and env["HF_HOME"] == "/data/hf"
