"""Replica side of the collective bus: receive each announced version and feed the sink.

Parts:
- ``Landing``: where a receiver's buckets land (``receive`` / ``stream`` / ``discard`` /
  ``close``); ``Streamed``: what ``stream`` returns, a version the sink's load receives.
- ``LocalLanding``: joins the announced generation in this process and receives into tensors
  here, keeping the bucket plan that generation announced and the buffers of its bucket sizes
  (``vllm_receiver.VLLMWorkerLanding`` lands them inside a vLLM worker instead); ``Incoming``
  is its ``Streamed``.
- ``CollectiveReceiver``: a background thread that takes each announcement from the
  ``ControlClient``, lets its landing receive the version, acks ``received`` (with the manifest
  it assembled), hands the version whole to the sink and acks ``loaded``, ``skipped`` or
  ``failed``; with ``receive="streamed"`` it hands the sink the version first and the sink's
  load receives it (``Incoming``: bucket by bucket, one bucket held). Every wait is bounded by
  the generation's ``timeout_s`` and polls the generation's abort flag, so a receiver gives a
  generation up when the learner does.

Dependencies: ``base`` (the protocol), ``control`` (ZMQ), ``groups`` (joining), ``wire``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist

from streamrl.types import WeightManifest
from streamrl.weight_bus.base import NamedTensors, WeightBusError, WeightReceiver, WeightSink
from streamrl.weight_bus.buckets import BucketPlan, BufferPool
from streamrl.weight_bus.collective.wire import Streaming, manifest_of, recv_buckets, recv_version
from streamrl.weight_bus.control import Announce, ControlClient
from streamrl.weight_bus.groups import (
    GroupAborted,
    GroupSpec,
    WeightGroup,
    join_group,
    store_client,
)

log = logging.getLogger(__name__)


RECEIVE_MODES = ("staged", "streamed")
"""``weight_bus.receive``: see ``CollectiveReceiver``."""


class Streamed(Protocol):
    """A version announced and not received yet (``receive="streamed"``): the sink's load
    receives it, bucket by bucket, while the engine is paused."""

    def drain(self) -> WeightManifest:
        """Receive it (the broadcast is collective) and load nothing: a re-send."""
        ...

    def finish(self) -> WeightManifest:
        """After the sink returned: the manifest of the version, which it received whole;
        raises (leaving the generation) if it did not."""
        ...


class Landing(Protocol):
    """Where a receiver's buckets land: this process, or inside an inference worker."""

    def receive(self, announce: Announce) -> tuple[WeightManifest, NamedTensors]: ...

    def stream(self, announce: Announce) -> Streamed: ...

    def discard(self, announce: Announce) -> None: ...

    def close(self) -> None: ...


class LocalLanding:
    """Joins the announced generation in this process and receives into tensors here."""

    def __init__(self) -> None:
        self._group: WeightGroup | None = None
        self._plan: BucketPlan | None = None  # the one ``_group`` announced last
        self._pool = BufferPool()
        self._lent: list[torch.Tensor] = []

    def receive(self, announce: Announce) -> tuple[WeightManifest, NamedTensors]:
        # The sink has returned for the previous version: its buffers take this one.
        for buffer in self._lent:
            self._pool.give(buffer)
        self._lent = []
        group = self._join(announce.group)
        try:
            # An announcement taken late (the receiver was busy or silent) may be for a
            # generation the learner already aborted: posting receives on it would leave them
            # pending, and gloo aborts the process when their timeout fires.
            group.check_abort()
            got = recv_version(group, self._plan, timeout_s=group.spec.timeout_s,
                               check=group.check_abort, pool=self._pool)
        except Exception:
            group.broken = True
            self._drop()
            raise
        self._plan, self._lent = got.plan, got.buffers
        return manifest_of(announce.version, announce.publish_id, got.specs), got.tensors

    def stream(self, announce: Announce) -> Incoming:
        return Incoming(self, announce)

    def _buckets(self, announce: Announce,
                 state: Streaming) -> Generator[tuple[str, torch.Tensor], None, None]:
        group = self._join(announce.group)
        state.plan = self._plan
        try:
            group.check_abort()  # see ``receive``
            start = time.perf_counter()
            for tensors in recv_buckets(group, state, timeout_s=group.spec.timeout_s,
                                        check=group.check_abort, pool=self._pool):
                state.wire_s += time.perf_counter() - start
                yield from tensors  # the consumer loads them meanwhile
                start = time.perf_counter()
            state.wire_s += time.perf_counter() - start
        except BaseException:  # GeneratorExit too: the consumer stopped mid-version
            group.broken = True
            if self._group is group:  # not a later generation joined since
                self._drop()
            raise
        self._plan = state.plan

    def _join(self, spec: GroupSpec) -> WeightGroup:
        if self._group is not None and self._group.spec == spec:
            return self._group
        self._drop()
        store = store_client(spec.host, spec.store_port, spec.timeout_s)
        probe = dist.PrefixStore(spec.prefix, store)

        def check() -> None:
            if probe.check(["abort"]):
                raise GroupAborted(f"weight bus generation {spec.generation} aborted while "
                                   f"joining: {probe.get('abort').decode(errors='replace')}")

        self._group = join_group(spec, store, time.monotonic() + spec.timeout_s, check)
        return self._group

    def _drop(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None
        self._plan = None

    def discard(self, announce: Announce) -> None:
        return None

    def close(self) -> None:
        self._drop()


class Incoming:
    """A version announced to a ``LocalLanding``, received as it is iterated: bucket by bucket
    into one reused buffer (``wire.recv_buckets``), each weight a view into it that the next
    bucket overwrites, so whoever iterates copies each weight before asking for the next (as
    vLLM's ``load_weights`` does: it writes each into the model). Iterated once."""

    def __init__(self, landing: LocalLanding, announce: Announce) -> None:
        self.announce = announce
        self._state = Streaming(plan=None)
        self._tensors: Generator[tuple[str, torch.Tensor], None, None] | None = None
        self._landing = landing

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._tensors is not None:
            raise WeightBusError(f"weight bus: version {self.announce.version} is streamed: "
                                 "it can be received only once")
        self._tensors = self._landing._buckets(self.announce, self._state)
        return self._tensors

    @property
    def wire_s(self) -> float:
        """Seconds the iteration spent receiving, not in its consumer."""
        return self._state.wire_s

    def drain(self) -> WeightManifest:
        for _ in self:
            pass
        return self.finish()

    def finish(self) -> WeightManifest:
        if not self._state.complete:
            if self._tensors is not None:
                self._tensors.close()  # leaves the generation (its receives are out of step)
            else:
                self._landing._drop()  # never joined this version's broadcast: out of step too
            raise WeightBusError(f"weight bus: version {self.announce.version} was not "
                                 "received whole (the sink stopped early)")
        return manifest_of(self.announce.version, self.announce.publish_id, self._state.specs)


def default_receiver_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class CollectiveReceiver(WeightReceiver):
    """Receives every announced version in a background thread and feeds it to ``sink``.

    Versions are compared within this receiver's publisher only (one endpoint, one run token),
    whose versions strictly increase: one not newer than the last loaded from it is a re-send
    (a catch-up or a recovery) and is received (the broadcast is collective) but not loaded,
    with a log line. The first version from the publisher is loaded whatever the engine held:
    a trainer resumed from step 10's checkpoint is a new publisher, and replicas that kept
    version 12 (``streamrl serve`` reconnects them, ``ReplicaActor.connect_bus``) must go back
    to 10 so that the versions they stamp stay exact. For the same reason the receiver says
    hello with version -1: the publisher then serves it the current version even when its
    engine holds a higher number from the earlier run.

    ``sink`` may be sync or async; an async sink runs on ``loop`` (the replica's event loop;
    default: the loop running at construction, if any).

    ``receive`` (``weight_bus.receive``): ``staged`` receives each version whole into buffers
    kept from version to version (one model copy) while the engine samples on, then hands it
    to the sink, whose swap pauses the engine only for the load. ``streamed`` hands the sink
    the version before receiving it (the landing's ``stream``): the sink pauses the engine,
    then its load receives the version bucket by bucket into one buffer (one bucket held, not
    a model), so the engine pauses for the transfer and the load. The received ack, with the
    manifest, follows the load; versions stay exact, as the version is adopted only once its
    last bucket is in. A transfer that breaks off leaves the engine with part of the new
    weights: the engine, not this receiver, must then stop sampling until a whole version is
    loaded (``VLLMEngine.load_weights_with``, ``InprocVLLMEngine``).
    """

    def __init__(
        self,
        endpoint: str,
        sink: WeightSink | Callable[[NamedTensors, int], Any],
        *,
        receiver_id: str | None = None,
        timeout_s: float = 60.0,
        loop: asyncio.AbstractEventLoop | None = None,
        landing: Landing | None = None,
        receive: str = "staged",
    ) -> None:
        if receive not in RECEIVE_MODES:
            raise ValueError(f"weight_bus.receive={receive!r}: must be one of {RECEIVE_MODES}")
        self.receive = receive
        self.receiver_id = receiver_id or default_receiver_id()
        self.sink = sink
        self.timeout_s = timeout_s
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
        self.loop = loop
        self.landing: Landing = landing or LocalLanding()
        self._version = -1  # the latest version loaded from this publisher
        self._pending = -1  # the version being received or loaded, -1 between versions
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self.control = ControlClient(endpoint, self.receiver_id, timeout_s=timeout_s)
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"weight-bus-receiver-{self.receiver_id}")
        self._thread.start()

    @property
    def version(self) -> int:
        return self._version

    @property
    def pending_version(self) -> int:
        # Set when the announcement is taken, before this receiver joins the broadcast.
        return self._pending

    def wait_version(self, version: int, timeout: float) -> bool:
        """Block until a version >= ``version`` is loaded; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._version >= version, timeout)

    def close(self) -> None:
        """Stop receiving: waits (up to ``timeout_s``) for a version being received or loaded.
        On ``loop``'s own thread use ``aclose``: blocking there would keep the sink from ever
        finishing that load."""
        if self.loop is not None and _running_loop() is self.loop:
            raise RuntimeError("CollectiveReceiver.close() on its own event loop would wait on "
                               "a load that needs that loop: await aclose() there")
        self._stop.set()
        self._thread.join(timeout=self.timeout_s)
        self._release()

    async def aclose(self) -> None:
        self._stop.set()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, self.timeout_s)
        self._release()

    def _release(self) -> None:
        if self._thread.is_alive():
            log.error("weight bus: %s still receiving or loading version %d after %.0f s "
                      "(weight_bus.timeout_s); closed anyway", self.receiver_id, self._pending,
                      self.timeout_s)
        self.control.close()
        self.landing.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            announce = self.control.next_announce(0.1)
            # Only the newest matters: the publisher sends one only after the previous publish
            # ended, so older ones queued behind a busy receiver are over already.
            while announce is not None and (newer := self.control.next_announce(0)) is not None:
                announce = newer
            if announce is not None:
                self._pending = announce.version
                try:
                    self._handle(announce)
                finally:
                    self._pending = -1

    def _handle(self, announce: Announce) -> None:
        self.control.ack(announce, "announced")  # alive and working: see ControlServer.silent_among
        if self.receive == "streamed":
            self._handle_streamed(announce)
            return
        try:
            manifest, weights = self.landing.receive(announce)
        except Exception as exc:  # reported to the learner; the next announcement retries
            log.warning("weight bus: %s failed to receive version %d: %s",
                        self.receiver_id, announce.version, exc)
            self.control.ack(announce, "failed", error=f"{type(exc).__name__}: {exc}")
            return
        self.control.ack(announce, "received", manifest=manifest)
        if announce.version <= self._version:
            log.info("weight bus: %s ignores version %d (already at %d)",
                     self.receiver_id, announce.version, self._version)
            self.landing.discard(announce)
            self.control.ack(announce, "skipped")
            return
        try:
            self._deliver(weights, announce.version)
        except Exception as exc:
            log.exception("weight bus: %s could not load version %d", self.receiver_id,
                          announce.version)
            self.landing.discard(announce)
            self.control.ack(announce, "failed", error=f"{type(exc).__name__}: {exc}")
            return
        self._loaded(announce)

    def _handle_streamed(self, announce: Announce) -> None:
        incoming = self.landing.stream(announce)
        stage = "skipped" if announce.version <= self._version else "loaded"
        try:
            if stage == "skipped":
                log.info("weight bus: %s drains version %d (already at %d)",
                         self.receiver_id, announce.version, self._version)
                manifest = incoming.drain()
            else:
                self._deliver(incoming, announce.version)
                manifest = incoming.finish()
        except Exception as exc:  # reported to the learner; the next announcement retries
            log.warning("weight bus: %s failed to receive and load version %d: %s",
                        self.receiver_id, announce.version, exc)
            with contextlib.suppress(WeightBusError):  # a load that raised between two
                incoming.finish()  # weights leaves the generation, its receives out of step
            self.control.ack(announce, "failed", error=f"{type(exc).__name__}: {exc}")
            return
        self.control.ack(announce, "received", manifest=manifest)
        if stage == "skipped":
            self.control.ack(announce, "skipped")
        else:
            self._loaded(announce)

    def _loaded(self, announce: Announce) -> None:
        with self._cond:
            self._version = announce.version
            self._cond.notify_all()
        self.control.loaded_version = announce.version
        self.control.ack(announce, "loaded")

    def _deliver(self, weights: NamedTensors, version: int) -> None:
        result = self.sink(weights, version)
        if not inspect.isawaitable(result):
            return
        if self.loop is not None:
            asyncio.run_coroutine_threadsafe(_awaited(result), self.loop).result()
        else:
            asyncio.run(_awaited(result))


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


async def _awaited(awaitable: Any) -> Any:
    return await awaitable
