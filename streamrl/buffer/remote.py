"""The memory buffer shared across processes: hosted in a threaded Ray actor.

- ``start_buffer_actor(cfg)``: the actor holding one ``MemoryBuffer`` (bounded by the config),
- ``RemoteBuffer``: the ReplayBuffer protocol over that actor's handle; picklable, so the same
  object is handed to every replica.

Replicas ``put`` while the learner blocks in ``take``, so the actor runs methods concurrently
(``max_concurrency``); ``MemoryBuffer``'s lock keeps them atomic. The Redis backend needs no
actor: every process connects to Redis itself. Depends on base and memory.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

import ray

from streamrl.buffer.base import BufferStats, ReplayBuffer
from streamrl.buffer.memory import MemoryBuffer
from streamrl.types import Group

if TYPE_CHECKING:
    from streamrl.config import Config

ACTOR_CONCURRENCY = 64


class BufferActor(MemoryBuffer):
    """The memory backend in a threaded actor (replicas put while the learner takes)."""

    def shutdown(self) -> None:
        self.close()


def start_buffer_actor(cfg: Config) -> Any:
    """Start the actor holding the run's memory buffer; returns its handle."""
    actor_cls = ray.remote(num_cpus=0, max_concurrency=ACTOR_CONCURRENCY)(BufferActor)
    return actor_cls.remote(cfg.task.train_batch_size, cfg.buffer.max_staleness)


class RemoteBuffer(ReplayBuffer):
    """A ReplayBuffer whose state lives in the buffer actor shared by all processes."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def try_admit(self, holder: str = "") -> bool:
        return bool(ray.get(self.handle.try_admit.remote(holder)))

    def atry_admit(self, holder: str = "") -> Awaitable[bool]:
        # The ObjectRef itself, awaited on the caller's loop: no thread per call.
        return self.handle.try_admit.remote(holder)

    def cancel_admission(self, holder: str = "") -> None:
        ray.get(self.handle.cancel_admission.remote(holder))

    def acancel_admission(self, holder: str = "") -> Awaitable[None]:
        return self.handle.cancel_admission.remote(holder)  # submitted now, like aput

    def put(self, group: Group, holder: str = "") -> None:
        ray.get(self.handle.put.remote(group, holder))

    def aput(self, group: Group, holder: str = "") -> Awaitable[None]:
        return self.handle.put.remote(group, holder)

    def put_and_admit(self, group: Group, holder: str = "") -> bool:
        return bool(ray.get(self.handle.put_and_admit.remote(group, holder)))

    def aput_and_admit(self, group: Group, holder: str = "") -> Awaitable[bool]:
        return self.handle.put_and_admit.remote(group, holder)  # one actor call for both

    def release(self, holder: str) -> int:
        return int(ray.get(self.handle.release.remote(holder)))

    def take(self, n: int, learner_version: int, timeout: float | None = None) -> list[Group]:
        return list(ray.get(self.handle.take.remote(n, learner_version, timeout)))

    def ack(self, group_ids: list[str]) -> None:
        ray.get(self.handle.ack.remote(group_ids))

    def set_version(self, learner_version: int) -> None:
        ray.get(self.handle.set_version.remote(learner_version))

    def rebase(self, learner_version: int, consumed: int, skip_ids: Any = (),
               in_flight: int = 0) -> None:
        ray.get(self.handle.rebase.remote(learner_version, consumed, list(skip_ids), in_flight))

    def stats(self) -> BufferStats:
        return ray.get(self.handle.stats.remote())
