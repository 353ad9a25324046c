"""The data-plane wire format of one version on a formed weight group.

Every version opens with a header ``int64[2] = (kind, n)`` broadcast from rank 0:
- ``PLANNED``: the version follows the bucket plan this generation already got; ``PLAN_FOLLOWS``:
  the msgpack ``BucketPlan`` comes next (``n`` bytes), announced once per generation. Then one
  broadcast per ``Segment`` of the plan and nothing else: no per-bucket header. The receiver
  posts every receive at once, into pooled buffers of the plan's bucket sizes (the same ones
  version after version); the sender keeps up to ``window_bytes`` on the wire while it packs
  the next segments.
- ``STREAMED``: a version with no plan yet (the first of a model), ``n`` the bucket size it was
  packed with; per bucket a header ``int64[2] = (spec bytes, data bytes)``, the msgpack
  ``BucketSpec``, the flat data; a ``(0, 0)`` header ends it. The publisher makes the plan from
  it, staging one bucket at a time.

Parts: ``send_planned`` / ``send_streamed`` (rank 0), ``recv_version`` (every other rank: the
whole version into pooled buffers) or ``recv_buckets`` (bucket by bucket into one buffer, for a
consumer that loads each bucket before the next is received),
``manifest_of`` (the ``WeightManifest`` both sides assemble; the publisher compares the
receivers' with its own), ``Check`` (the poll every bounded wait runs; raises to give up).

Dependencies: ``groups`` (the group and its pending broadcasts), ``buckets`` (layout, packing),
``types``. The publisher and receiver import this module; it imports neither.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from streamrl.types import BucketSpec, WeightManifest, decode, encode
from streamrl.weight_bus.base import WeightBusError
from streamrl.weight_bus.buckets import Bucket, BucketPlan, BufferPool, Outgoing, unpack
from streamrl.weight_bus.groups import Pending, WeightGroup

Check = Callable[[], None]
STREAMED, PLANNED, PLAN_FOLLOWS = 0, 1, 2
"""Kinds of version header."""


class _Window:
    """Broadcasts from rank 0 in flight, retired oldest first (each wait bounded by
    ``timeout_s``) once more than ``limit_bytes`` are out."""

    def __init__(self, group: WeightGroup, limit_bytes: int, timeout_s: float,
                 check: Check) -> None:
        self.group, self.limit_bytes, self.timeout_s, self.check = (
            group, limit_bytes, timeout_s, check)
        self._out: deque[tuple[Pending, torch.Tensor, str, Callable[[], None] | None]] = deque()
        self._bytes = 0

    def post(self, tensor: torch.Tensor, what: str,
             done: Callable[[], None] | None = None) -> None:
        """Start broadcasting ``tensor``; ``done()`` once it left the wire."""
        self._out.append((self.group.broadcast(tensor), tensor, what, done))
        self._bytes += tensor.numel() * tensor.element_size()
        while self._bytes > self.limit_bytes and len(self._out) > 1:
            self._retire()

    def drain(self) -> None:
        while self._out:
            self._retire()

    def _retire(self) -> None:
        pending, tensor, what, done = self._out.popleft()
        pending.wait(time.monotonic() + self.timeout_s, self.check,
                     f"broadcast of {what} (generation {self.group.generation})")
        self._bytes -= tensor.numel() * tensor.element_size()
        if done is not None:
            done()


def _header(group: WeightGroup, a: int, b: int) -> torch.Tensor:
    return torch.tensor([a, b], dtype=torch.int64).to(group.device)


def _blob(group: WeightGroup, payload: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(group.device)


def send_planned(group: WeightGroup, plan: BucketPlan, segments: Iterator[Outgoing], *,
                 announce_plan: bool, window_bytes: int, timeout_s: float, check: Check,
                 sent: Callable[[Outgoing], None]) -> None:
    """Broadcast a version that follows ``plan``; ``sent(out)`` once a segment left the wire."""
    window = _Window(group, window_bytes, timeout_s, check)
    if announce_plan:
        blob = encode(plan)
        window.post(_header(group, PLAN_FOLLOWS, len(blob)), "version header")
        window.post(_blob(group, blob), "bucket plan")
    else:
        window.post(_header(group, PLANNED, 0), "version header")
    # next() packs segment i+1 (consuming the learner's iterator) while segment i is on the wire.
    for out in segments:
        window.post(out.data, f"segment {out.index} of {len(plan.segments)}",
                    lambda out=out: sent(out))
    window.drain()


def send_streamed(group: WeightGroup, buckets: Iterator[Bucket], *, bucket_bytes: int,
                  timeout_s: float, check: Check,
                  sent: Callable[[Bucket], None]) -> list[BucketSpec]:
    """Broadcast every bucket ``buckets`` (packed into ``bucket_bytes``) yields, each after its
    spec; ``sent(bucket)`` once a bucket left the wire, which is before the next one is packed:
    the sender stages one bucket at a time (its buffer takes the next). Only the first version
    of a model goes this way, so packing does not overlap the wire only once."""
    specs: list[BucketSpec] = []
    window = _Window(group, 0, timeout_s, check)
    # The bucket size lets a streamed receive size its one buffer before the first bucket.
    window.post(_header(group, STREAMED, bucket_bytes), "version header")
    for bucket in buckets:
        spec_bytes = encode(bucket.spec)
        what = f"bucket {len(specs)}"
        window.post(_header(group, len(spec_bytes), bucket.spec.nbytes), f"header of {what}")
        window.post(_blob(group, spec_bytes), f"spec of {what}")
        window.post(bucket.data, what, lambda bucket=bucket: sent(bucket))
        window.drain()
        specs.append(bucket.spec)
    window.post(_header(group, 0, 0), "end-of-version marker")
    window.drain()
    return specs


@dataclass
class Received:
    """One version as a receiver got it."""

    plan: BucketPlan | None
    """The plan it followed (None: it was streamed)."""
    specs: list[BucketSpec]
    tensors: list[tuple[str, torch.Tensor]]
    """Views into ``buffers``."""
    buffers: list[torch.Tensor]


def recv_version(group: WeightGroup, plan: BucketPlan | None, *, timeout_s: float, check: Check,
                 pool: BufferPool) -> Received:
    """Receive one version; ``plan`` is the one this generation got last (None: none yet).
    The data lands in buffers taken from ``pool``."""
    if plan is not None:
        return _recv_planned(group, plan, timeout_s=timeout_s, check=check, pool=pool)
    kind, n = _recv_header(group, "version header", timeout_s, check)
    if kind == STREAMED:
        return _recv_streamed(group, timeout_s=timeout_s, check=check, pool=pool)
    if kind == PLAN_FOLLOWS:
        blob = torch.empty(n, dtype=torch.uint8, device=group.device)
        _wait(group, group.broadcast(blob), "bucket plan", timeout_s, check)
        plan = decode(blob.cpu().numpy().tobytes(), BucketPlan)
        return _recv_planned(group, plan, timeout_s=timeout_s, check=check, pool=pool,
                             header_read=True)
    raise WeightBusError(f"weight bus: version header ({kind}, {n}) on generation "
                         f"{group.generation}, which has no bucket plan")


def _recv_planned(group: WeightGroup, plan: BucketPlan, *, timeout_s: float, check: Check,
                  pool: BufferPool, header_read: bool = False) -> Received:
    """Receive a version that follows ``plan``. Every receive is posted at once, the version
    header's with them: a generation that announced its plan sends only ``PLANNED`` versions
    (a new plan means a new generation), so waiting for the header first would only leave the
    sender's first segment waiting for this receiver."""
    header = torch.empty(2, dtype=torch.int64, device=group.device)
    p_header = None if header_read else group.broadcast(header)
    buffers = [pool.take(spec.nbytes, group.device) for spec in plan.buckets]
    pending = [group.broadcast(buffers[s.bucket][s.start: s.end]) for s in plan.segments]
    if p_header is not None:
        _wait(group, p_header, "version header", timeout_s, check)
        if int(header[0]) != PLANNED:
            # The receives posted for the segments no longer match the wire: the generation is
            # unusable (the caller drops it).
            raise WeightBusError(f"weight bus: version header {header.tolist()} on generation "
                                 f"{group.generation}, which announced its bucket plan: only "
                                 "planned versions may follow")
    for i, p in enumerate(pending):
        _wait(group, p, f"segment {i} of {len(pending)}", timeout_s, check)
    by_bucket = [unpack(spec, data) for spec, data in zip(plan.buckets, buffers, strict=True)]
    tensors = [by_bucket[b][j] for b, j in plan.order]  # in the order the learner yields them
    return Received(plan, list(plan.buckets), tensors, buffers)


def _wait(group: WeightGroup, p: Pending, what: str, timeout_s: float, check: Check) -> None:
    p.wait(time.monotonic() + timeout_s, check, f"{what} (generation {group.generation})")


def _recv_header(group: WeightGroup, what: str, timeout_s: float,
                 check: Check) -> tuple[int, int]:
    header = torch.empty(2, dtype=torch.int64, device=group.device)
    _wait(group, group.broadcast(header), what, timeout_s, check)
    a, b = (int(x) for x in header.tolist())
    return a, b


def _recv_streamed(group: WeightGroup, *, timeout_s: float, check: Check,
                   pool: BufferPool) -> Received:
    device = group.device
    buffers: list[torch.Tensor] = []
    specs: list[BucketSpec] = []
    tensors: list[tuple[str, torch.Tensor]] = []
    spec_len, data_len = _recv_header(group, "first bucket header", timeout_s, check)
    while spec_len:
        data = pool.take(data_len, device)
        buffers.append(data)
        spec, next_header = _recv_bucket(group, spec_len, data, len(specs), timeout_s, check)
        tensors.extend(unpack(spec, data))
        specs.append(spec)
        spec_len, data_len = next_header()
    return Received(None, specs, tensors, buffers)


def _recv_bucket(group: WeightGroup, spec_len: int, data: torch.Tensor, index: int,
                 timeout_s: float, check: Check
                 ) -> tuple[BucketSpec, Callable[[], tuple[int, int]]]:
    """Bucket ``index`` of a ``STREAMED`` version into ``data``: its spec, and a wait for the
    next bucket's header, whose receive is posted with this bucket's (the sender never waits on
    us)."""
    spec_t = torch.empty(spec_len, dtype=torch.uint8, device=group.device)
    header = torch.empty(2, dtype=torch.int64, device=group.device)
    p_spec, p_data, p_next = (group.broadcast(t) for t in (spec_t, data, header))
    _wait(group, p_spec, f"spec of bucket {index}", timeout_s, check)
    spec = decode(spec_t.cpu().numpy().tobytes(), BucketSpec)
    _wait(group, p_data, f"data of bucket {index}", timeout_s, check)

    def next_header() -> tuple[int, int]:
        _wait(group, p_next, f"header after bucket {index}", timeout_s, check)
        a, b = (int(x) for x in header.tolist())
        return a, b

    return spec, next_header


@dataclass
class Streaming:
    """What a streamed receive (``recv_buckets``) got so far."""

    plan: BucketPlan | None
    """The plan the generation got last (None: none yet); then the one the version followed."""
    specs: list[BucketSpec] = field(default_factory=list)
    """Filled in when the version is complete."""
    complete: bool = False
    wire_s: float = 0.0
    """Seconds spent receiving (not in the consumer's load), as its caller counts them."""


def recv_buckets(group: WeightGroup, state: Streaming, *, timeout_s: float, check: Check,
                 pool: BufferPool) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Receive one version bucket by bucket (``weight_bus.receive=streamed``), yielding each
    bucket's tensors as views into its receive buffer, which takes the next bucket once the
    consumer asks for it: the consumer copies them first. A bucket's receives are posted only
    then, so the sender waits while the consumer loads. Buffers: one per bucket open at once
    (one unless the plan interleaves dtypes); a planned version's all of its largest bucket's
    size, from ``pool`` and given back there; a streamed (first) version's of the bucket size
    (larger for a weight larger than a bucket), dropped at its end."""
    header_read = False
    if state.plan is None:
        kind, n = _recv_header(group, "version header", timeout_s, check)
        if kind == STREAMED:
            yield from _stream_streamed(group, state, n, timeout_s=timeout_s, check=check)
            state.complete = True
            return
        if kind != PLAN_FOLLOWS:
            raise WeightBusError(f"weight bus: version header ({kind}, {n}) on generation "
                                 f"{group.generation}, which has no bucket plan")
        blob = torch.empty(n, dtype=torch.uint8, device=group.device)
        _wait(group, group.broadcast(blob), "bucket plan", timeout_s, check)
        state.plan, header_read = decode(blob.cpu().numpy().tobytes(), BucketPlan), True
    yield from _stream_planned(group, state.plan, header_read, timeout_s=timeout_s, check=check,
                               pool=pool)
    state.specs, state.complete = list(state.plan.buckets), True


def _stream_planned(group: WeightGroup, plan: BucketPlan, header_read: bool, *,
                    timeout_s: float, check: Check,
                    pool: BufferPool) -> Iterator[list[tuple[str, torch.Tensor]]]:
    device = group.device
    size = max((b.nbytes for b in plan.buckets), default=0)
    last = {s.bucket: i for i, s in enumerate(plan.segments)}  # the segment completing a bucket
    header = torch.empty(2, dtype=torch.int64, device=device)
    p_header = None if header_read else group.broadcast(header)
    open_buffers: dict[int, torch.Tensor] = {}
    posted: list[tuple[int, Pending]] = []
    for i, segment in enumerate(plan.segments):
        buffer = open_buffers.get(segment.bucket)
        if buffer is None:
            buffer = open_buffers[segment.bucket] = pool.take(size, device)
        posted.append((i, group.broadcast(buffer[segment.start: segment.end])))
        if last[segment.bucket] != i:
            continue
        if p_header is not None:
            _wait(group, p_header, "version header", timeout_s, check)
            p_header = None
            if int(header[0]) != PLANNED:
                raise WeightBusError(f"weight bus: version header {header.tolist()} on "
                                     f"generation {group.generation}, which announced its "
                                     "bucket plan: only planned versions may follow")
        for j, p in posted:
            _wait(group, p, f"segment {j} of {len(plan.segments)}", timeout_s, check)
        posted = []
        spec = plan.buckets[segment.bucket]
        yield unpack(spec, open_buffers[segment.bucket][: spec.nbytes])
        pool.give(open_buffers.pop(segment.bucket))
    if p_header is not None:  # a plan with no bytes at all
        _wait(group, p_header, "version header", timeout_s, check)
    empty = torch.empty(0, dtype=torch.uint8, device=device)
    for b, spec in enumerate(plan.buckets):
        if b not in last:  # only empty tensors: nothing went on the wire for it
            yield unpack(spec, empty)


def _stream_streamed(group: WeightGroup, state: Streaming, bucket_bytes: int, *,
                     timeout_s: float, check: Check) -> Iterator[list[tuple[str, torch.Tensor]]]:
    device = group.device
    buffer = torch.empty(0, dtype=torch.uint8, device=device)
    specs: list[BucketSpec] = []
    spec_len, data_len = _recv_header(group, "first bucket header", timeout_s, check)
    while spec_len:
        if buffer.numel() < data_len:
            # Of the bucket size at once: the consumer still holds a view of the old buffer
            # while it asks for this bucket, so growing bucket by bucket would hold two. Only a
            # weight larger than a bucket makes it grow again.
            del buffer
            buffer = torch.empty(max(data_len, bucket_bytes), dtype=torch.uint8, device=device)
        data = buffer[:data_len]
        spec, next_header = _recv_bucket(group, spec_len, data, len(specs), timeout_s, check)
        specs.append(spec)
        yield unpack(spec, data)
        del data  # with ``buffer``, freed before a larger bucket's buffer is made
        spec_len, data_len = next_header()
    state.specs = specs


def manifest_of(version: int, publish_id: str, specs: list[BucketSpec]) -> WeightManifest:
    return WeightManifest(version=version, buckets=tuple(specs),
                          total_bytes=sum(s.nbytes for s in specs), publish_id=publish_id)
