"""In-process replay buffer: the embedded default backend (``buffer.backend=memory``).

Parts: ``MemoryBuffer`` keeps a min-heap of queued groups keyed by (oldest policy version,
arrival order), the admission counters of ``base.Admission``, and the taken-but-unacked groups.
One ``threading.Condition`` guards all of it: replicas on other threads call ``try_admit`` /
``put``; the learner's ``take`` waits on the condition until enough fresh groups are queued.

asyncio: ``try_admit``, ``admit_up_to``, ``cancel_admission``, ``put``, ``put_and_admit``, ``ack``,
``set_version`` and ``stats`` only take the lock briefly and may be called from a coroutine
directly; ``take`` blocks, so call it as ``await asyncio.to_thread(buffer.take, n, version,
timeout)``.

``take`` drops groups staler than the bound (the heap's top) and refuses groups with a token
newer than the learner (``base.newer_than_learner``), scanning the heap only when one is queued.

Oldest first means lowest oldest-policy-version first: a slow group started under old weights
is trained before it would go stale, instead of being overtaken by younger groups and dropped.

Holders need no lease here (unlike Redis): the buffer lives and dies with its process, so each
holder is in this process (``streamrl serve``'s episodes) or a replica actor whose death the
supervisor sees and ``release``s (``remote.RemoteBuffer``); ``rebase`` keeps what every holder
holds.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import deque
from typing import NamedTuple

from streamrl.buffer.base import (
    Admission,
    BufferStats,
    Refusals,
    ReplayBuffer,
    expect_group,
    newer_than_learner,
)
from streamrl.types import Group

log = logging.getLogger(__name__)
SEEN_KEEP = 1 << 16
"""Group ids ``put`` remembers to stay idempotent: the most recent ones. A repeated put is a
retry of a call seconds old, and replicas hold at most (eta + 1) * B groups between two steps,
so this is thousands of steps of margin; unbounded, the set grew by one id per group for the
whole run."""


class _Queued(NamedTuple):
    """A heap entry: ordered by (key, arrival); arrival is unique, so groups are never compared."""

    key: int
    """The group's oldest policy version (the learner version at put when it has none)."""
    arrival: int
    group: Group
    holder: str
    newest: int
    """``group.max_version`` (-1 when it has none), computed once at put."""


class MemoryBuffer(ReplayBuffer):
    def __init__(self, groups_per_step: int, max_staleness: int) -> None:
        self.admission = Admission(groups_per_step, max_staleness)
        self._cond = threading.Condition()
        self._heap: list[_Queued] = []
        self._arrival = itertools.count()
        self._seen: set[str] = set()  # the last SEEN_KEEP group ids put: makes put idempotent
        self._seen_order: deque[str] = deque()  # the same ids, oldest first
        self._taken: dict[str, _Queued] = {}  # taken, not acked
        # Newest version among queued groups (-1: none): take scans the heap for groups newer
        # than the learner only when this says one is there.
        self._newest_queued = -1
        self._version = 0
        self._started = 0
        self._in_flight = 0
        self._held: dict[str, int] = {}  # admissions in flight per holder
        self._produced = 0
        self._consumed = 0
        self._dropped = 0
        self._refused = Refusals(log, "memory buffer")
        self._staleness_sum = 0  # over groups taken by this process (rebase keeps it)
        self._staleness_count = 0
        self._staleness_max = 0
        self._last_update_ts = time.time()

    # -- replicas -------------------------------------------------------------------------
    def try_admit(self, holder: str = "") -> bool:
        return self.admit_up_to(1, holder) == 1

    def admit_up_to(self, n: int, holder: str = "") -> int:
        with self._cond:
            claimed = min(n, self.admission.slots_left(self._started, self._version))
            if claimed > 0:
                self._started += claimed
                self._in_flight += claimed
                self._held[holder] = self._held.get(holder, 0) + claimed
                self._touch()
            return max(0, claimed)

    def cancel_admission(self, holder: str = "") -> None:
        with self._cond:
            if not self._settle(holder):
                raise ValueError("cancel_admission: no admitted group is in flight"
                                 + (f" for holder {holder}" if holder else ""))
            self._started -= 1
            self._touch()
            self._cond.notify_all()

    def release(self, holder: str) -> int:
        with self._cond:
            held = self._held.pop(holder, 0)
            self._in_flight -= held
            self._started -= held
            self._touch()
            self._cond.notify_all()
            return held

    def _settle(self, holder: str) -> bool:
        """Retire one of ``holder``'s admissions; False if it holds none (released, or a put
        that was never admitted)."""
        if self._held.get(holder, 0) <= 0:
            return False
        self._held[holder] -= 1
        if not self._held[holder]:
            del self._held[holder]
        self._in_flight -= 1
        return True

    def put(self, group: Group, holder: str = "") -> None:
        expect_group(group)
        with self._cond:
            if group.group_id in self._seen:
                return
            self._remember(group.group_id)
            if not self._settle(holder):
                # A put without an admission (e.g. an externally closed episode) still takes a
                # slot, so started == consumed + queued + in_flight keeps holding.
                self._started += 1
            self._produced += 1
            oldest, newest = group.min_version, group.max_version
            key = self._version if oldest is None else oldest
            entry = _Queued(key, next(self._arrival), group, holder,
                            -1 if newest is None else newest)
            heapq.heappush(self._heap, entry)
            self._newest_queued = max(self._newest_queued, entry.newest)
            self._touch()
            self._cond.notify_all()

    def put_and_admit(self, group: Group, holder: str = "") -> bool:
        with self._cond:  # both under one lock hold (a reentrant lock)
            self.put(group, holder)
            return self.try_admit(holder)

    # -- learner --------------------------------------------------------------------------
    def take(self, n: int, learner_version: int, timeout: float | None = None) -> list[Group]:
        if n <= 0:
            raise ValueError(f"take: n={n} must be > 0")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if learner_version > self._version:
                self._version = learner_version
            while True:
                self._drop_stale(learner_version)
                self._refuse_newer(learner_version)
                if len(self._heap) >= n:
                    return self._pop(n, learner_version)
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"take: {n} groups wanted, {len(self._heap)} queued, "
                        f"{self._in_flight} in flight after {timeout} s"
                    )
                self._cond.wait(remaining)

    def _drop_stale(self, learner_version: int) -> None:
        # The heap is ordered by oldest version, so stale groups sit at its top.
        while self._heap and not self.admission.is_fresh(self._heap[0][2], learner_version):
            heapq.heappop(self._heap)
            self._dropped += 1
            self._started -= 1  # give the slot back: a replica may start a replacement
            self._touch()

    def _refuse_newer(self, learner_version: int) -> None:
        if self._newest_queued <= learner_version:  # nothing to refuse: no scan
            return
        kept = []
        for entry in self._heap:
            reason = newer_than_learner(entry.group, entry.newest, learner_version, entry.holder)
            if reason is None:
                kept.append(entry)
                continue
            self._refused.note(entry.holder, reason)
            self._started -= 1  # give the slot back: a replica may start a replacement
        heapq.heapify(kept)
        self._heap = kept
        self._newest_queued = max((e.newest for e in kept), default=-1)
        self._touch()

    def _pop(self, n: int, learner_version: int) -> list[Group]:
        entries = [heapq.heappop(self._heap) for _ in range(n)]
        groups = [entry[2] for entry in entries]
        for entry in entries:
            group = entry[2]
            staleness = group.staleness(learner_version)
            self._staleness_sum += staleness
            self._staleness_count += 1
            self._staleness_max = max(self._staleness_max, staleness)
            self._taken[group.group_id] = entry
        self._consumed += n
        self._touch()
        return groups

    def ack(self, group_ids: list[str]) -> None:
        with self._cond:
            unknown = [gid for gid in group_ids if gid not in self._taken]
            if unknown:
                raise ValueError(f"ack: group ids not taken or already acked: {unknown}")
            for gid in group_ids:
                del self._taken[gid]

    def set_version(self, learner_version: int) -> None:
        with self._cond:
            if learner_version < self._version:
                raise ValueError(
                    f"set_version: learner_version={learner_version} < current {self._version} "
                    "(use rebase to restart from an older checkpoint)"
                )
            self._version = learner_version
            self._touch()
            self._cond.notify_all()

    def _rebase(self, learner_version: int, consumed: int, skip: set[str]) -> None:
        with self._cond:
            # Taken but not acked and not recorded as trained: deliver again.
            self._heap += [e for gid, e in self._taken.items() if gid not in skip]
            self._taken.clear()
            self._heap = [entry for entry in self._heap if entry[2].group_id not in skip]
            heapq.heapify(self._heap)  # entries keep their arrival order
            # Groups taken at a version the learner no longer reached: take refuses them.
            self._newest_queued = max((e.newest for e in self._heap), default=-1)
            for gid in skip - self._seen:
                self._remember(gid)
            self._version = learner_version
            self._consumed = consumed
            # Every holder is alive: in this process (streamrl serve's episodes), or a replica
            # the supervisor releases when it dies. So no lease (unlike Redis): rebase keeps
            # what each holds, and its put or cancel settles it as before.
            self._started = consumed + len(self._heap) + self._in_flight
            self._touch()
            self._cond.notify_all()

    def stats(self) -> BufferStats:
        with self._cond:
            return BufferStats(
                learner_version=self._version,
                produced=self._produced,
                consumed=self._consumed,
                queued=len(self._heap),
                started=self._started,
                in_flight=self._in_flight,
                dropped=self._dropped,
                refused=self._refused.count,
                malformed=0,
                staleness_mean=self._staleness_sum / max(1, self._staleness_count),
                staleness_max=self._staleness_max,
                last_update_ts=self._last_update_ts,
            )

    def _remember(self, group_id: str) -> None:
        self._seen.add(group_id)
        self._seen_order.append(group_id)
        if len(self._seen_order) > SEEN_KEEP:
            self._seen.discard(self._seen_order.popleft())

    def _touch(self) -> None:
        self._last_update_ts = time.time()
