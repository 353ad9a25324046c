"""streamrl.buffer: the staleness-bounded replay buffer (DESIGN.md §2, §7).

``base`` holds the protocol and the bound (``Admission``): ``BufferProducer`` (the side
replicas and ``streamrl serve`` use), ``BufferConsumer`` (the driver's side) and
``ReplayBuffer`` (both); ``memory`` and ``redis`` (a package) are the two backends;
``make_buffer(cfg)`` builds this process's buffer from ``buffer.backend``; ``remote`` shares a
memory buffer across processes (a Ray actor). The Redis backend (and the redis client) is
imported only when chosen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from streamrl.buffer.base import (
    Admission,
    BufferConsumer,
    BufferProducer,
    BufferStats,
    ReplayBuffer,
)
from streamrl.buffer.memory import MemoryBuffer

if TYPE_CHECKING:
    from streamrl.config import Config

__all__ = ["Admission", "BufferConsumer", "BufferProducer", "BufferStats", "MemoryBuffer",
           "ReplayBuffer", "make_buffer"]

BACKENDS = ("memory", "redis")


def make_buffer(cfg: Config) -> ReplayBuffer:
    """This process's buffer of the backend ``buffer.backend`` names, bounded by
    B=``task.train_batch_size`` and eta=``buffer.max_staleness`` (fixed by the mode)."""
    backend = cfg.buffer.backend
    groups_per_step, max_staleness = cfg.task.train_batch_size, cfg.buffer.max_staleness
    if backend == "memory":
        return MemoryBuffer(groups_per_step, max_staleness)
    if backend == "redis":
        from streamrl.buffer.redis import RedisBuffer

        return RedisBuffer(cfg.buffer.redis_url, cfg.buffer.run, groups_per_step, max_staleness,
                           outage_s=cfg.buffer.redis_outage_s,
                           lease_ttl_s=cfg.buffer.lease_ttl_s)
    raise ValueError(f"buffer.backend={backend!r}: expected one of {', '.join(BACKENDS)}")
