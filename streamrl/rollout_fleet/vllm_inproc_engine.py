"""InprocVLLMEngine: the RolloutEngine protocol on vLLM's ``LLMEngine`` running in this process.

The co-located hybrid worker (``runtime.hybrid``) holds a learner rank and its engine in one
process, so the learner hands the engine its weights as tensors: no socket, no serialisation,
no collective. ``VLLMEngine`` cannot do that (``AsyncLLM`` always runs the engine core in a child
process); ``LLMEngine`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps core and worker here.

How it works:
- One engine thread owns the ``LLMEngine``. It runs commands (add, abort, pause, swap) between
  two ``step()`` calls and steps while requests are unfinished and it is not paused, handing each
  step's outputs to the event loop, where ``generate`` awaits them. So a swap is atomic by
  construction: no step runs while weights change.
- ``load_weights`` runs ``load_into_worker`` in the worker with the caller's iterator (the
  learner's gathered parameters, one at a time: on GPU no second full copy is ever built; on
  CPU the packed linears load through full-size weights, see ``cpu_reload``; or a weight-bus
  version received bucket by bucket as it is iterated, ``weight_bus.receive=streamed``), then
  resets the prefix cache (running requests recompute their KV with the new weights) and
  relabels the weight version, so per-token version spans stay exact. An iterator that raises
  after its first weight leaves the engine paused until a later load takes a whole version.
- The engine is built on the engine thread, after the learner joined torch.distributed: vLLM
  then adopts that world and gives each rank a tensor-parallel group of its own (vLLM's
  "external data parallel" layout), which is why every hybrid rank must build its engine at the
  same time (``new_group`` is collective).
- LoRA (built with a ``LoraConfig``): ``load_weights`` of an adapter's tensors builds vLLM's
  adapter from them in another thread while the engine steps, then registers it as the new
  version's adapter between two steps, without pausing; each request keeps the adapter it
  was submitted with, and idle ones are removed (``vllm_engine.AdapterVersions``).
- ``sleep``/``wake_up``: vLLM sleep mode (frees KV cache and weights) on GPUs; no-ops on CPU.

Dependencies: engine.py (protocol), vllm_engine.py (engine args, sampling, streams, loading).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from streamrl.config import LoraConfig, RolloutConfig
from streamrl.rollout_fleet.engine import Completion, RolloutEngine, SamplingParams, TokenSink
from streamrl.rollout_fleet.vllm_engine import (
    AdapterVersions,
    SampleStream,
    adapter_model,
    completions,
    engine_args,
    is_adapter,
    load_into_worker,
    register_adapter,
    stamp,
    vllm_sampling,
)

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0
CLOSE_TIMEOUT_S = 30.0
_STOP = object()
_SET_NUM_THREADS = torch.set_num_threads
"""vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op for the whole process;
``close`` puts this back."""


@dataclass
class _Request:
    streams: list[SampleStream]
    on_tokens: TokenSink | None
    done: asyncio.Event = field(default_factory=asyncio.Event)


class InprocVLLMEngine(RolloutEngine):
    """A vLLM ``LLMEngine`` in this process, stepped by its own thread (module docstring)."""

    streamed_load = True
    """``load_weights`` copies each weight into the model before taking the next, and stays
    paused after a partial load: ``weight_bus.receive=streamed`` may hand it weights as they
    arrive (``weight_bus.make_receiver``)."""

    def __init__(self, model_path: str, rollout: RolloutConfig, *,
                 tokenizer_path: str | None = None, version: int = 0, threads: int = 1,
                 lora: LoraConfig | None = None) -> None:
        """``threads``: torch intra-op threads of the engine thread (the hybrid worker gives
        the engine the whole bundle while the learner waits). ``lora``: versions are LoRA
        adapters of this shape."""
        self._loop = asyncio.get_running_loop()
        self._version = version
        self._adapters = None if lora is None else AdapterVersions(version)
        self._adapter_config = {} if lora is None else lora.adapter_config()
        self._paused = False
        self._torn = False  # a load failed partway: paused until a whole version is loaded
        self._closed = False
        self._error: BaseException | None = None
        self._live: dict[str, _Request] = {}
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._llm: Any = None
        # Whether vLLM creates the torch.distributed world (alone) or joins the learner's.
        self._owns_world = not torch.distributed.is_initialized()
        built: concurrent.futures.Future[float] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(model_path, rollout, tokenizer_path, lora, threads, built),
            name="vllm-engine", daemon=True)
        self._thread.start()
        try:
            self.startup_s = built.result(timeout=START_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"the in-process vLLM engine for {model_path} did not start "
                               f"within {START_TIMEOUT_S:.0f} s") from None
        logger.info("in-process vLLM engine for %s ready in %.1fs", model_path, self.startup_s)

    @property
    def version(self) -> int:
        return self._version

    # -- the engine thread --------------------------------------------------------------------

    def _run(self, model_path: str, rollout: RolloutConfig, tokenizer_path: str | None,
             lora: LoraConfig | None, threads: int,
             built: concurrent.futures.Future[float]) -> None:
        from vllm.v1.engine.llm_engine import LLMEngine

        start = time.perf_counter()
        try:
            # Before the engine: vLLM's CPU worker disables torch.set_num_threads once built.
            torch.set_num_threads(threads)
            self._llm = LLMEngine.from_engine_args(
                engine_args(model_path, rollout, tokenizer_path, lora))
            self._llm.set_weight_version(str(self._version))
        except BaseException as exc:  # the constructor raises it in the caller's thread
            built.set_exception(exc)
            return
        built.set_result(time.perf_counter() - start)
        try:
            self._serve()
        except BaseException as exc:  # a failed step: every waiter learns why
            logger.exception("in-process vLLM engine failed")
            self._error = exc
            self._loop.call_soon_threadsafe(self._fail_all)
        finally:
            self._reject_commands()

    def _serve(self) -> None:
        while True:
            idle = self._paused or not self._llm.has_unfinished_requests()
            try:
                command = self._commands.get() if idle else self._commands.get_nowait()
            except queue.Empty:
                command = None
            if command is _STOP:
                return
            if command is not None:
                fn, result = command
                if result.set_running_or_notify_cancel():
                    try:
                        result.set_result(fn())
                    except BaseException as exc:  # the caller awaiting it gets it
                        result.set_exception(exc)
                continue  # every queued command runs before the next step
            outputs = self._llm.step()
            if outputs:
                self._loop.call_soon_threadsafe(self._dispatch, outputs, self._version)

    def _reject_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command is not _STOP:
                command[1].set_exception(RuntimeError("the in-process vLLM engine has stopped"))

    async def _call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread between two steps and return its result."""
        self._check_running()
        result: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._commands.put((fn, result))
        return await asyncio.wrap_future(result)

    def _check_running(self) -> None:
        if self._closed or not self._thread.is_alive():
            raise RuntimeError(f"the in-process vLLM engine is not running ({self._why()})")

    def _why(self) -> str:
        return "closed" if self._closed else f"failed: {self._error!r}"

    # -- the event loop side ------------------------------------------------------------------

    def _dispatch(self, outputs: list[Any], version: int) -> None:
        for out in outputs:
            request = self._live.get(out.request_id)
            if request is None:
                continue  # aborted: its caller already has what was sampled
            for delta in out.outputs:
                request.streams[delta.index].absorb(delta, version, out.request_id)
                if request.on_tokens is not None and delta.token_ids:
                    request.on_tokens(list(delta.token_ids))
            if out.finished:
                request.done.set()

    def _fail_all(self) -> None:
        for request in self._live.values():
            request.done.set()

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str
                       ) -> list[Completion]:
        return await self._generate(prompt_ids, params, request_id, None)

    async def stream(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                     on_tokens: TokenSink) -> list[Completion]:
        if params.n != 1:
            raise ValueError(f"stream({request_id}): n={params.n}; streams one sample")
        return await self._generate(prompt_ids, params, request_id, on_tokens)

    async def _generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                        on_tokens: TokenSink | None) -> list[Completion]:
        if not prompt_ids:
            raise ValueError(f"generate({request_id}): prompt_ids is empty")
        if request_id in self._live:
            raise ValueError(f"generate: request_id={request_id!r} is already in flight")
        # Always deltas: LLMEngine emits no final output for an aborted request, so what an
        # abort returns is what has streamed in.
        sampling, greedy_copies = vllm_sampling(params, stream=True)
        request = self._live[request_id] = _Request(
            [SampleStream() for _ in range(sampling.n)], on_tokens)
        prompt = {"prompt_token_ids": list(prompt_ids)}
        adapter_version, lora = (-1, None) if self._adapters is None else self._adapters.acquire()
        try:
            await self._call(lambda: self._llm.add_request(request_id, prompt, sampling,
                                                           lora_request=lora))
            await request.done.wait()
        finally:
            del self._live[request_id]
            if not request.done.is_set() and self._thread.is_alive():
                # The caller went away (cancelled): stop sampling for nobody.
                self._commands.put((lambda: self._llm.abort_request([request_id]),
                                    concurrent.futures.Future()))
            idle = None if self._adapters is None else self._adapters.release(lora)
            if idle is not None and self._thread.is_alive():  # after the abort: commands are
                self._commands.put((lambda: self._llm.remove_lora(idle),  # run in order
                                    concurrent.futures.Future()))
        if self._error is not None:
            raise RuntimeError(f"generate({request_id}): the in-process vLLM engine failed: "
                               f"{self._error!r}")
        done = completions(request.streams, greedy_copies, request_id)
        return done if self._adapters is None else stamp(done, adapter_version)

    def num_tokens(self, request_id: str) -> int:
        """Tokens received so far by a request in flight, over its samples (0 if unknown)."""
        request = self._live.get(request_id)
        return sum(len(s.token_ids) for s in request.streams) if request else 0

    async def abort(self, request_id: str) -> None:
        await self._call(lambda: self._llm.abort_request([request_id]))
        request = self._live.get(request_id)
        if request is not None:
            request.done.set()  # no more outputs come for it: it ends with what it has

    # -- pausing and weights ------------------------------------------------------------------

    async def pause(self) -> None:
        """Stop stepping; in-flight requests keep their state (returns between two steps)."""
        await self._call(lambda: setattr(self, "_paused", True))

    async def resume(self) -> None:
        """Step again, unless a load failed partway (``_swap``): then not until a whole version
        is loaded."""
        await self._call(lambda: setattr(self, "_paused", self._torn))

    async def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int
                           ) -> None:
        if self._adapters is None:
            await self._call(lambda: self._swap(weights, version))
            return
        tensors = list(weights)
        if not is_adapter(name for name, _ in tensors):
            raise ValueError(f"load_weights(version={version}): this engine serves LoRA "
                             "adapters (actor.lora.publish=adapter) and got full weights")
        self._check_running()  # before building in another thread
        lora = self._adapters.new_request(version)
        # Built (copied, packed, scaled) beside the engine thread, which steps meanwhile: the
        # executor is in this process, so collective_rpc runs it in the calling thread, and
        # building reads nothing a step changes. Registered between two steps; requests in
        # flight keep the adapter they were submitted with.
        model = (await asyncio.to_thread(self._llm.collective_rpc, adapter_model, args=(
            tensors, lora.lora_int_id, self._adapter_config)))[0]
        await self._call(lambda: self._llm.collective_rpc(register_adapter, args=(model,)))
        idle = self._adapters.adopt(version, lora)
        self._version = version
        if idle is not None:
            await self._call(lambda: self._llm.remove_lora(idle))

    def adapters_loaded(self) -> set[int]:
        """Ids of the LoRA adapters this engine holds in vLLM; empty without LoRA."""
        return set() if self._adapters is None else self._adapters.loaded()

    def _swap(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """On the engine thread: load ``weights`` in place, then adopt ``version``."""
        counted = [0]

        def count(pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
            for pair in pairs:
                counted[0] += 1
                yield pair

        try:
            self._llm.collective_rpc(load_into_worker, args=(count(weights),))
        except BaseException:
            if counted[0]:  # the model may hold part of the version (a streamed receive broke
                # off, a load failed midway): no step until a whole version is loaded
                self._torn = self._paused = True
                logger.error("weight load for version %d failed partway: the engine stays "
                             "paused (at version %d) until a whole version is loaded",
                             version, self._version)
            raise
        if not counted[0]:
            raise ValueError(f"load_weights(version={version}): no weights given")
        # Running requests are preempted: their KV cache (old weights) is recomputed.
        if not self._llm.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("vLLM refused to reset its prefix cache after a swap")
        self._llm.set_weight_version(str(version))
        self._version = version
        if self._torn:  # whole again: the pause was the failed load's, not a caller's
            self._torn = self._paused = False

    # -- lifecycle ----------------------------------------------------------------------------

    async def sleep(self) -> None:
        """Free the KV cache and the weights (GPU sleep mode); a no-op on CPU."""
        if torch.cuda.is_available():
            await self._call(lambda: self._llm.sleep(level=1))

    async def wake_up(self) -> None:
        if torch.cuda.is_available():
            await self._call(lambda: self._llm.wake_up())

    async def health(self) -> bool:
        return not self._closed and self._error is None and self._thread.is_alive()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._commands.put(_STOP)
        await asyncio.to_thread(self._thread.join, CLOSE_TIMEOUT_S)
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.engine_core.shutdown()
        _leave_distributed(self._owns_world)
        torch.set_num_threads = _SET_NUM_THREADS


def _leave_distributed(owns_world: bool) -> None:
    """Destroy vLLM's process groups; the torch.distributed world too when vLLM created it
    (a learner's world stays: it belongs to the learner)."""
    from vllm.distributed import parallel_state

    parallel_state.destroy_model_parallel()
    if owns_world:
        parallel_state.destroy_distributed_environment()
    elif parallel_state._WORLD is not None:
        parallel_state._WORLD.destroy()  # its own groups, not the learner's default group
        parallel_state._WORLD = None
