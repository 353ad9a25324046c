"""Rollout-fleet test support: a list-backed buffer, the toy scorer, and a bounded wait."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from streamrl.buffer.base import BufferStats, ReplayBuffer
from streamrl.data.toy import toy_reward
from streamrl.types import Group


class ListBuffer(ReplayBuffer):
    """At most ``capacity`` admissions; put groups land in a list."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.started = 0
        self.given_back = 0
        self.groups: list[Group] = []
        self.version = 0

    def try_admit(self, holder: str = "") -> bool:
        if self.started >= self.capacity:
            return False
        self.started += 1
        return True

    def cancel_admission(self, holder: str = "") -> None:
        self.started -= 1
        self.given_back += 1

    def release(self, holder: str) -> int:
        raise NotImplementedError("not used by replicas")

    def put(self, group: Group, holder: str = "") -> None:
        self.groups.append(group)

    def take(self, n: int, learner_version: int, timeout: float | None = None) -> list[Group]:
        taken, self.groups = self.groups[:n], self.groups[n:]
        return taken

    def ack(self, group_ids: list[str]) -> None:
        pass

    def set_version(self, learner_version: int) -> None:
        self.version = learner_version

    def rebase(self, learner_version: int, consumed: int, skip_ids: Iterable[str] = (),
               in_flight: int = 0) -> None:
        raise NotImplementedError("not used by replicas")

    def stats(self) -> BufferStats:
        return BufferStats(learner_version=self.version, produced=len(self.groups),
                           queued=len(self.groups), started=self.started,
                           in_flight=self.started - len(self.groups))


class ToyScorer:
    """The toy task's reward as a plain coroutine; ``fail_first`` calls raise."""

    def __init__(self, fail_first: int = 0) -> None:
        self.calls = 0
        self.fail_first = fail_first

    async def score(self, data_source: str, solution_str: str, ground_truth: str | None,
                    extra_info: dict[str, Any]) -> float:
        self.calls += 1
        if self.calls <= self.fail_first:
            raise RuntimeError("reward function bug")
        return toy_reward(extra_info["task"], solution_str, str(ground_truth),
                          extra_info["max_new_tokens"])


async def wait_until(predicate, timeout: float = 120.0, what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)
