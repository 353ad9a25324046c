"""vLLM receiver: buckets land directly inside the vLLM worker, then swap atomically.

Parts:
- Inside vLLM's worker process: the stager, a thread that receives each version the replica's
  receiver hands it (over a loopback ZMQ socket of its own, ``stager_endpoint`` starts it) by
  joining the announced weight-group generation; the engine keeps sampling meanwhile, and no
  engine step stands between an announcement and its receive or between the receive and its
  reply. Worker functions run through ``VLLMEngine.collective_rpc(fn, args)`` (shipped by import
  path; arguments are msgpack bytes, never pickle): ``stager_endpoint``; ``commit_staged``
  loads the staged tensors with ``load_into_worker`` (``model_runner.reload_weights`` on CPU,
  ``model.load_weights`` on GPU) and returns how long that took (the engine's own reload, the
  floor of any swap); ``discard_staged``.
- ``VLLMWorkerLanding``: the ``Landing`` that hands announcements to the stager from the
  replica process and waits for its reply.
- ``StagedWeights``: what the sink receives: a handle to a version staged in the worker.
  ``await staged.load_into(engine, version)`` swaps it in through
  ``engine.load_weights_with`` (pause, load, reset KV cache, adopt version, resume), so the pause a
  replica sees is the reload plus a few engine round trips, not the transfer. A replica's update
  entry point should call ``load_into`` when the weights it gets have it, and
  ``engine.load_weights`` otherwise.
- ``StagedAdapter``: the same for a LoRA adapter's tensors (``actor.lora.publish=adapter``):
  ``hot`` (a replica adds it without pausing or draining), and ``load_into`` registers it as
  the engine's new version (``engine.add_adapter_with(commit_adapter, ...)``), in memory.
- ``StreamedWeights`` (``weight_bus.receive=streamed``): what the sink receives instead, before
  anything is received: ``await load_into(engine, version)`` runs ``receive_streamed`` in the
  worker through ``engine.load_weights_with``, which receives the version bucket by bucket
  into one buffer (``LocalLanding.stream``) and hands each weight to ``load_into_worker`` as it
  arrives, so the worker holds one bucket, not a model, and the engine pauses for the
  transfer and the load. ``drain_streamed`` receives a re-send without loading it.
- ``VLLMReceiver``: ``CollectiveReceiver`` with this landing; its default sink is ``load_into``.

One worker per engine (tensor_parallel_size=1): the worker is one rank of the weight group.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
import zmq

from streamrl.net import LOOPBACK
from streamrl.types import DecodeError, WeightManifest, decode, encode
from streamrl.weight_bus.base import NamedTensors, WeightBusError, WeightBusTimeout
from streamrl.weight_bus.collective import CollectiveReceiver, LocalLanding
from streamrl.weight_bus.control import Announce

HEALTH_EVERY_S = 1.0
"""While the stager has not replied, how often the landing checks that the engine is alive."""


class StageReply(msgspec.Struct, kw_only=True, frozen=True):
    """The stager's answer to one announcement: the manifest it assembled, or why it failed."""

    publish_id: str
    manifest: WeightManifest | None = None
    error: str = ""


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
_STAGER: list[str] = []  # the endpoint of this worker's stager, once started
_STAGER_LOCK = threading.Lock()


def _receive_into(stage: _Stage) -> None:
    try:
        manifest, tensors = _LANDING.receive(stage.announce)
        stage.manifest, stage.tensors = manifest, list(tensors)
    except Exception as exc:  # reported in the stager's reply
        stage.error = f"{type(exc).__name__}: {exc}"
    finally:
        stage.done.set()


def _stage_one(payload: bytes) -> StageReply:
    try:
        announce = decode(payload, Announce)
    except DecodeError as exc:
        return StageReply(publish_id="", error=str(exc))
    stage = _STAGES[announce.publish_id] = _Stage(announce)
    _receive_into(stage)
    if stage.error:
        _STAGES.pop(announce.publish_id, None)
        return StageReply(publish_id=announce.publish_id, error=stage.error)
    return StageReply(publish_id=announce.publish_id, manifest=stage.manifest)


def _serve_stager(sock: zmq.Socket) -> None:
    """The stager's loop: one announcement at a time (collectives are ordered), each answered
    to the landing that sent it."""
    while True:
        frames = sock.recv_multipart()
        if len(frames) == 2:  # [landing, announcement]; anything else is not ours
            sock.send_multipart([frames[0], encode(_stage_one(frames[1]))])


def stager_endpoint(worker: Any) -> str:
    """Start this worker's stager (once per process); returns the endpoint it listens on."""
    del worker  # the group lives in this process; the model is untouched until commit
    with _STAGER_LOCK:
        if not _STAGER:
            sock = zmq.Context.instance().socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            port = sock.bind_to_random_port(f"tcp://{LOOPBACK}")
            threading.Thread(target=_serve_stager, args=(sock,), daemon=True,
                             name="weight-bus-stager").start()
            _STAGER.append(f"tcp://{LOOPBACK}:{port}")
        return _STAGER[0]


def commit_staged(worker: Any, publish_id: str) -> float:
    """Load a staged version into the worker's model; returns the seconds the load took."""
    from streamrl.rollout_fleet.vllm_engine import load_into_worker

    stage = _STAGES.pop(publish_id, None)
    if stage is None or not stage.done.is_set() or stage.error:
        raise RuntimeError(f"weight bus: no completed staged version {publish_id} in this worker")
    start = time.perf_counter()
    load_into_worker(worker, stage.tensors)
    return time.perf_counter() - start


def commit_adapter(worker: Any, publish_id: str, lora_id: int, config: dict[str, Any]) -> float:
    """Register a staged adapter in the worker's LoRA cache; returns the seconds it took."""
    from streamrl.rollout_fleet.vllm_engine import add_adapter_tensors

    stage = _STAGES.pop(publish_id, None)
    if stage is None or not stage.done.is_set() or stage.error:
        raise RuntimeError(f"weight bus: no completed staged adapter {publish_id} in this worker")
    start = time.perf_counter()
    add_adapter_tensors(worker, stage.tensors, lora_id, config)
    return time.perf_counter() - start


def receive_streamed(worker: Any, payload: bytes) -> tuple[bytes, float]:
    """Receive an announced version bucket by bucket straight into the worker's model (the
    engine is paused: ``StreamedWeights.load_into``); returns its manifest, msgpack-encoded,
    and the seconds spent receiving (the rest of the call loaded)."""
    from streamrl.rollout_fleet.vllm_engine import load_into_worker

    incoming = _LANDING.stream(decode(payload, Announce))
    try:
        load_into_worker(worker, incoming)
    except BaseException:
        with contextlib.suppress(WeightBusError):
            incoming.finish()  # leaves the generation: its receives are out of step now
        raise
    # Raises if the load did not take the version whole.
    return encode(incoming.finish()), incoming.wire_s


def drain_streamed(worker: Any, payload: bytes) -> bytes:
    """Receive an announced version and load nothing (a re-send); returns its manifest."""
    del worker
    return encode(_LANDING.stream(decode(payload, Announce)).drain())


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


@dataclass(frozen=True)
class StagedAdapter(StagedWeights):
    """A LoRA adapter received into the vLLM worker (see the module docstring)."""

    hot = True
    """Added beside the adapter in use: in-flight requests keep theirs, nothing pauses."""

    async def load_into(self, engine: Any, version: int) -> None:
        await engine.add_adapter_with(commit_adapter, (self.publish_id,), version)


class StreamedWeights:
    """A version announced to the vLLM worker and not received yet (``receive="streamed"``):
    ``load_into`` receives it bucket by bucket straight into the model while the engine is
    paused (``engine.load_weights_with``), so the pause is the transfer plus the load."""

    def __init__(self, landing: VLLMWorkerLanding, announce: Announce) -> None:
        self.landing, self.announce = landing, announce
        self._manifest: WeightManifest | None = None
        self.wire_s = 0.0
        """Of the load, the seconds its worker spent receiving (set by ``load_into``)."""

    async def load_into(self, engine: Any, version: int) -> None:
        [(manifest, self.wire_s)] = await engine.load_weights_with(
            receive_streamed, (encode(self.announce),), version)
        self._manifest = decode(manifest, WeightManifest)

    def drain(self) -> WeightManifest:
        [manifest] = self.landing._rpc(drain_streamed, (encode(self.announce),),
                                       f"drain_streamed (version {self.announce.version})",
                                       self.landing.timeout_s * 4)
        return decode(manifest, WeightManifest)

    def finish(self) -> WeightManifest:
        if self._manifest is None:
            raise WeightBusError(f"weight bus: version {self.announce.version} was not "
                                 "received whole into the vLLM worker")
        return self._manifest


def staged(publish_id: str, manifest: WeightManifest) -> StagedWeights:
    from streamrl.rollout_fleet.vllm_engine import is_adapter

    names = (t.name for bucket in manifest.buckets for t in bucket.tensors)
    return (StagedAdapter if is_adapter(names) else StagedWeights)(publish_id, manifest)


class VLLMWorkerLanding:
    """Hands each announcement to the worker's stager and waits for its reply (in the
    receiver's thread: no event-loop hop, no engine step in between)."""

    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self.engine, self.loop, self.timeout_s = engine, loop, timeout_s
        self._sock: zmq.Socket | None = None
        self._receiving = threading.Event()

    def _run(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def _rpc(self, fn: Callable[..., Any], args: tuple[Any, ...], what: str,
             timeout: float | None = None) -> list[Any]:
        """``fn`` in the worker, waiting at most ``timeout`` (default ``timeout_s``: one engine
        step, normally)."""
        timeout = timeout or self.timeout_s
        try:
            return list(self._run(self.engine.collective_rpc(fn, args), timeout))
        except concurrent.futures.TimeoutError:
            raise WeightBusTimeout(f"weight bus: the vLLM engine did not run {what} within "
                                   f"{timeout:g} s") from None

    def _stager(self) -> zmq.Socket:
        if self._sock is None:
            results = self._rpc(stager_endpoint, (), "stager_endpoint (starting its stager)")
            if len(results) != 1:
                raise WeightBusError(f"weight bus: expected one vLLM worker, got {len(results)}")
            self._sock = zmq.Context.instance().socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(results[0])
        return self._sock

    def receive(self, announce: Announce) -> tuple[WeightManifest, NamedTensors]:
        self._receiving.set()
        try:
            return self._receive(announce)
        finally:
            self._receiving.clear()

    def _receive(self, announce: Announce) -> tuple[WeightManifest, NamedTensors]:
        sock = self._stager()
        sock.send(encode(announce))
        # The worker bounds each of its waits by timeout_s; this bound covers a silent worker.
        deadline = time.monotonic() + self.timeout_s * 4
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._drop()  # a late reply must not answer a later announcement
                raise WeightBusTimeout(f"weight bus: vLLM worker still receiving version "
                                       f"{announce.version} after {self.timeout_s * 4:.0f} s")
            if not sock.poll(int(min(remaining, HEALTH_EVERY_S) * 1000) + 1):
                self._check_engine(announce, remaining)
                continue
            reply = decode(sock.recv(), StageReply)
            if reply.publish_id != announce.publish_id:
                continue  # the answer to an announcement given up on before
            if reply.error or reply.manifest is None:
                raise WeightBusError(f"weight bus: vLLM worker failed to receive version "
                                     f"{announce.version}: {reply.error}")
            return reply.manifest, staged(announce.publish_id, reply.manifest)

    def _check_engine(self, announce: Announce, timeout: float) -> None:
        """Raise if the engine died, or does not answer within ``timeout``, mid-receive."""
        try:
            healthy = self._run(self.engine.health(), max(timeout, 0.1))
        except concurrent.futures.TimeoutError:
            self._drop()
            raise WeightBusTimeout(f"weight bus: the vLLM engine did not answer a health check "
                                   f"while its worker was receiving version {announce.version}"
                                   ) from None
        if not healthy:
            self._drop()
            raise WeightBusError(f"weight bus: the vLLM engine died while its worker was "
                                 f"receiving version {announce.version}")

    def stream(self, announce: Announce) -> StreamedWeights:
        return StreamedWeights(self, announce)

    def discard(self, announce: Announce) -> None:
        self._rpc(discard_staged, (announce.publish_id,),
                  f"discard_staged (version {announce.version})")

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def close(self) -> None:
        if not self._receiving.is_set():  # else its thread still uses the socket: leave it
            self._drop()


class VLLMReceiver(CollectiveReceiver):
    """Weight receiver for a ``VLLMEngine``: buckets go straight into its worker.

    ``sink`` receives ``(StagedWeights, version)`` (``receive="streamed"``: ``StreamedWeights``);
    the default loads through ``weights.load_into(engine, version)``. Construct it inside the
    engine's event loop (or pass ``loop``): the worker functions are driven on that loop.
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
        receive: str = "staged",
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
            landing=VLLMWorkerLanding(engine, loop, timeout_s), receive=receive,
        )
