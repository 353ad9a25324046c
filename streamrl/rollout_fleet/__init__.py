"""The rollout fleet: engines behind one protocol, continuous replicas, rewards, routing.

``make_engine(rollout, model_path, tokenizer)`` is the one place a backend is chosen (by
``rollout.backend``); backends are imported only when picked, so importing this package stays
cheap (it is also imported inside vLLM's worker process for the worker extension).
``load_user_code(cfg)`` imports the user code a config names, for a check before anything starts.
"""

from __future__ import annotations

from typing import Any

from streamrl.config import Config, LoraConfig, RolloutConfig
from streamrl.net import free_port
from streamrl.rollout_fleet.engine import Completion, RolloutEngine, SamplingParams

__all__ = ["Completion", "RolloutEngine", "SamplingParams", "load_user_code", "make_engine"]


def make_engine(
    rollout: RolloutConfig, model_path: str, tokenizer: Any = None, *, version: int = 0,
    in_process: bool = False, lora: LoraConfig | None = None, threads: int | None = None,
) -> RolloutEngine:
    """Build the engine ``rollout.backend`` names for the HF model at ``model_path``.

    ``in_process`` (vLLM only): step the engine on a thread of this process instead of an
    engine-core process (``runtime.placement.engine_in_process`` decides it for a replica).

    ``tokenizer`` may be a tokenizer directory (used by vLLM) or a loaded tokenizer (ignored by
    the engines, which load their own from ``model_path``). Building a vLLM engine blocks while
    it starts (its engine-core process, or its thread in process: tens of seconds on CPU).
    ``lora`` (vLLM only): serve weight versions as LoRA adapters of that shape. ``threads``
    (vLLM): the engine's torch threads, a replica's ``runtime.cpus_per_replica`` (None: one in
    process, ``OMP_NUM_THREADS`` in an engine-core process).
    """
    import torch

    tokenizer_path = tokenizer if isinstance(tokenizer, str) else None
    if rollout.backend == "vllm" and in_process:
        from streamrl.rollout_fleet.vllm_inproc_engine import InprocVLLMEngine

        return InprocVLLMEngine(model_path, rollout, tokenizer_path=tokenizer_path,
                                version=version, threads=threads or 1, lora=lora)
    if in_process:
        raise ValueError(f"rollout.backend={rollout.backend!r}: only vLLM runs in process")
    if rollout.backend == "vllm":
        from streamrl.rollout_fleet.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, rollout, tokenizer_path=tokenizer_path, version=version,
                          threads=threads, lora=lora)
    if rollout.backend == "hf":
        from streamrl.rollout_fleet.hf_engine import HFEngine

        return HFEngine(
            model_path, dtype=rollout.dtype, device="cuda" if torch.cuda.is_available() else "cpu",
            seed=rollout.seed, max_model_len=rollout.max_model_len,
            max_concurrency=rollout.max_inflight_groups, version=version,
        )
    if rollout.backend == "sglang":
        from streamrl.rollout_fleet.sglang_engine import SGLangEngine

        if version != 0:
            raise ValueError(f"version={version}: an SGLang server starts serving model_path as "
                             "version 0; newer versions arrive over the weight bus")
        args = ["--dtype", rollout.dtype, "--context-length", str(rollout.max_model_len),
                "--random-seed", str(rollout.seed),
                "--mem-fraction-static", str(rollout.gpu_memory_utilization),
                "--enable-memory-saver"]
        if tokenizer_path:
            args += ["--tokenizer-path", tokenizer_path]
        if rollout.enforce_eager:
            args.append("--disable-cuda-graph")
        return SGLangEngine.launch(model_path, port=free_port(), extra_args=args)
    raise ValueError(f"rollout.backend={rollout.backend!r}: must be one of vllm, hf, sglang")


def load_user_code(cfg: Config) -> None:
    """Import the custom reward function, agent environment and tools ``cfg`` names, here and
    now: code that does not load fails as one ConfigError before any engine starts, not later
    inside a replica."""
    from streamrl.rollout_fleet.rewards.custom import load_custom_function
    from streamrl.rollout_fleet.rewards.dispatch import ScorerSpec

    reward = cfg.reward
    if reward.custom_path is not None and ScorerSpec(reward.name, reward.custom_path).uses_custom:
        load_custom_function(reward.custom_path, reward.custom_name)
    if cfg.rollout.agent is not None:
        from streamrl.plugins import agent_env_spec
        from streamrl.rollout_fleet.agent import load_object

        load_object(agent_env_spec(cfg.rollout.agent), "rollout.agent")
        for spec in cfg.rollout.tools:
            load_object(spec, "rollout.tools")
