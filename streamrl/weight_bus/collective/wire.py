"""The data-plane wire format of one version on a formed weight group.

Parts:
- ``send_buckets`` (rank 0) / ``recv_buckets`` (every other rank). Per bucket three broadcasts
  from rank 0: a header ``int64[2] = (spec bytes, data bytes)``, the msgpack ``BucketSpec``, the
  flat data; a ``(0, 0)`` header ends the version. The sender keeps one bucket on the wire while
  the next is packed (double buffering: two pooled buffers); the receiver posts the next header
  before the current data lands and unpacks to views.
- ``manifest_of``: the ``WeightManifest`` both sides assemble from the specs they sent or got
  (the publisher compares the receivers' with its own).
- ``Check``: the poll every bounded wait runs (raises to give the wait up).

Dependencies: ``groups`` (the group and its pending broadcasts), ``buckets`` (packing), ``types``.
The publisher and receiver import this module; it imports neither.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator

import torch

from streamrl.types import BucketSpec, WeightManifest, decode, encode
from streamrl.weight_bus.buckets import Bucket, BufferPool, unpack
from streamrl.weight_bus.groups import Pending, WeightGroup

Check = Callable[[], None]


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
