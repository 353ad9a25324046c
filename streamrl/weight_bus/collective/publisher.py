"""Learner side of the collective bus: ``CollectivePublisher`` (learner rank 0).

Roster, announcements and acks go over ``control.ControlServer``; group generations rendezvous on
one ``TCPStore``. ``publish`` packs lazily from the learner's iterator, broadcasts on the current
generation and checks every receiver's ``received`` ack and the manifest it assembled, within
``timeout_s``. The first version of a model is streamed bucket by bucket (``wire.send_streamed``)
and yields the model's ``BucketPlan``; every later one follows that plan
(``wire.send_planned``: the plan is announced once per generation, segments go out as they are
packed, zero-copy where the kept copy is off or the weights are ``HandedOver``). After a failed
broadcast ``_recover`` aborts the generation, names the dead and re-sends the version to the
survivors; ``_catch_up`` serves late joiners from the kept copy (see the package docstring for
both policies).

Dependencies: ``base`` (the protocol), ``buckets`` (packing), ``control`` (ZMQ), ``groups``,
``wire``.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NoReturn, TypeVar

import msgspec
import torch
import torch.distributed as dist

from streamrl.net import LOOPBACK, free_port
from streamrl.types import BucketSpec
from streamrl.weight_bus.base import (
    HandedOver,
    NamedTensors,
    PublishStats,
    ReceiverDied,
    WeightBusError,
    WeightBusTimeout,
    WeightPublisher,
    check_version,
)
from streamrl.weight_bus.buckets import (
    SMALL_BYTES,
    Bucket,
    BucketPacker,
    BucketPlan,
    BufferPool,
    LayoutChanged,
    Outgoing,
    PlannedPacker,
)
from streamrl.weight_bus.collective.wire import Check, manifest_of, send_planned, send_streamed
from streamrl.weight_bus.control import Announce, ControlServer
from streamrl.weight_bus.groups import GroupSpec, WeightGroup, join_group

log = logging.getLogger(__name__)
CATCH_UP_RETRY_S = 2.0
GLOO_CHUNK_BYTES = 8 << 20
"""Largest broadcast of a planned version on gloo: a chunk is packed while the one before it is
on the wire. Measured on 2 cores (95 MiB, loopback, packed): 1-2 MiB chunks pay gloo's fixed
cost per broadcast (0.7x a raw broadcast), 8 MiB came closest to it. NCCL sends whole buckets."""
Transmit = Callable[[WeightGroup, Check], list[BucketSpec]]
"""Broadcasts one version on a formed group, polling the check; returns the specs it followed."""
T = TypeVar("T")


@dataclass
class _Kept:
    """The latest version, kept for late joiners and for the survivors of a failed publish."""

    segments: list[torch.Tensor]
    """The bytes of each segment of the plan, in wire order: views of ``copy``, or (a
    ``HandedOver`` version) views of the learner's tensors and the staging buffers of the rest."""
    copy: list[torch.Tensor] | None = None
    """One flat buffer per bucket holding a copy of the version; the next copied version is
    packed into them (warm pages)."""
    staged: list[torch.Tensor] = field(default_factory=list)
    """Pooled staging buffers behind ``segments``, back to the pool when a ``HandedOver``
    version replaces this one."""


class _Dead(WeightBusError):
    def __init__(self, dead: dict[str, str]) -> None:
        super().__init__(f"receivers died: {dead}")
        self.dead = dead


class CollectivePublisher(WeightPublisher):
    """Learner rank 0: announces versions over ZMQ and broadcasts buckets on the weight group."""

    def __init__(
        self,
        *,
        host: str = LOOPBACK,
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
        self._plan: BucketPlan | None = None
        self._plan_generation = -1  # the generation that got ``_plan`` announced last
        self._kept: _Kept | None = None
        self._pool = BufferPool()  # bucket buffers reused from version to version (warm pages)
        self._generation = 0
        self._group: WeightGroup | None = None
        self._members: tuple[str, ...] = ()
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
                                 f"joined {self.control.address} within "
                                 f"{timeout or self.timeout_s} s")
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
            members = tuple(self.control.live())
            self.control.take_joiners()  # members get this version; no catch-up needed
            source = iter(named_tensors)
            publish_id = uuid.uuid4().hex
            try:
                transmit, drain = self._version_out(source,
                                                    isinstance(named_tensors, HandedOver))
                failure = self._send_to(members, version, publish_id, transmit)
                drain()  # even after a failure: the other FSDP ranks gather in lockstep
            except LayoutChanged as exc:
                self._forget_layout(version, source, exc)
            assert self._plan is not None
            specs = list(self._plan.buckets)
            self._version = version
            if failure is not None:
                self._recover(members, version, publish_id, failure)
            return PublishStats(
                version=version, nbytes=sum(b.nbytes for b in specs),
                num_tensors=len(self._plan.order), num_buckets=len(specs),
                seconds=time.monotonic() - start, receivers=members,
                generation=self._generation if members else -1,
            )

    def close(self) -> None:
        self._closed.set()
        self._catch_up_thread.join(timeout=5)
        with self._lock:
            self._drop_group()
            self._kept = None
            self._pool.clear()
        self.control.close()

    # -- internals ------------------------------------------------------------------------
    def _device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _chunk_bytes(self) -> int:
        return self.bucket_bytes if self.backend == "nccl" else min(GLOO_CHUNK_BYTES,
                                                                     self.bucket_bytes)

    def _version_out(self, source: NamedTensors,
                     handed: bool) -> tuple[Transmit, Callable[[], None]]:
        """How this version goes out (``transmit``) and ``drain``, which packs what the
        broadcast did not (or all of it, with no receivers) and leaves ``_plan`` and ``_kept``
        describing this version. ``handed``: the weights are ``HandedOver``."""
        if self._plan is None:
            return self._streamed(source, handed)
        old, self._kept = self._kept, None  # nothing to serve until this version is whole
        copy = None
        if self.keep_latest and not handed:  # the caller may write its tensors: copy them
            copy = old.copy if old is not None and old.copy is not None else [
                self._pool.take(b.nbytes, self._device()) for b in self._plan.buckets]
        elif self.keep_latest and old is not None:
            # Kept by reference: the last such version's staging buffers take this one's runs
            # of small weights (a copied version's buffers go with ``old``).
            for buffer in old.staged:
                self._pool.give(buffer)
        packer = PlannedPacker(self._plan, device=self._device(), cast_dtype=self.cast_dtype,
                               kept=copy, pool=self._pool)
        outs: list[Outgoing] = []
        segments = packer.segments(source)
        if self.keep_latest:
            # Kept as they went out; without the kept copy nothing outlives its broadcast (a
            # gathered weight is freed as soon as it is sent).
            segments = _noted(segments, outs)
        sent = _noop if self.keep_latest else packer.release

        def drain() -> None:
            _exhaust(segments)
            if self.keep_latest:
                self._kept = _Kept([o.data for o in outs], copy,
                                   [o.staging for o in outs if o.staging is not None])

        return (lambda group, check: self._send_planned(group, check, segments, sent), drain)

    def _streamed(self, source: NamedTensors,
                  handed: bool) -> tuple[Transmit, Callable[[], None]]:
        """The first version of a model: bucket by bucket, each with its spec; makes the plan."""
        packer = BucketPacker(self.bucket_bytes, cast_dtype=self.cast_dtype,
                              device=self._device(), pool=self._pool)
        names: list[str] = []
        packed: list[Bucket] = []
        buckets = _noted(packer.pack(_named(source, names)), packed)
        # The packed buckets are the kept copy of this version: not handed back for reuse.
        release = _noop if self.keep_latest else packer.release
        # Zero-copy needs a weight per broadcast; when every byte is copied into the kept copy
        # anyway, fewer, chunk-sized broadcasts are cheaper (measured: 0.83 vs 0.78 of a raw
        # broadcast with 1 receiver, 1.00 vs 0.92 with 2). A learner that hands its weights over
        # once does so every time: its versions are kept without a copy.
        chunk = self._chunk_bytes()
        copied = self.keep_latest and not handed

        def drain() -> None:
            _exhaust(buckets)
            plan = BucketPlan.build([b.spec for b in packed], names, chunk,
                                    chunk if copied else SMALL_BYTES)
            self._plan, self._plan_generation = plan, -1
            if self.keep_latest:
                copy = [b.data for b in packed]
                self._kept = _Kept([copy[g.bucket][g.start: g.end] for g in plan.segments], copy)
            else:
                # Later versions go out zero-copy and stage only runs of small weights: the
                # streamed version's bucket buffers would sit in the pool for good (236 MiB of
                # SmolLM2's 513 at 64 MB buckets, benchmarks/weight_bus.py --model smollm2).
                self._pool.clear()

        return (lambda group, check: send_streamed(group, buckets, timeout_s=self.timeout_s,
                                                   check=check, sent=release),
                drain)

    def _send_planned(self, group: WeightGroup, check: Check, segments: Iterator[Outgoing],
                      sent: Callable[[Outgoing], None]) -> list[BucketSpec]:
        assert self._plan is not None
        announce = self._plan_generation != group.generation
        self._plan_generation = group.generation
        send_planned(group, self._plan, segments, announce_plan=announce,
                     window_bytes=self.bucket_bytes, timeout_s=self.timeout_s, check=check,
                     sent=sent)
        return list(self._plan.buckets)

    def _forget_layout(self, version: int, source: NamedTensors,
                       exc: LayoutChanged) -> NoReturn:
        """The weights no longer follow the plan: no receiver got this version (its broadcast
        is aborted) and the next publish makes a new plan."""
        _exhaust(iter(source))  # the other FSDP ranks gather in lockstep
        self._drop_group(f"version {version} does not follow the bucket plan: {exc}")
        self._plan, self._kept = None, None
        raise WeightBusError(f"weight bus: version {version} was not published: its weights do "
                             f"not follow the bucket plan made from the first version ({exc}); "
                             "publish it again to make a new plan") from exc

    def _check(self, members: tuple[str, ...], publish_id: str) -> Check:
        """The poll of every wait of one publish: the dead, receivers that have not taken the
        announcement ``timeout_s / 2`` after it was sent (alive but silent: named within one
        ``timeout_s`` however far the publish got, and before the other receivers' own waits
        on them run out, which would make them look failed), and failures. A slow but
        progressing broadcast still gets ``timeout_s`` per step."""
        announced_by = time.monotonic() + self.timeout_s / 2

        def check() -> None:
            dead = self.control.dead_among(members)
            if dead:
                raise _Dead(dead)
            if time.monotonic() > announced_by and (
                    silent := self.control.silent_among(publish_id, members)):
                raise WeightBusTimeout(f"weight bus: receivers {silent} did not take the "
                                       f"announcement within timeout_s/2={self.timeout_s / 2:g} s")
            failed = self.control.failed_acks(publish_id)
            if failed:
                raise WeightBusError(f"weight bus: receivers reported failures: {failed}")
        return check

    def _drop_group(self, abort_reason: str | None = None) -> None:
        """Close the current generation; with ``abort_reason``, tell its receivers to give up."""
        if self._group is None:
            return
        if abort_reason is not None:
            self._group.abort(abort_reason)
        self._group.close()
        self._group = None

    def _new_spec(self, world_size: int) -> GroupSpec:
        self._generation += 1
        nccl_port = free_port(self.host) if self.backend == "nccl" else 0
        return GroupSpec(generation=self._generation, backend=self.backend, host=self.host,
                         store_port=self._store.port, world_size=world_size, rank=0,
                         timeout_s=self.timeout_s, nccl_port=nccl_port,
                         run=self.control.token)

    def _open_generation(self, targets: tuple[str, ...], version: int, publish_id: str,
                         check: Check) -> WeightGroup:
        """Announce ``version`` to ``targets`` on the current generation if they are exactly its
        members, else on a new generation (formed here: blocks until every target joined)."""
        group = self._group
        reuse = group is not None and not group.broken and self._members == targets
        if not reuse:
            self._drop_group()
        spec0 = group.spec if reuse and group is not None else self._new_spec(len(targets) + 1)
        for rank, rid in enumerate(targets, start=1):
            self.control.announce(rid, Announce(version=version, publish_id=publish_id,
                                                group=msgspec.structs.replace(spec0, rank=rank)))
        if reuse and group is not None:
            return group
        group = join_group(spec0, self._store, time.monotonic() + self.timeout_s, check)
        self._group, self._members = group, targets
        return group

    def _send_to(self, members: tuple[str, ...], version: int, publish_id: str,
                 transmit: Transmit) -> Exception | None:
        """Send a version to ``members`` (if any); returns why that failed, if it did."""
        if not members:
            return None
        try:
            self._send(members, version, publish_id, transmit)
        except (WeightBusError, RuntimeError) as exc:
            log.error("weight bus: publish of version %d failed: %s", version, exc)
            return exc
        return None

    def _send(self, targets: tuple[str, ...], version: int, publish_id: str,
              transmit: Transmit) -> None:
        """Announce ``version`` to ``targets``, broadcast it, check the manifests they acked."""
        check = self._check(targets, publish_id)
        group = self._open_generation(targets, version, publish_id, check)
        try:
            specs = transmit(group, check)
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
        """Send the kept copy of the latest version to ``targets`` (it follows the plan)."""
        assert self._plan is not None and self._kept is not None
        segments = (Outgoing(i, data) for i, data in enumerate(self._kept.segments))
        self._send(targets, self._version, uuid.uuid4().hex,
                   lambda group, check: self._send_planned(group, check, segments, _noop))

    def _identify_lost(self, members: tuple[str, ...], publish_id: str,
                       failure: Exception) -> tuple[dict[str, str], bool]:
        """Who was lost, and whether they are alive but silent. After a timeout, the members
        that never took the announcement (no ack at all, heartbeats or not) are the silent ones
        (see ``_check``). Otherwise wait (at most one liveness
        window) for heartbeats to show who died; if nobody did, the receivers that acked
        ``failed`` are the lost ones (one whose engine died stays alive); survivors of a death
        also ack ``failed`` (their generation was aborted), so the dead are looked for first."""
        if dead := self.control.dead_among(members):
            return dead, False
        silent = self.control.silent_among(publish_id, members)
        if isinstance(failure, WeightBusTimeout) and silent:
            why = (f"alive (heartbeats) but silent: did not take the announcement within "
                   f"timeout_s/2={self.timeout_s / 2:g} s")
            return {rid: why for rid in silent}, True
        deadline = time.monotonic() + self.control.dead_after_s + 0.5
        while time.monotonic() <= deadline:
            if dead := self.control.dead_among(members):
                return dead, False
            time.sleep(0.05)
        return {rid: f"failed to receive: {err}"
                for rid, err in self.control.failed_acks(publish_id).items()}, False

    def _recover(self, members: tuple[str, ...], version: int, publish_id: str,
                 failure: Exception) -> None:
        """After a failed broadcast: abort the generation, name the lost, serve the survivors."""
        generation = self._generation
        self._drop_group(f"publish of version {version} failed: {failure}")
        dead, silenced = ((failure.dead, False) if isinstance(failure, _Dead)
                          else self._identify_lost(members, publish_id, failure))
        self.control.forget(dead, silenced=silenced)
        survivors = [m for m in members if m not in dead]
        recovered = False
        if survivors and self._kept is not None:
            try:
                self._send_cached(tuple(survivors))
                recovered = True
            except (WeightBusError, RuntimeError) as exc:
                log.error("weight bus: re-sending version %d to %s failed: %s",
                          version, survivors, exc)
        if not dead:
            raise WeightBusError(
                f"weight bus: publish of version {version} on generation {generation} failed "
                f"({failure}); members {list(members)}; "
                + ("re-sent to all of them" if recovered else "they need a fresh publish")
            ) from failure
        what = (f"version {version} re-sent to them on generation {self._generation}"
                if recovered else "they get the next publish")
        raise ReceiverDied(
            f"weight bus: receiver(s) {sorted(dead)} lost during publish of version {version} "
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
                self._catch_up()
            if self.control.joiners:  # a failed catch-up requeued them: back off first
                self._closed.wait(CATCH_UP_RETRY_S)

    def _catch_up(self) -> None:
        """Serve the receivers that joined behind the latest version (under ``_lock``)."""
        joiners = self.control.take_joiners()
        live = set(self.control.live())
        behind = tuple(sorted(j for j in set(joiners) & live
                              if self.control.received_version(j) < self._version))
        if not behind:
            return
        if self._kept is None:
            log.info("weight bus: %s joined late; no copy kept, the next publish serves them",
                     behind)
            return
        try:
            self._send_cached(behind)
            log.info("weight bus: sent version %d to late joiners %s", self._version, behind)
        except (WeightBusError, RuntimeError) as exc:
            log.error("weight bus: catch-up of %s failed: %s; retrying in %.0f s", behind, exc,
                      CATCH_UP_RETRY_S)
            self._drop_group(f"catch-up failed: {exc}")
            # A joiner left behind would sample with stale weights forever: try again.
            self.control.requeue_joiners(behind)


def _noted(items: Iterator[T], into: list[T]) -> Iterator[T]:
    """Yield ``items``, appending each to ``into``."""
    for item in items:
        into.append(item)
        yield item


def _named(source: NamedTensors, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``source``, noting each name in ``names`` (the order a plan records)."""
    for name, tensor in source:
        names.append(name)
        yield name, tensor


def _exhaust(items: Iterator[object]) -> None:
    for _ in items:
        pass


def _noop(_item: object) -> None:
    return None
