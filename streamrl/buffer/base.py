"""The replay-buffer seam and the staleness bound (DESIGN.md §2).

Parts: ``Admission`` (the one named place of the staleness bound, pure arithmetic over the
learner version), ``BufferStats``, and ``ReplayBuffer`` (the protocol replicas and the
controller use). Backends: ``memory.MemoryBuffer`` (in-process) and ``redis.RedisBuffer``.

Let B = groups per training step, eta = max staleness, V = learner version. A replica may
*start* a group only while ``started < (V + eta + 1) * B``: admission control bounds staleness
without dropping slow rollouts. ``take`` additionally never returns a group older than eta.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from streamrl.types import Group


@dataclass(frozen=True)
class Admission:
    """The staleness bound: how many groups may have been started by learner version V."""

    groups_per_step: int
    max_staleness: int

    def __post_init__(self) -> None:
        if self.groups_per_step <= 0:
            raise ValueError(f"groups_per_step={self.groups_per_step}: must be > 0")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness={self.max_staleness}: must be >= 0")

    def capacity(self, learner_version: int) -> int:
        return (learner_version + self.max_staleness + 1) * self.groups_per_step

    def may_start(self, started: int, learner_version: int) -> bool:
        return started < self.capacity(learner_version)

    def is_fresh(self, group: Group, learner_version: int) -> bool:
        return group.staleness(learner_version) <= self.max_staleness


@dataclass(frozen=True)
class BufferStats:
    learner_version: int = 0
    produced: int = 0
    consumed: int = 0
    queued: int = 0
    in_flight: int = 0
    """Groups admitted (started) but not yet put."""
    dropped: int = 0
    """Groups found older than the bound at take time (should stay 0 under admission)."""
    malformed: int = 0
    staleness_mean: float = 0.0
    staleness_max: int = 0
    last_update_ts: float = 0.0


class ReplayBuffer(abc.ABC):
    """Groups flow put -> take -> ack; admission decides when a replica may start one."""

    @abc.abstractmethod
    def try_admit(self) -> bool:
        """Atomically claim the right to start one group; False when the bound is reached."""

    @abc.abstractmethod
    def cancel_admission(self) -> None:
        """Give back a claimed slot whose group will never be put (failed or aborted)."""

    @abc.abstractmethod
    def put(self, group: Group) -> None:
        """Add a finished group (idempotent on group_id)."""

    @abc.abstractmethod
    def take(self, n: int, learner_version: int, timeout: float | None = None) -> list[Group]:
        """Block until ``n`` groups no older than the bound are available; oldest first."""

    @abc.abstractmethod
    def ack(self, group_ids: list[str]) -> None:
        """Mark taken groups as trained (after the update; with Redis, after the checkpoint)."""

    @abc.abstractmethod
    def set_version(self, learner_version: int) -> None:
        """Publish the learner version: opens admission for the next step's groups."""

    @abc.abstractmethod
    def stats(self) -> BufferStats: ...

    def close(self) -> None:  # noqa: B027 - optional
        """Release connections."""
