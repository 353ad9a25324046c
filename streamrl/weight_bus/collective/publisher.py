"""Learner side of the collective bus: ``CollectivePublisher`` (learner rank 0).

Roster, announcements and acks go over ``control.ControlServer``; group generations rendezvous on
one ``TCPStore``. ``publish`` packs lazily from the learner's iterator, broadcasts on the current
generation and checks every receiver's ``received`` ack and the manifest it assembled, within
``timeout_s``. The first version of a model is streamed bucket by bucket (``wire.send_streamed``,
one bucket staged at a time) and yields the model's ``BucketPlan``; every later one follows that
plan (``wire.send_planned``: the plan is announced once per generation, segments go out as they
are packed, zero-copy where the weights lie contiguously, else through staging buffers of one
chunk). Nothing outlives its broadcast: the publisher keeps no copy of any version. After a
failed broadcast ``_recover`` aborts the generation and names the dead; the survivors, like late
joiners, are ``behind`` until the next ``publish`` or a ``catch_up`` serves them (see the package
docstring for both policies).

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
from typing import NoReturn

import msgspec
import torch
import torch.distributed as dist

from streamrl.net import LOOPBACK, free_port
from streamrl.types import BucketSpec
from streamrl.weight_bus.base import (
    NamedTensors,
    PublishStats,
    ReceiverDied,
    WeightBusError,
    WeightBusTimeout,
    WeightPublisher,
    check_version,
)
from streamrl.weight_bus.buckets import (
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
GLOO_CHUNK_BYTES = 8 << 20
"""Largest broadcast of a planned version on gloo: a chunk is packed while the one before it is
on the wire. Measured on 2 cores (95 MiB, loopback, packed): 1-2 MiB chunks pay gloo's fixed
cost per broadcast (0.7x a raw broadcast), 8 MiB came closest to it. NCCL sends whole buckets."""
Transmit = Callable[[WeightGroup, Check], list[BucketSpec]]
"""Broadcasts one version on a formed group, polling the check; returns the specs it followed."""


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
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend={backend!r}: must be 'gloo' or 'nccl'")
        if bucket_mb <= 0 or timeout_s <= 0:
            raise ValueError(f"bucket_mb={bucket_mb}, timeout_s={timeout_s}: must be > 0")
        self.host, self.backend, self.timeout_s = host, backend, timeout_s
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.cast_dtype = cast_dtype
        self.control = ControlServer(host, port, timeout_s=timeout_s)
        self.endpoint = self.control.endpoint
        self._store = dist.TCPStore(host, 0, None, True, datetime.timedelta(seconds=timeout_s),
                                    wait_for_workers=False)
        self._lock = threading.RLock()
        self._version = -1
        self._plan: BucketPlan | None = None
        self._plan_generation = -1  # the generation that got ``_plan`` announced last
        # Staging buffers reused from segment to segment and version to version (warm pages).
        self._pool = BufferPool()
        self._generation = 0
        self._group: WeightGroup | None = None
        self._members: tuple[str, ...] = ()

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
        """Block until every live receiver that received ``version`` (or newer) loaded it;
        returns every member's loaded version. Receivers ``behind`` it are not waited for: no
        load of it is coming until a publish or ``catch_up`` reaches them."""
        def loading() -> dict[str, int]:
            """Live receivers that received ``version`` or newer and have not loaded it."""
            received = self.control.received_versions()
            loaded = self.control.loaded_versions()
            return {r: loaded.get(r, -1) for r in self.control.live()
                    if received.get(r, -1) >= version and loaded.get(r, -1) < version}

        if not self.control.wait_for(lambda: not loading(), timeout or self.timeout_s):
            raise WeightBusError(f"weight bus: receivers {loading()} (loaded versions) did not "
                                 f"load version {version} within {timeout or self.timeout_s} s")
        return self.control.loaded_versions()

    def publish(self, version: int, named_tensors: NamedTensors) -> PublishStats:
        with self._lock:
            check_version(version, self._version)
            return self._publish(version, tuple(self.control.live()), named_tensors,
                                 new_version=True)

    def behind(self) -> list[str]:
        """Live receivers that have not received the latest version: joined since it was
        published (a replica created or restarted mid-run) or survivors of its failed publish."""
        with self._lock:
            received = self.control.received_versions()
            return [r for r in self.control.live() if received.get(r, -1) < self._version]

    def catch_up(self, version: int, named_tensors: NamedTensors) -> PublishStats:
        """Send the latest version again, to the receivers ``behind`` it only (on a generation
        of their own). ``named_tensors`` must be that version's weights: the learner's, at the
        step boundary it published them at (every FSDP rank gathers them again). Consumed to
        the end even when nobody is behind. A failure is raised as by ``publish``."""
        with self._lock:
            if version < 0 or version != self._version:
                _exhaust(iter(named_tensors))
                raise ValueError(f"version={version}: catch_up re-sends the latest published "
                                 f"version ({self._version}), unchanged")
            return self._publish(version, tuple(self.behind()), named_tensors, new_version=False)

    def close(self) -> None:
        with self._lock:
            self._drop_group()
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

    def _publish(self, version: int, targets: tuple[str, ...], named_tensors: NamedTensors, *,
                 new_version: bool) -> PublishStats:
        """Send ``version`` to ``targets`` (under ``_lock``): a new version (``publish``) or
        the latest again (``catch_up``)."""
        start = time.monotonic()
        source = iter(named_tensors)
        publish_id = uuid.uuid4().hex
        try:
            transmit, drain = self._version_out(source)
            failure = self._send_to(targets, version, publish_id, transmit)
            drain()  # even after a failure: the other FSDP ranks gather in lockstep
        except LayoutChanged as exc:
            self._forget_layout(version, source, exc, new_version)
        assert self._plan is not None
        specs = list(self._plan.buckets)
        self._version = version
        if failure is not None:
            self._recover(targets, version, publish_id, failure)
        return PublishStats(
            version=version, nbytes=sum(b.nbytes for b in specs),
            num_tensors=len(self._plan.order), num_buckets=len(specs),
            seconds=time.monotonic() - start, receivers=targets,
            generation=self._generation if targets else -1,
        )

    def _version_out(self, source: NamedTensors) -> tuple[Transmit, Callable[[], None]]:
        """How this version goes out (``transmit``) and ``drain``, which packs what the
        broadcast did not (or all of it, with no receivers) and leaves ``_plan`` describing
        this version."""
        if self._plan is None:
            return self._streamed(source)
        packer = PlannedPacker(self._plan, device=self._device(), cast_dtype=self.cast_dtype,
                               pool=self._pool)
        segments = packer.segments(source)
        return (lambda group, check: self._send_planned(group, check, segments, packer.release),
                lambda: _exhaust(segments))

    def _streamed(self, source: NamedTensors) -> tuple[Transmit, Callable[[], None]]:
        """The first version of a model: bucket by bucket, each with its spec; makes the plan."""
        packer = BucketPacker(self.bucket_bytes, cast_dtype=self.cast_dtype,
                              device=self._device(), pool=self._pool)
        names: list[str] = []
        specs: list[BucketSpec] = []
        buckets = _specs_noted(packer.pack(_named(source, names)), specs)

        def drain() -> None:
            _exhaust(buckets)
            self._plan = BucketPlan.build(specs, names, self._chunk_bytes())
            self._plan_generation = -1
            # Later versions stage only runs of small weights, in buffers of one chunk: the
            # streamed version's bucket buffer would sit in the pool for good.
            self._pool.clear()

        return (lambda group, check: send_streamed(group, buckets,
                                                   bucket_bytes=self.bucket_bytes,
                                                   timeout_s=self.timeout_s, check=check,
                                                   sent=packer.release),
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

    def _forget_layout(self, version: int, source: NamedTensors, exc: LayoutChanged,
                       new_version: bool) -> NoReturn:
        """The weights no longer follow the plan: no receiver got this version (its broadcast
        is aborted) and the next publish makes a new plan."""
        _exhaust(iter(source))  # the other FSDP ranks gather in lockstep
        self._drop_group(f"version {version} does not follow the bucket plan: {exc}")
        self._plan = None
        what = "published" if new_version else "re-sent"
        raise WeightBusError(f"weight bus: version {version} was not {what}: its weights do "
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
        """After a failed broadcast: abort the generation, name the lost. Nothing is re-sent
        (no copy is kept): survivors that did not receive the version whole are ``behind`` it
        until a publish or ``catch_up``."""
        generation = self._generation
        self._drop_group(f"send of version {version} failed: {failure}")
        dead, silenced = ((failure.dead, False) if isinstance(failure, _Dead)
                          else self._identify_lost(members, publish_id, failure))
        self.control.forget(dead, silenced=silenced)
        survivors = [m for m in members if m not in dead]
        if not dead:
            raise WeightBusError(
                f"weight bus: send of version {version} on generation {generation} failed "
                f"({failure}); members {list(members)} are behind it until the next publish "
                "or catch_up") from failure
        raise ReceiverDied(
            f"weight bus: receiver(s) {sorted(dead)} lost during the send of version {version} "
            f"(generation {generation}): "
            + "; ".join(f"{rid}: {why}" for rid, why in sorted(dead.items()))
            + f". Those of the survivors {survivors} that did not receive it whole are behind it "
            "until the next publish or catch_up.",
            dead=dead, survivors=survivors, version=version,
        ) from failure


def _specs_noted(buckets: Iterator[Bucket], into: list[BucketSpec]) -> Iterator[Bucket]:
    """Yield ``buckets``, appending each one's spec to ``into`` (the buckets themselves go once
    sent)."""
    for bucket in buckets:
        into.append(bucket.spec)
        yield bucket


def _named(source: NamedTensors, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``source``, noting each name in ``names`` (the order a plan records)."""
    for name, tensor in source:
        names.append(name)
        yield name, tensor


def _exhaust(items: Iterator[object]) -> None:
    for _ in items:
        pass

