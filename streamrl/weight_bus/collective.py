"""Bucketed broadcast of weights on a dedicated process group (gloo on CPU, NCCL on GPU).

Parts:
- ``send_buckets`` / ``recv_buckets``: the data-plane protocol of one version on a formed group.
  Per bucket three broadcasts from rank 0: a header ``int64[2] = (spec bytes, data bytes)``, the
  msgpack ``BucketSpec``, the flat data; a ``(0, 0)`` header ends the version. The sender keeps
  one bucket on the wire while the next is packed (double buffering: two pooled buffers); the
  receiver posts the next header before the current data lands and unpacks to views.
- ``CollectivePublisher`` (learner rank 0): roster and acks over ``control.ControlServer``, group
  generations over one ``TCPStore``; ``publish`` packs lazily from the iterator, broadcasts,
  checks every receiver's ``received`` ack (with the manifest it assembled) within timeout_s.
- ``CollectiveReceiver`` + ``LocalLanding``: a background thread that joins each announced
  generation, receives the version in this process and hands it whole to the sink.
  ``vllm_receiver.VLLMWorkerLanding`` lands buckets inside a vLLM worker instead.

Failure handling. Every wait is bounded by ``timeout_s`` and polls a check: on the learner, "has
a member stopped heartbeating or acked ``failed``"; on receivers, "did the learner set this
generation's abort flag". When a receiver dies mid-broadcast the learner still drains the
iterator (FSDP ranks gather in lockstep), aborts the generation, names the dead receivers
(``ReceiverDied``), forms a new generation with the survivors and re-sends the version to them
from its copy, so survivors rejoin without any action of theirs.

Late joiners (documented choice): with ``keep_latest`` (default on gloo/CPU) the learner keeps the
packed buckets of the latest version (one extra copy of the weights in host memory) and a
background thread sends them to any receiver that joins late, on a generation of its own, right
away. Without it (default with NCCL: the copy would cost GPU memory) a late joiner is noted in
``needs_republish`` and gets the weights with the next ``publish``; the controller can publish the
current weights again at once if it cannot wait.
"""

from __future__ import annotations

import asyncio
import datetime
import inspect
import logging
import os
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import msgspec
import torch
import torch.distributed as dist

from streamrl.types import BucketSpec, WeightManifest, decode, encode
from streamrl.weight_bus.base import (
    NamedTensors,
    PublishStats,
    ReceiverDied,
    WeightBusError,
    WeightPublisher,
    WeightReceiver,
    WeightSink,
    check_version,
)
from streamrl.weight_bus.buckets import Bucket, BucketPacker, BufferPool, unpack
from streamrl.weight_bus.control import Announce, ControlClient, ControlServer
from streamrl.weight_bus.groups import (
    GroupAborted,
    GroupSpec,
    Pending,
    WeightGroup,
    join_group,
    store_client,
)

log = logging.getLogger(__name__)
Check = Callable[[], None]


# ---------------------------------------------------------------------------- data plane ----
def send_buckets(group: WeightGroup, buckets: Iterator[Bucket], *, timeout_s: float,
                 check: Check, sent: Callable[[Bucket], None]) -> list[BucketSpec]:
    """Broadcast every bucket ``buckets`` yields; ``sent(bucket)`` once a bucket left the wire."""
    specs: list[BucketSpec] = []
    in_flight: deque[tuple[list[Pending], Bucket, list[torch.Tensor]]] = deque()

    def retire_oldest() -> None:
        pending, bucket, _keepalive = in_flight.popleft()
        for p in pending:
            p.wait(time.monotonic() + timeout_s, check,
                   f"broadcast of bucket {len(specs) - len(in_flight)} "
                   f"(generation {group.generation})")
        sent(bucket)

    # next() packs bucket i+1 (consuming the learner's iterator) while bucket i is on the wire.
    for bucket in buckets:
        spec_bytes = encode(bucket.spec)
        header = torch.tensor([len(spec_bytes), bucket.spec.nbytes], dtype=torch.int64)
        spec_t = torch.frombuffer(bytearray(spec_bytes), dtype=torch.uint8)
        header, spec_t = header.to(group.device), spec_t.to(group.device)
        pending = [group.broadcast(header), group.broadcast(spec_t), group.broadcast(bucket.data)]
        in_flight.append((pending, bucket, [header, spec_t]))
        specs.append(bucket.spec)
        while len(in_flight) > 1:
            retire_oldest()
    end = torch.zeros(2, dtype=torch.int64, device=group.device)
    end_pending = group.broadcast(end)
    while in_flight:
        retire_oldest()
    end_pending.wait(time.monotonic() + timeout_s, check, "end-of-version marker")
    return specs


def recv_buckets(group: WeightGroup, *, timeout_s: float, check: Check,
                 pool: BufferPool | None = None
                 ) -> tuple[list[BucketSpec], list[tuple[str, torch.Tensor]], list[torch.Tensor]]:
    """Receive one version: its bucket specs, its named tensors (views into the buckets) and the
    bucket buffers (data lands in buffers taken from ``pool`` when one is given)."""
    device = group.device
    buffers: list[torch.Tensor] = []
    specs: list[BucketSpec] = []
    tensors: list[tuple[str, torch.Tensor]] = []

    def wait(p: Pending, what: str) -> None:
        p.wait(time.monotonic() + timeout_s, check, f"{what} (generation {group.generation})")

    header = torch.empty(2, dtype=torch.int64, device=device)
    wait(group.broadcast(header), "first bucket header")
    spec_len, data_len = (int(x) for x in header.tolist())
    while spec_len:
        spec_t = torch.empty(spec_len, dtype=torch.uint8, device=device)
        data = (pool.take(data_len, device) if pool is not None
                else torch.empty(data_len, dtype=torch.uint8, device=device))
        buffers.append(data)
        next_header = torch.empty(2, dtype=torch.int64, device=device)
        p_spec, p_data = group.broadcast(spec_t), group.broadcast(data)
        p_next = group.broadcast(next_header)  # posted early: the sender never waits on us
        wait(p_spec, f"spec of bucket {len(specs)}")
        spec = decode(spec_t.cpu().numpy().tobytes(), BucketSpec)
        wait(p_data, f"data of bucket {len(specs)}")
        tensors.extend(unpack(spec, data))
        specs.append(spec)
        wait(p_next, f"header after bucket {len(specs) - 1}")
        spec_len, data_len = (int(x) for x in next_header.tolist())
    return specs, tensors, buffers


def manifest_of(version: int, publish_id: str, specs: list[BucketSpec]) -> WeightManifest:
    return WeightManifest(version=version, buckets=tuple(specs),
                          total_bytes=sum(s.nbytes for s in specs), publish_id=publish_id)


class _Dead(WeightBusError):
    def __init__(self, dead: dict[str, str]) -> None:
        super().__init__(f"receivers died: {dead}")
        self.dead = dead


# ----------------------------------------------------------------------------- publisher ----
class CollectivePublisher(WeightPublisher):
    """Learner rank 0: announces versions over ZMQ and broadcasts buckets on the weight group."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        bucket_mb: float = 64,
        timeout_s: float = 60.0,
        backend: str = "gloo",
        cast_dtype: torch.dtype | None = None,
        keep_latest: bool | None = None,
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend={backend!r}: must be 'gloo' or 'nccl'")
        if bucket_mb <= 0 or timeout_s <= 0:
            raise ValueError(f"bucket_mb={bucket_mb}, timeout_s={timeout_s}: must be > 0")
        self.host, self.backend, self.timeout_s = host, backend, timeout_s
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.cast_dtype = cast_dtype
        self.keep_latest = backend == "gloo" if keep_latest is None else keep_latest
        self.control = ControlServer(host, port, timeout_s=timeout_s)
        self.endpoint = self.control.endpoint
        self._store = dist.TCPStore(host, 0, None, True, datetime.timedelta(seconds=timeout_s),
                                    wait_for_workers=False)
        self._lock = threading.RLock()
        self._version = -1
        self._manifest: WeightManifest | None = None
        self._cache: list[Bucket] | None = None
        self._pool = BufferPool()  # bucket buffers reused from version to version (warm pages)
        self._generation = 0
        self._group: WeightGroup | None = None
        self._members: tuple[str, ...] = ()
        self.needs_republish = False
        """True when a receiver joined that only a fresh ``publish`` can serve (no copy kept)."""
        self._closed = threading.Event()
        self._catch_up_thread = threading.Thread(target=self._catch_up_loop, daemon=True,
                                                 name="weight-bus-catch-up")
        self._catch_up_thread.start()

    @property
    def version(self) -> int:
        return self._version

    # -- public ---------------------------------------------------------------------------
    def wait_for_receivers(self, n: int, timeout: float | None = None) -> list[str]:
        """Block until ``n`` receivers are live; returns their ids."""
        if not self.control.wait_for(lambda: len(self.control.live()) >= n,
                                     timeout or self.timeout_s):
            raise WeightBusError(f"weight bus: only {self.control.live()} of {n} receivers "
                                 f"joined {self.endpoint} within {timeout or self.timeout_s} s")
        return self.control.live()

    def wait_loaded(self, version: int, timeout: float | None = None) -> dict[str, int]:
        """Block until every live receiver loaded ``version`` (or newer); returns their versions."""
        def done() -> bool:
            live = self.control.live()
            loaded = self.control.loaded_versions()
            return all(loaded.get(r, -1) >= version for r in live)

        if not self.control.wait_for(done, timeout or self.timeout_s):
            loaded = self.control.loaded_versions()
            behind = {r: v for r, v in loaded.items() if v < version}
            raise WeightBusError(f"weight bus: receivers {behind} did not load version {version} "
                                 f"within {timeout or self.timeout_s} s")
        return self.control.loaded_versions()

    def publish(self, version: int, named_tensors: NamedTensors) -> PublishStats:
        start = time.monotonic()
        with self._lock:
            check_version(version, self._version)
            for bucket in self._cache or ():  # the previous copy's buffers pack this version
                self._pool.give(bucket.buffer)
            self._cache = None
            members = tuple(self.control.live())
            self.control.take_joiners()  # members get this version; no catch-up needed
            packer = BucketPacker(self.bucket_bytes, cast_dtype=self.cast_dtype,
                                  device=self._device(), pool=self._pool)
            cache: list[Bucket] | None = [] if self.keep_latest else None
            specs: list[BucketSpec] = []

            def tee(buckets: Iterator[Bucket]) -> Iterator[Bucket]:
                for bucket in buckets:
                    specs.append(bucket.spec)
                    if cache is not None:
                        cache.append(bucket)
                    yield bucket

            buckets = tee(packer.pack(named_tensors))
            publish_id = uuid.uuid4().hex
            failure: Exception | None = None
            if members:
                try:
                    self._send(members, version, publish_id, buckets,
                               sent=packer.release if cache is None else _noop)
                except (WeightBusError, RuntimeError) as exc:
                    failure = exc
                    log.error("weight bus: publish of version %d failed: %s", version, exc)
            for _bucket in buckets:
                pass  # drain, even after a failure: the other FSDP ranks gather in lockstep
            manifest = manifest_of(version, publish_id, specs)
            self._version, self._manifest, self._cache = version, manifest, cache
            self.control.set_current(version, manifest)
            if failure is not None:
                self._recover(members, version, failure)
            self.needs_republish = False
            return PublishStats(
                version=version, nbytes=manifest.total_bytes,
                num_tensors=sum(len(b.tensors) for b in specs), num_buckets=len(specs),
                seconds=time.monotonic() - start, receivers=members,
                generation=self._generation if members else -1,
            )

    def close(self) -> None:
        self._closed.set()
        self._catch_up_thread.join(timeout=5)
        with self._lock:
            if self._group is not None:
                self._group.close()
                self._group = None
            self._cache = None
            self._pool.clear()
        self.control.close()

    # -- internals ------------------------------------------------------------------------
    def _device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _check(self, members: tuple[str, ...], publish_id: str) -> Check:
        def check() -> None:
            dead = self.control.dead_among(members)
            if dead:
                raise _Dead(dead)
            failed = self.control.failed_acks(publish_id)
            if failed:
                raise WeightBusError(f"weight bus: receivers reported failures: {failed}")
        return check

    def _new_spec(self, world_size: int) -> GroupSpec:
        self._generation += 1
        nccl_port = 0
        if self.backend == "nccl":
            with socket.socket() as sock:
                sock.bind((self.host, 0))
                nccl_port = sock.getsockname()[1]
        return GroupSpec(generation=self._generation, backend=self.backend, host=self.host,
                         store_port=self._store.port, world_size=world_size, rank=0,
                         timeout_s=self.timeout_s, nccl_port=nccl_port)

    def _open_generation(self, targets: tuple[str, ...], version: int, publish_id: str,
                         check: Check) -> WeightGroup:
        """Announce ``version`` to ``targets`` on the current generation if they are exactly its
        members, else on a new generation (formed here: blocks until every target joined)."""
        group = self._group
        reuse = group is not None and not group.broken and self._members == targets
        if not reuse and group is not None:
            group.close()
            self._group = None
        spec0 = group.spec if reuse and group is not None else self._new_spec(len(targets) + 1)
        for rank, rid in enumerate(targets, start=1):
            self.control.announce(rid, Announce(version=version, publish_id=publish_id,
                                                group=msgspec.structs.replace(spec0, rank=rank)))
        if reuse and group is not None:
            return group
        group = join_group(spec0, self._store, time.monotonic() + self.timeout_s, check)
        self._group, self._members = group, targets
        return group

    def _send(self, targets: tuple[str, ...], version: int, publish_id: str,
              buckets: Iterator[Bucket], sent: Callable[[Bucket], None]) -> None:
        """Announce ``version`` to ``targets``, broadcast it, check the manifests they acked."""
        check = self._check(targets, publish_id)
        group = self._open_generation(targets, version, publish_id, check)
        try:
            specs = send_buckets(group, buckets, timeout_s=self.timeout_s, check=check, sent=sent)
            acks = self.control.wait_acks(publish_id, targets, ("received",),
                                          time.monotonic() + self.timeout_s, check)
        except Exception:
            group.broken = True
            raise
        failed = {rid: ack.error for rid, ack in acks.items() if ack.stage == "failed"}
        if failed:
            group.broken = True
            raise WeightBusError(f"weight bus: receivers failed to receive version {version}: "
                                 f"{failed}")
        expected = manifest_of(version, publish_id, specs)
        wrong = sorted(rid for rid, ack in acks.items() if ack.manifest != expected)
        if wrong:
            group.broken = True
            raise WeightBusError(f"weight bus: receivers {wrong} assembled a manifest that differs "
                                 f"from version {version}'s")
        self.control.drop_acks(publish_id)

    def _send_cached(self, targets: tuple[str, ...]) -> None:
        """Send the kept copy of the latest version to ``targets``."""
        assert self._cache is not None
        self._send(targets, self._version, uuid.uuid4().hex, iter(self._cache), sent=_noop)

    def _identify_dead(self, members: tuple[str, ...]) -> dict[str, str]:
        """Wait (at most one liveness window) for heartbeats to show who died."""
        deadline = time.monotonic() + self.control.dead_after_s + 0.5
        while True:
            dead = self.control.dead_among(members)
            if dead or time.monotonic() > deadline:
                return dead
            time.sleep(0.05)

    def _recover(self, members: tuple[str, ...], version: int, failure: Exception) -> None:
        """After a failed broadcast: abort the generation, name the dead, serve the survivors."""
        generation = self._generation
        if self._group is not None:
            self._group.abort(f"publish of version {version} failed: {failure}")
            self._group.close()
            self._group = None
        dead = failure.dead if isinstance(failure, _Dead) else self._identify_dead(members)
        self.control.forget(dead)
        survivors = [m for m in members if m not in dead]
        recovered = False
        if survivors and self._cache is not None:
            try:
                self._send_cached(tuple(survivors))
                recovered = True
            except (WeightBusError, RuntimeError) as exc:
                log.error("weight bus: re-sending version %d to %s failed: %s",
                          version, survivors, exc)
        if not recovered:
            self.needs_republish = True
        if not dead:
            raise WeightBusError(
                f"weight bus: publish of version {version} on generation {generation} failed "
                f"({failure}); members {list(members)}; "
                + ("re-sent to all of them" if recovered else "they need a fresh publish")
            ) from failure
        what = (f"version {version} re-sent to them on generation {self._generation}"
                if recovered else "they get the next publish")
        raise ReceiverDied(
            f"weight bus: receiver(s) {sorted(dead)} died during publish of version {version} "
            f"(generation {generation}): "
            + "; ".join(f"{rid}: {why}" for rid, why in sorted(dead.items()))
            + f". Group re-formed for the survivors {survivors}; {what}.",
            dead=dead, survivors=survivors, version=version, recovered=recovered,
        ) from failure

    def _catch_up_loop(self) -> None:
        while not self._closed.is_set():
            self.control.wait_for(lambda: bool(self.control.joiners) or self._closed.is_set(),
                                  0.5)
            if self._closed.is_set() or not self.control.joiners:
                continue
            with self._lock:
                joiners = self.control.take_joiners()
                live = set(self.control.live())
                behind = tuple(sorted(j for j in set(joiners) & live
                                      if self.control.received_version(j) < self._version))
                if not behind:
                    continue
                if self._cache is None:
                    self.needs_republish = True
                    log.info("weight bus: %s joined late; no copy kept, the next publish "
                             "serves them", behind)
                    continue
                try:
                    self._send_cached(behind)
                    log.info("weight bus: sent version %d to late joiners %s",
                             self._version, behind)
                except (WeightBusError, RuntimeError) as exc:
                    log.error("weight bus: catch-up of %s failed: %s", behind, exc)
                    if self._group is not None:
                        self._group.abort(f"catch-up failed: {exc}")
                        self._group.close()
                        self._group = None


def _noop(_bucket: Bucket) -> None:
    return None


# ------------------------------------------------------------------------------ receiver ----
class Landing(Protocol):
    """Where a receiver's buckets land: this process, or inside an inference worker."""

    def receive(self, announce: Announce) -> tuple[WeightManifest, NamedTensors]: ...

    def discard(self, announce: Announce) -> None: ...

    def close(self) -> None: ...


class LocalLanding:
    """Joins the announced generation in this process and receives into tensors here."""

    def __init__(self) -> None:
        self._group: WeightGroup | None = None
        self._pool = BufferPool()
        self._lent: list[torch.Tensor] = []

    def receive(self, announce: Announce) -> tuple[WeightManifest, NamedTensors]:
        # The sink has returned for the previous version: its buffers take this one.
        for buffer in self._lent:
            self._pool.give(buffer)
        self._lent = []
        group = self._join(announce.group)
        try:
            specs, tensors, self._lent = recv_buckets(
                group, timeout_s=group.spec.timeout_s, check=group.check_abort, pool=self._pool)
        except Exception:
            group.broken = True
            self._drop()
            raise
        return manifest_of(announce.version, announce.publish_id, specs), tensors

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

    def discard(self, announce: Announce) -> None:
        return None

    def close(self) -> None:
        self._drop()


def default_receiver_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class CollectiveReceiver(WeightReceiver):
    """Receives every announced version in a background thread and feeds it to ``sink``.

    Versions are monotonic: a version not newer than the loaded one is received (the broadcast is
    collective) but not loaded, with a log line. ``sink`` may be sync or async; an async sink runs
    on ``loop`` (the replica's event loop; default: the loop running at construction, if any).
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
        initial_version: int = -1,
    ) -> None:
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
        self._version = initial_version
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self.control = ControlClient(endpoint, self.receiver_id, timeout_s=timeout_s,
                                     loaded_version=initial_version)
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"weight-bus-receiver-{self.receiver_id}")
        self._thread.start()

    @property
    def version(self) -> int:
        return self._version

    def wait_version(self, version: int, timeout: float) -> bool:
        """Block until a version >= ``version`` is loaded; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._version >= version, timeout)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout_s)
        self.control.close()
        self.landing.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            announce = self.control.next_announce(0.1)
            if announce is not None:
                self._handle(announce)

    def _handle(self, announce: Announce) -> None:
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


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def named_tensors_of(state: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
                     ) -> Iterable[tuple[str, torch.Tensor]]:
    """Accept a state dict or an iterable of pairs (tests, benchmarks)."""
    return state.items() if isinstance(state, dict) else state
