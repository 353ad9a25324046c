"""vLLM receiver: buckets land directly inside the vLLM worker, then swap atomically.

Parts:
- Worker-side functions, run in vLLM's worker process through ``VLLMEngine.collective_rpc(fn,
  args)`` (shipped by import path; arguments are msgpack bytes, never pickle):
  ``stage_begin`` joins the announced weight-group generation from the worker and receives the
  version in a background thread (the engine keeps sampling meanwhile); ``stage_poll`` reports
  progress; ``commit_staged`` loads the staged tensors with ``load_into_worker``
  (``model_runner.reload_weights`` on CPU, ``model.load_weights`` on GPU) and returns how long
  that took (the engine's own reload, the floor of any swap); ``discard_staged``.
- ``VLLMWorkerLanding``: the ``Landing`` that drives those functions from the replica process.
- ``StagedWeights``: what the sink receives: a handle to a version staged in the worker.
  ``await staged.load_into(engine, version)`` swaps it in through
  ``engine.load_weights_with`` (pause, load, reset KV cache, adopt version, resume), so the pause a
  replica sees is the reload plus a few engine round trips, not the transfer. A replica's update
  entry point should call ``load_into`` when the weights it gets have it, and
  ``engine.load_weights`` otherwise.
- ``VLLMReceiver``: ``CollectiveReceiver`` with this landing; its default sink is ``load_into``.

One worker per engine (tensor_parallel_size=1): the worker is one rank of the weight group.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from streamrl.types import WeightManifest, decode, encode
from streamrl.weight_bus.base import NamedTensors, WeightBusError, WeightBusTimeout
from streamrl.weight_bus.collective import CollectiveReceiver, LocalLanding
from streamrl.weight_bus.control import Announce

# ------------------------------------------------------------------- inside the vLLM worker ----


@dataclass
class _Stage:
    announce: Announce
    done: threading.Event = field(default_factory=threading.Event)
    manifest: WeightManifest | None = None
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    error: str = ""


_LANDING = LocalLanding()  # this worker's membership of the weight group (kept per generation)
_STAGES: dict[str, _Stage] = {}
_STAGE_LOCK = threading.Lock()  # one receive at a time per worker (collectives are ordered)


def _receive_into(stage: _Stage) -> None:
    try:
        with _STAGE_LOCK:
            manifest, tensors = _LANDING.receive(stage.announce)
        stage.manifest, stage.tensors = manifest, list(tensors)
    except Exception as exc:  # reported through stage_poll
        stage.error = f"{type(exc).__name__}: {exc}"
    finally:
        stage.done.set()


def stage_begin(worker: Any, announce: bytes) -> str:
    """Start receiving the announced version in a worker thread; returns its publish id."""
    del worker  # the group lives in this process; the model is untouched until commit
    ann = decode(announce, Announce)
    stage = _STAGES[ann.publish_id] = _Stage(ann)
    threading.Thread(target=_receive_into, args=(stage,), daemon=True,
                     name=f"weight-bus-stage-{ann.version}").start()
    return ann.publish_id


def stage_poll(worker: Any, publish_id: str) -> tuple[str, bytes]:
    """("running", b"") | ("done", encoded manifest) | ("failed", error)."""
    del worker
    stage = _STAGES.get(publish_id)
    if stage is None:
        return "failed", f"no staged transfer {publish_id} in this worker".encode()
    if not stage.done.is_set():
        return "running", b""
    if stage.error:
        _STAGES.pop(publish_id, None)
        return "failed", stage.error.encode()
    assert stage.manifest is not None
    return "done", encode(stage.manifest)


def commit_staged(worker: Any, publish_id: str) -> float:
    """Load a staged version into the worker's model; returns the seconds the load took."""
    from streamrl.rollout_fleet.vllm_engine import load_into_worker

    stage = _STAGES.pop(publish_id, None)
    if stage is None or not stage.done.is_set() or stage.error:
        raise RuntimeError(f"weight bus: no completed staged version {publish_id} in this worker")
    start = time.perf_counter()
    load_into_worker(worker, stage.tensors)
    return time.perf_counter() - start


def discard_staged(worker: Any, publish_id: str) -> bool:
    del worker
    return _STAGES.pop(publish_id, None) is not None


# -------------------------------------------------------------------- in the replica process ----


@dataclass(frozen=True)
class StagedWeights:
    """A version received into the vLLM worker, not yet loaded (see the module docstring)."""

    publish_id: str
    manifest: WeightManifest

    async def load_into(self, engine: Any, version: int) -> None:
        await engine.load_weights_with(commit_staged, (self.publish_id,), version)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise TypeError(
            "StagedWeights live inside the vLLM worker: load them with "
            "`await weights.load_into(engine, version)`, not by iterating them"
        )


class VLLMWorkerLanding:
    """Receives each version inside the vLLM worker by driving the worker-side functions."""

    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self.engine, self.loop, self.timeout_s = engine, loop, timeout_s

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def _stage(self, announce: Announce) -> WeightManifest:
        await self.engine.collective_rpc(stage_begin, (encode(announce),))
        # The worker bounds each of its waits by timeout_s; this bound covers a silent worker.
        deadline = time.monotonic() + self.timeout_s * 4
        while True:
            results = await self.engine.collective_rpc(stage_poll, (announce.publish_id,))
            if len(results) != 1:
                raise WeightBusError(f"weight bus: expected one vLLM worker, got {len(results)}")
            state, payload = results[0]
            if state == "done":
                return decode(payload, WeightManifest)
            if state == "failed":
                raise WeightBusError(f"weight bus: vLLM worker failed to receive version "
                                     f"{announce.version}: {payload.decode(errors='replace')}")
            if time.monotonic() > deadline:
                raise WeightBusTimeout(f"weight bus: vLLM worker still receiving version "
                                       f"{announce.version} after {self.timeout_s * 4:.0f} s")
            await asyncio.sleep(0.02)

    def receive(self, announce: Announce) -> tuple[WeightManifest, NamedTensors]:
        manifest = self._run(self._stage(announce))
        return manifest, StagedWeights(announce.publish_id, manifest)

    def discard(self, announce: Announce) -> None:
        self._run(self.engine.collective_rpc(discard_staged, (announce.publish_id,)))

    def close(self) -> None:
        return None


class VLLMReceiver(CollectiveReceiver):
    """Weight receiver for a ``VLLMEngine``: buckets go straight into its worker.

    ``sink`` receives ``(StagedWeights, version)``; the default loads through
    ``StagedWeights.load_into(engine, version)``. Construct it inside the engine's event loop
    (or pass ``loop``): the worker functions are driven on that loop.
    """

    def __init__(
        self,
        endpoint: str,
        engine: Any,
        *,
        sink: Callable[[Any, int], Any] | None = None,
        receiver_id: str | None = None,
        timeout_s: float = 60.0,
        loop: asyncio.AbstractEventLoop | None = None,
        initial_version: int | None = None,
    ) -> None:
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                raise ValueError("VLLMReceiver needs the engine's event loop: construct it "
                                 "inside that loop or pass loop=") from None
        self.engine = engine

        async def load(weights: StagedWeights, version: int) -> None:
            await weights.load_into(engine, version)

        super().__init__(
            endpoint, sink or load, receiver_id=receiver_id, timeout_s=timeout_s, loop=loop,
            landing=VLLMWorkerLanding(engine, loop, timeout_s),
            initial_version=engine.version if initial_version is None else initial_version,
        )
