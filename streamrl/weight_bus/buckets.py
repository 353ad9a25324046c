"""Flat weight buckets: the layout of one model's weights on the bus, and packing into it.

Parts:
- ``BucketPacker.pack(named_tensors)``: lays out a version with no plan yet (the first): consumes
  the iterator one tensor at a time and yields a ``Bucket`` (a ``BucketSpec`` + a flat ``uint8``
  tensor) as soon as one is full, so a learner that gathers FSDP shards one parameter at a time
  holds at most the open bucket of each dtype plus the buckets still on the wire. A released
  buffer takes the next bucket; a weight larger than a bucket goes alone, as a view of its own
  memory (no buffer of its size).
- ``BucketPlan``: that layout, made once per model from the first version and reused by every
  later one: the buckets (fixed sizes and offsets), the order the learner yields the weights in,
  and the ``Segment`` s (byte ranges of a bucket, at most ``chunk_bytes``: a large weight or a
  piece of one, or a run of small weights) each version goes out in. Both sides know it, so a
  planned version carries no per-bucket header and a receiver posts every receive at once.
- ``PlannedPacker.segments(named_tensors)``: the data of each segment of a planned version, in
  wire order, as soon as its last weight arrives; a view of the learner's own memory where the
  segment is one contiguous run of same-dtype bytes there (zero-copy), else copied into a
  pooled staging buffer (all of one size, so the buffers sent segments hand back take the next
  ones). ``LayoutChanged`` when the weights do not follow the plan.
- ``unpack(spec, data)``: the named tensors of a received bucket, as views into ``data`` (no copy).
- ``dtype_name`` / ``dtype_from_name``: the dtype strings on the wire (a closed whitelist).

Layout: ``TensorSpec.offset`` is a byte offset into the bucket, aligned to ``ALIGN`` bytes so a
view of any dtype is valid; ``BucketSpec.nbytes`` is the end of the last tensor. This module is
pure torch and depends only on ``streamrl.types``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import msgspec
import torch

from streamrl.types import BucketSpec, TensorSpec

ALIGN = 64
"""Byte alignment of every tensor inside a bucket (any dtype view is legal at this offset)."""
SMALL_BYTES = 1 << 20
"""Below this, weights share broadcasts (each has a fixed cost); larger ones go alone, which
lets them go out zero-copy."""

_WIRE_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
        "int64", "int32", "int16", "int8", "uint8", "bool",
    )
    if hasattr(torch, name)
}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _WIRE_DTYPES:
        raise ValueError(f"dtype={dtype}: not supported on the weight bus ({sorted(_WIRE_DTYPES)})")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _WIRE_DTYPES[name]
    except KeyError:
        raise ValueError(
            f"dtype={name!r}: not a weight-bus dtype ({sorted(_WIRE_DTYPES)})"
        ) from None


def _align(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class Bucket:
    """One packed bucket: ``data`` is exactly ``spec.nbytes`` long (a view of a pooled buffer)."""

    spec: BucketSpec
    data: torch.Tensor
    buffer: torch.Tensor | None = field(repr=False)
    """The whole (possibly larger) buffer, handed back to the packer by ``release``; None when
    ``data`` is a view of the weight itself (one larger than a bucket)."""


@dataclass
class _Open:
    dtype: torch.dtype
    buffer: torch.Tensor
    offset: int = 0
    tensors: list[TensorSpec] = field(default_factory=list)

    def fits(self, nbytes: int) -> bool:
        return _align(self.offset) + nbytes <= self.buffer.numel()

    def close(self) -> Bucket:
        spec = BucketSpec(dtype=dtype_name(self.dtype), nbytes=self.offset,
                          tensors=tuple(self.tensors))
        return Bucket(spec=spec, data=self.buffer[: self.offset], buffer=self.buffer)


class BufferPool:
    """Flat uint8 buffers kept for reuse, by (device, size).

    Fresh memory costs a page fault per 4 KiB on first touch, which makes packing or receiving
    100 MB ~5x slower than into warm memory; reusing the previous version's buffers avoids it.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[torch.device, int], list[torch.Tensor]] = {}

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        free = self._free.get((device, nbytes))
        if free:
            return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        self._free.setdefault((buffer.device, buffer.numel()), []).append(buffer)

    def clear(self) -> None:
        self._free.clear()


class BucketPacker:
    """Packs named tensors into flat per-dtype buckets of ``bucket_bytes`` (lazily, pooled).

    ``cast_dtype`` casts floating-point tensors (e.g. to the rollout dtype) while packing;
    ``device`` is where buckets live (``None``: the device of the tensor that opens a bucket).
    A tensor larger than ``bucket_bytes`` travels alone in a bucket of its own: a view of the
    tensor where it is contiguous on ``device``, else a copy. Buffers come from ``pool``.
    """

    def __init__(
        self,
        bucket_bytes: int,
        *,
        cast_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        pool: BufferPool | None = None,
    ) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes={bucket_bytes}: must be > 0")
        self.bucket_bytes = bucket_bytes
        self.cast_dtype = cast_dtype
        self.device = torch.device(device) if device is not None else None
        self.pool = pool if pool is not None else BufferPool()

    def release(self, bucket: Bucket) -> None:
        """Hand a sent bucket's buffer back for reuse."""
        if bucket.buffer is not None:
            self.pool.give(bucket.buffer)

    def _buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return self.pool.take(max(self.bucket_bytes, nbytes), device)

    def pack(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[Bucket]:
        """Yield full buckets while consuming ``named_tensors`` one tensor at a time."""
        open_buckets: dict[torch.dtype, _Open] = {}
        seen: set[str] = set()
        for name, tensor in named_tensors:
            tensor = _cast(_checked(name, tensor), self.cast_dtype)
            if name in seen:
                raise ValueError(f"weight name={name!r}: appears twice in one version")
            seen.add(name)
            nbytes = tensor.numel() * tensor.element_size()
            current = open_buckets.get(tensor.dtype)
            if current is not None and not current.fits(nbytes):
                yield open_buckets.pop(tensor.dtype).close()
                current = None
            device = self.device or tensor.device
            if nbytes > self.bucket_bytes and tensor.is_contiguous() and tensor.device == device:
                # Alone anyway: a buffer of its size would double it while it is on the wire.
                spec = TensorSpec(name=name, shape=tuple(tensor.shape),
                                  dtype=dtype_name(tensor.dtype), offset=0, numel=tensor.numel())
                yield Bucket(BucketSpec(dtype=spec.dtype, nbytes=nbytes, tensors=(spec,)),
                             tensor.reshape(-1).view(torch.uint8), None)
                del tensor
                continue
            if current is None:
                buffer = self._buffer(nbytes, device)
                current = open_buckets[tensor.dtype] = _Open(tensor.dtype, buffer)
            offset = _align(current.offset)
            target = current.buffer[offset: offset + nbytes].view(tensor.dtype).view(tensor.shape)
            target.copy_(tensor)
            current.tensors.append(TensorSpec(name=name, shape=tuple(tensor.shape),
                                              dtype=dtype_name(tensor.dtype), offset=offset,
                                              numel=tensor.numel()))
            current.offset = offset + nbytes
            del tensor, target  # a gathered full tensor is freed as soon as it is packed
        for current in open_buckets.values():
            yield current.close()


def _checked(name: object, tensor: object) -> torch.Tensor:
    if not isinstance(name, str) or not name:
        raise TypeError(f"weight name={name!r}: must be a non-empty str")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"weight {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    if type(tensor).__name__ == "DTensor":
        raise TypeError(
            f"weight {name!r} is a DTensor shard: publish full tensors (call p.full_tensor() "
            "on every FSDP rank and pass the result on rank 0)"
        )
    return tensor.detach()


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


class Segment(msgspec.Struct, array_like=True, frozen=True):
    """One broadcast of a planned version: bytes ``[start, end)`` of bucket ``bucket``."""

    bucket: int
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class BucketPlan(msgspec.Struct, kw_only=True, frozen=True):
    """The layout every version of one model follows on the bus (see the module docstring)."""

    buckets: tuple[BucketSpec, ...]
    order: tuple[tuple[int, int], ...]
    """(bucket, tensor index in it) of each weight, in the order the learner yields them."""
    segments: tuple[Segment, ...]
    """In wire order: each one is complete once the learner yielded its last weight."""

    @classmethod
    def build(cls, buckets: Sequence[BucketSpec], names: Sequence[str], chunk_bytes: int,
              alone_bytes: int = SMALL_BYTES) -> BucketPlan:
        """The plan of the version laid out in ``buckets``, whose weights came as ``names``;
        weights of ``alone_bytes`` or more get broadcasts of their own (see ``_segments``)."""
        where = {t.name: (b, j) for b, spec in enumerate(buckets)
                 for j, t in enumerate(spec.tensors)}
        if sorted(where) != sorted(names):
            raise ValueError("a bucket plan needs the name of every weight in its buckets, once")
        order = tuple(where[name] for name in names)
        return cls(buckets=tuple(buckets), order=order,
                   segments=_segments(buckets, order, chunk_bytes, alone_bytes))

    def tensor(self, index: int) -> TensorSpec:
        """The spec of the ``index``-th weight the learner yields."""
        bucket, j = self.order[index]
        return self.buckets[bucket].tensors[j]


def _nbytes(spec: TensorSpec) -> int:
    return spec.numel * dtype_from_name(spec.dtype).itemsize


def _segments(buckets: Sequence[BucketSpec], order: Sequence[tuple[int, int]],
              chunk_bytes: int, alone_bytes: int) -> tuple[Segment, ...]:
    """Cut a version into broadcasts of at most ``chunk_bytes``: each weight of ``alone_bytes``
    or more alone, in chunk-sized pieces (each can go out as a view of the learner's memory);
    runs of smaller consecutive weights of one bucket (adjacent there: a bucket fills in yield
    order), ended where the next weight goes to another bucket, so segments complete in wire
    order."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes={chunk_bytes}: must be > 0")
    out: list[Segment] = []
    run: Segment | None = None
    for bucket, j in order:
        spec = buckets[bucket].tensors[j]
        start, end = spec.offset, spec.offset + _nbytes(spec)
        if start == end:
            continue  # nothing to send for an empty tensor
        alone = end - start >= min(alone_bytes, chunk_bytes)
        if run is not None and not alone and run.bucket == bucket \
                and end - run.start <= chunk_bytes:
            run = Segment(bucket, run.start, end)
            continue
        if run is not None:
            out.append(run)
            run = None
        pieces = [Segment(bucket, a, min(a + chunk_bytes, end))
                  for a in range(start, end, chunk_bytes)]
        if alone:
            out.extend(pieces)
        else:
            run = pieces[0]
    if run is not None:
        out.append(run)
    return tuple(out)


class LayoutChanged(ValueError):
    """A version's weights do not follow the bucket plan made from the first version."""


@dataclass
class Outgoing:
    """The data of one segment, ready for the wire."""

    index: int
    data: torch.Tensor
    staging: torch.Tensor | None = None
    """The pooled buffer ``data`` was copied into, handed back by ``PlannedPacker.release``."""


@dataclass
class _Part:
    data: torch.Tensor
    """The weight's bytes (flat uint8, contiguous)."""
    offset: int
    """Where they start in their bucket."""

    @property
    def end(self) -> int:
        return self.offset + self.data.numel()


class PlannedPacker:
    """Produces the segments of a version that follows ``plan`` (lazily, in wire order).

    A segment that is one contiguous run of bytes in the learner's memory (one weight, or
    same-dtype weights laid out there as in the bucket) goes out as a view of that memory; any
    other is copied into a staging buffer from ``pool``. Every staging buffer has the size of
    the plan's largest segment (at most its chunk), so those handed back by ``release`` take
    the next segments: the pool holds no more of them than were on the wire at once.
    ``device`` is the weight group's.
    """

    def __init__(self, plan: BucketPlan, *, device: torch.device,
                 cast_dtype: torch.dtype | None = None, pool: BufferPool | None = None) -> None:
        self.plan, self.device, self.cast_dtype = plan, device, cast_dtype
        self.pool = pool if pool is not None else BufferPool()
        self.staging_bytes = max((s.nbytes for s in plan.segments), default=0)

    def release(self, out: Outgoing) -> None:
        """Hand a sent segment's staging buffer back for reuse."""
        if out.staging is not None:
            self.pool.give(out.staging)

    def segments(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[Outgoing]:
        """Yield each segment as soon as its last weight arrived; ``LayoutChanged`` on drift."""
        plan, cursor, count = self.plan, 0, 0
        parts: list[_Part] = []  # weights whose bytes are not all sent yet
        for index, (name, tensor) in enumerate(named_tensors):
            count = index + 1
            part = self._part(index, name, tensor)
            if part.data.numel() == 0:
                continue
            parts.append(part)
            bucket = plan.order[index][0]
            while (cursor < len(plan.segments) and plan.segments[cursor].bucket == bucket
                   and plan.segments[cursor].end <= part.end):
                segment = plan.segments[cursor]
                yield self._fill(cursor, segment, [p for p in parts if p.offset < segment.end])
                parts = [p for p in parts if p.end > segment.end]
                cursor += 1
        if count != len(plan.order):
            raise LayoutChanged(f"the version has {count} weights, the bucket plan "
                                f"{len(plan.order)}")

    def _part(self, index: int, name: str, tensor: object) -> _Part:
        tensor = _cast(_checked(name, tensor), self.cast_dtype)
        if index >= len(self.plan.order):
            raise LayoutChanged(f"weight #{index} {name!r} is beyond the bucket plan's "
                                f"{len(self.plan.order)} weights")
        spec = self.plan.tensor(index)
        got = (name, tuple(tensor.shape), dtype_name(tensor.dtype))
        if got != (spec.name, spec.shape, spec.dtype):
            raise LayoutChanged(f"weight #{index} is {got}, the bucket plan expects "
                                f"{(spec.name, spec.shape, spec.dtype)}")
        return _Part(tensor.contiguous().reshape(-1).view(torch.uint8), spec.offset)

    def _fill(self, index: int, segment: Segment, parts: list[_Part]) -> Outgoing:
        if (view := self._view(segment, parts)) is not None:
            return Outgoing(index, view)
        staging = self.pool.take(self.staging_bytes, self.device)
        dest = staging[: segment.nbytes]
        for p in parts:
            lo, hi = max(segment.start, p.offset), min(segment.end, p.end)
            dest[lo - segment.start: hi - segment.start].copy_(p.data[lo - p.offset: hi - p.offset])
        return Outgoing(index, dest, staging)

    def _view(self, segment: Segment, parts: list[_Part]) -> torch.Tensor | None:
        """``segment``'s bytes as a view of the learner's memory, when they lie there as in the
        bucket (same storage, same relative offsets, on the group's device); else None."""
        first = parts[0].data
        storage = first.untyped_storage()
        base = first.data_ptr() - parts[0].offset  # the address bucket offset 0 maps to
        for p in parts:
            if (p.data.device != self.device or p.data.data_ptr() - p.offset != base
                    or p.data.untyped_storage().data_ptr() != storage.data_ptr()):
                return None
        start = base + segment.start - storage.data_ptr()
        if start < 0 or start + segment.nbytes > storage.nbytes():
            return None
        return first.as_strided((segment.nbytes,), (1,), start)


def unpack(spec: BucketSpec, data: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Named tensors of one received bucket, as views into ``data`` (a flat uint8 tensor)."""
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError(
            f"bucket data: expected a flat uint8 tensor, got {data.dtype}{tuple(data.shape)}"
        )
    if data.numel() != spec.nbytes:
        raise ValueError(f"bucket data has {data.numel()} bytes but its spec says {spec.nbytes}")
    bucket_dtype = dtype_from_name(spec.dtype)
    out = []
    for t in spec.tensors:
        dtype = dtype_from_name(t.dtype)
        if dtype != bucket_dtype:
            raise ValueError(f"tensor {t.name!r}: dtype={t.dtype} in a {spec.dtype} bucket")
        if t.numel != math.prod(t.shape) or t.offset % ALIGN:
            raise ValueError(f"tensor {t.name!r}: inconsistent spec shape={t.shape} "
                             f"numel={t.numel} offset={t.offset}")
        end = t.offset + t.numel * dtype.itemsize
        if end > spec.nbytes:
            raise ValueError(f"tensor {t.name!r}: bytes [{t.offset}, {end}) exceed the bucket "
                             f"({spec.nbytes} bytes)")
        out.append((t.name, data[t.offset: end].view(dtype).view(t.shape)))
    return out
