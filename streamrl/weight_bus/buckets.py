"""Flat weight buckets: pack named tensors lazily into per-dtype byte buffers, unpack as views.

Parts:
- ``BucketPacker.pack(named_tensors)``: consumes the iterator one tensor at a time and yields a
  ``Bucket`` (a ``BucketSpec`` + a flat ``uint8`` tensor) as soon as one is full, so a learner
  that gathers FSDP shards one parameter at a time holds at most the open bucket of each dtype
  plus the buckets still on the wire. Released buffers are reused (double buffering).
- ``unpack(spec, data)``: the named tensors of a received bucket, as views into ``data`` (no copy).
- ``dtype_name`` / ``dtype_from_name``: the dtype strings on the wire (a closed whitelist).

Layout: ``TensorSpec.offset`` is a byte offset into the bucket, aligned to ``ALIGN`` bytes so a
view of any dtype is valid; ``BucketSpec.nbytes`` is the end of the last tensor. This module is
pure torch and depends only on ``streamrl.types``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from streamrl.types import BucketSpec, TensorSpec

ALIGN = 64
"""Byte alignment of every tensor inside a bucket (any dtype view is legal at this offset)."""

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
    buffer: torch.Tensor = field(repr=False)
    """The whole (possibly larger) buffer, handed back to the packer by ``release``."""


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
    A tensor larger than ``bucket_bytes`` travels alone in a bucket of its own size.
    Buffers come from ``pool`` (shared across versions by the publisher).
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
        self.pool.give(bucket.buffer)

    def _buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return self.pool.take(max(self.bucket_bytes, nbytes), device)

    def pack(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[Bucket]:
        """Yield full buckets while consuming ``named_tensors`` one tensor at a time."""
        open_buckets: dict[torch.dtype, _Open] = {}
        seen: set[str] = set()
        for name, tensor in named_tensors:
            tensor = self._check(name, tensor, seen)
            if self.cast_dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(self.cast_dtype)
            nbytes = tensor.numel() * tensor.element_size()
            current = open_buckets.get(tensor.dtype)
            if current is not None and not current.fits(nbytes):
                yield open_buckets.pop(tensor.dtype).close()
                current = None
            if current is None:
                device = self.device or tensor.device
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

    @staticmethod
    def _check(name: object, tensor: object, seen: set[str]) -> torch.Tensor:
        if not isinstance(name, str) or not name:
            raise TypeError(f"weight name={name!r}: must be a non-empty str")
        if name in seen:
            raise ValueError(f"weight name={name!r}: appears twice in one version")
        seen.add(name)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"weight {name!r}: expected a torch.Tensor, got {type(tensor).__name__}"
            )
        if type(tensor).__name__ == "DTensor":
            raise TypeError(
                f"weight {name!r} is a DTensor shard: publish full tensors (call p.full_tensor() "
                "on every FSDP rank and pass the result on rank 0)"
            )
        return tensor.detach()


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
