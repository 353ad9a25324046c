"""streamrl.buffer: the staleness-bounded replay buffer (DESIGN.md §2, §7).

``base`` holds the protocol and the bound (``Admission``); ``memory`` and ``redis`` are the two
backends; ``make_buffer`` picks one from ``buffer.backend``. The Redis backend (and the redis
client) is imported only when chosen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from streamrl.buffer.base import Admission, BufferStats, ReplayBuffer
from streamrl.buffer.memory import MemoryBuffer

if TYPE_CHECKING:
    from streamrl.config import BufferConfig, Config

__all__ = ["Admission", "BufferStats", "MemoryBuffer", "ReplayBuffer", "make_buffer"]

BACKENDS = ("memory", "redis")


def make_buffer(
    cfg: Config | BufferConfig, groups_per_step: int, max_staleness: int
) -> ReplayBuffer:
    """The buffer ``cfg.buffer.backend`` names, bounded by B=groups_per_step, eta=max_staleness.

    ``max_staleness`` is passed explicitly because the mode decides it (``Config.max_staleness``:
    sync 0, one_step_off 1, fully_async ``buffer.max_staleness``).
    """
    buffer_cfg = getattr(cfg, "buffer", cfg)
    backend = buffer_cfg.backend
    if backend == "memory":
        return MemoryBuffer(groups_per_step, max_staleness)
    if backend == "redis":
        from streamrl.buffer.redis import RedisBuffer

        return RedisBuffer(buffer_cfg.redis_url, buffer_cfg.run, groups_per_step, max_staleness)
    raise ValueError(f"buffer.backend={backend!r}: expected one of {', '.join(BACKENDS)}")
