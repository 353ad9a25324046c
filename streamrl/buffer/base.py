"""The replay-buffer seam and the staleness bound (DESIGN.md §2).

Parts: ``Admission`` (the one named place of the staleness bound, pure arithmetic over the
learner version), ``newer_than_learner`` (its other side: no negative staleness),
``BufferStats``, the protocol in two sides: ``BufferProducer`` (what replicas and
``streamrl serve`` call: admit, put, cancel) and ``BufferConsumer`` (what the driver calls: take,
ack, set_version, rebase, release, stats), ``ReplayBuffer`` (both: what a backend implements),
``HeldBuffer`` (a producer bound to one holder), ``expect_group`` (what every put checks) and
``PerLoop`` (the per-event-loop senders of backends that batch a loop's calls). Backends:
``memory.MemoryBuffer`` (in-process), ``remote.RemoteBuffer`` (it, in a Ray actor) and
``redis.RedisBuffer``.

Let B = groups per training step, eta = max staleness, V = learner version. A replica may
*start* a group only while ``started < (V + eta + 1) * B``: admission control bounds staleness
without dropping slow rollouts, as long as the learner takes groups in about the order they
were started. ``take`` additionally never returns a group older than eta; such a group is
dropped and its admission slot returned, so admission never deadlocks. Nor does it return a
group with a token newer than V: such a group is refused (logged with who put it, counted,
slot returned). A group still in flight while the learner takes newer ones (a slow group, or
one whose replica waited for its turn to swap while another sampled) can age past eta: the
bound limits how many groups are out, not the order they are taken in.

Accounting every backend keeps (checked by tests/buffer/test_admission_property.py)::

    started  == consumed + queued + in_flight      # every admitted slot is somewhere
    consumed == V * B  when the learner takes B groups per step
    => capacity(V) - consumed == (eta + 1) * B >= B  # the learner can always be served

Lifecycle: ``try_admit`` -> (replica samples) -> ``put`` | ``cancel_admission``; the learner
``take``s, trains, checkpoints (recording the taken group ids), then ``ack``s. A replica that will
start another group puts with ``put_and_admit``: the put and the next group's ``try_admit`` in
one call (one round trip with Redis), the claimed slot used by its next group. On resume from a
checkpoint, ``rebase`` restarts the counters consistent with the restored learner version,
keeping the admissions of holders that are still alive (``streamrl serve``'s open episodes).

Holders: every admission is counted under the holder that claimed it (a replica incarnation,
``HeldBuffer`` binds one; ``streamrl serve`` admits as ""), so when a replica dies its supervisor
``release``s exactly the slots that replica held. A put from a holder that holds nothing
(released, or never admitted) takes a fresh slot, so a late put from a replica declared dead
keeps the accounting exact too. A holder in another process that no supervisor watches (a
``streamrl serve`` sharing a Redis run) holds its slots as a lease its buffer client renews:
when the process dies, the lease expires and its slots are reclaimed (``redis`` package).
"""

from __future__ import annotations

import abc
import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from streamrl.types import Group

log = logging.getLogger(__name__)

T = TypeVar("T")


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

    def slots_left(self, started: int, learner_version: int) -> int:
        """How many more groups replicas may start now (0 when the bound is reached)."""
        return max(0, self.capacity(learner_version) - started)

    def is_fresh(self, group: Group, learner_version: int) -> bool:
        return group.staleness(learner_version) <= self.max_staleness


def newer_than_learner(group: Group, newest: int | None, learner_version: int,
                       holder: str) -> str | None:
    """Why ``group`` must be refused at ``learner_version``, or None: a policy token stamped
    with a version the learner has not reached (negative staleness). ``newest``: the group's
    ``max_version``, computed once by the caller; ``holder``: who put it ("" when unknown).

    Checked at take time, against the version the learner passes: a replica may put a group
    of version V+1 before ``set_version(V+1)`` reaches the buffer, but never before the
    learner reached V+1. Such a group comes from weights of a run the learner no longer
    continues (replicas that kept version 12 while the learner resumed from step 10's
    checkpoint, or entries of that run still queued) or from a corrupt stamp."""
    if newest is None or newest <= learner_version:
        return None
    return (f"group {group.group_id} (prompt {group.prompt_index}, put by "
            f"{holder or 'an unnamed holder'}) has policy versions {group.min_version}.."
            f"{newest}, newer than learner version {learner_version} (negative staleness): "
            "refused")


def expect_group(group: object) -> Group:
    """``group``, checked before a put records or encodes it."""
    if not isinstance(group, Group):
        raise TypeError(f"put: expected a Group, got {type(group).__name__}")
    return group


class Refusals:
    """Counts the groups a buffer refuses and logs them without flooding: a replica that kept
    newer weights refuses group after group until it loads the learner's, so each holder's
    first refusal is logged, then every ``LOG_EVERY``-th with the running count."""

    LOG_EVERY = 100

    def __init__(self, logger: logging.Logger, prefix: str) -> None:
        self.count = 0
        self._logger = logger
        self._prefix = prefix
        self._holders: set[str] = set()

    def note(self, holder: str, reason: str) -> None:
        self.count += 1
        if holder not in self._holders or self.count % self.LOG_EVERY == 0:
            self._holders.add(holder)
            self._logger.warning("%s: %s (%d refused by this process)", self._prefix, reason,
                                 self.count)


@dataclass(frozen=True)
class BufferStats:
    learner_version: int = 0
    produced: int = 0
    consumed: int = 0
    queued: int = 0
    started: int = 0
    """Admission slots held: consumed + queued + in_flight (the bound compares this)."""
    in_flight: int = 0
    """Groups admitted (started) but not yet put."""
    dropped: int = 0
    """Groups found older than the bound at take time: overtaken while in flight (see the
    module docstring)."""
    refused: int = 0
    """Groups refused at take time for a version newer than the learner's
    (``newer_than_learner``); their slots are given back."""
    malformed: int = 0
    reclaimed: int = 0
    """Admission slots given back because their holder's lease expired (its process died
    without putting or cancelling; Redis)."""
    staleness_mean: float = 0.0
    staleness_max: int = 0
    last_update_ts: float = 0.0


class BufferProducer(abc.ABC):
    """The producer side, what rollout replicas and ``streamrl serve`` call: claim a slot
    (admission), then put the group started on it or give the slot back."""

    @abc.abstractmethod
    def try_admit(self, holder: str = "") -> bool:
        """Atomically claim the right to start one group; False when the bound is reached."""

    def atry_admit(self, holder: str = "") -> Awaitable[bool]:
        """``try_admit`` for an event loop that must not block (``streamrl serve`` admits every
        new episode): a thread by default; backends with an async client await it instead.

        A plain method returning an awaitable, never ``async def``: Ray makes any actor class
        with a coroutine method an async actor, whose sync methods then run one at a time on
        its event loop, so ``BufferActor``'s blocking ``take`` would stall every ``put`` (it
        did: ~1 group/s, 35 s steps)."""
        return asyncio.to_thread(self.try_admit, holder)

    def admit_up_to(self, n: int, holder: str = "") -> int:
        """Claim up to ``n`` slots at once (a replica refilling its free slots in one round
        trip); how many were claimed, 0 when the bound is reached. By default one
        ``try_admit`` per slot."""
        claimed = 0
        while claimed < n and self.try_admit(holder):
            claimed += 1
        return claimed

    def aadmit_up_to(self, n: int, holder: str = "") -> Awaitable[int]:
        """``admit_up_to`` for an event loop (a thread by default, like ``atry_admit``)."""
        return asyncio.to_thread(self.admit_up_to, n, holder)

    @abc.abstractmethod
    def cancel_admission(self, holder: str = "") -> None:
        """Give back a claimed slot whose group will never be put (failed or aborted)."""

    def acancel_admission(self, holder: str = "") -> Awaitable[None]:
        """``cancel_admission`` for an event loop (a replica's); the call is under way when
        this returns, so a caller cancelled while awaiting it still gives the slot back."""
        return asyncio.ensure_future(asyncio.to_thread(self.cancel_admission, holder))

    @abc.abstractmethod
    def put(self, group: Group, holder: str = "") -> None:
        """Add a finished group (idempotent on group_id); settles one of ``holder``'s slots."""

    def aput(self, group: Group, holder: str = "") -> Awaitable[None]:
        """``put`` for an event loop; like ``acancel_admission``, under way when it returns."""
        return asyncio.ensure_future(asyncio.to_thread(self.put, group, holder))

    def put_and_admit(self, group: Group, holder: str = "") -> bool:
        """``put``, then claim a slot for ``holder``'s next group as ``try_admit`` would; True
        when claimed (the caller then starts a group without calling ``try_admit``, or gives the
        slot back). Backends may do both in one round trip (Redis: one script).

        The put is what the caller must know happened: raised errors are the put's. When only
        the claim fails after the put is recorded, this logs it and returns False (no slot is
        held; the caller's next ``try_admit`` meets the error again)."""
        self.put(group, holder)
        try:
            return self.try_admit(holder)
        except Exception:
            log.warning("put_and_admit: group %s was put; claiming the next slot failed",
                        group.group_id, exc_info=True)
            return False

    def aput_and_admit(self, group: Group, holder: str = "") -> Awaitable[bool]:
        """``put_and_admit`` for an event loop; under way when it returns, like ``aput``."""
        return asyncio.ensure_future(asyncio.to_thread(self.put_and_admit, group, holder))


class BufferConsumer(abc.ABC):
    """The consumer side, what the driver calls: the controller takes, acks, publishes the
    learner version and rebases on resume; the supervisor releases a dead replica's slots."""

    @abc.abstractmethod
    def take(self, n: int, learner_version: int, timeout: float | None = None) -> list[Group]:
        """Block until ``n`` groups no older than the bound are available; oldest first.

        Groups staler than eta at ``learner_version`` are dropped (counted, slot returned);
        groups newer than it are refused (``newer_than_learner``: logged, counted, slot
        returned). ``learner_version`` is also published if newer. Raises ``TimeoutError`` after
        ``timeout`` seconds (``None``: wait forever; ``0``: do not wait).
        """

    @abc.abstractmethod
    def ack(self, group_ids: list[str]) -> None:
        """Mark taken groups as trained (after the update; with Redis, after the checkpoint).

        Raises ``ValueError`` for ids that were not taken from this buffer or were acked already.
        """

    @abc.abstractmethod
    def set_version(self, learner_version: int) -> None:
        """Publish the learner version: opens admission for the next step's groups.

        Versions only move forward (``ValueError`` otherwise); use ``rebase`` to go back.
        """

    def rebase(self, learner_version: int, consumed: int, skip_ids: Iterable[str] = ()) -> None:
        """Restart the counters after restoring a checkpoint taken at ``learner_version``.

        ``consumed``: groups trained up to that checkpoint (normally ``learner_version * B``).
        Taken-but-unacked groups go back to the queue, except ``skip_ids`` (already trained,
        recorded in the checkpoint), which are acked and never delivered again. Admissions of
        live holders stay theirs (a ``streamrl serve`` that outlived the trainer keeps its open
        groups; their puts and cancels settle them as before); those of holders that are gone
        are dropped (Redis: holders whose lease expired; in memory every holder lives in this
        process, or is released by the supervisor when its replica dies). Afterwards
        ``started = consumed + queued + in_flight``, so the bound holds and the learner can be
        served.
        """
        if learner_version < 0 or consumed < 0:
            raise ValueError(f"rebase: learner_version={learner_version}, consumed={consumed} "
                             "must both be >= 0")
        self._rebase(learner_version, consumed, set(skip_ids))

    @abc.abstractmethod
    def _rebase(self, learner_version: int, consumed: int, skip_ids: set[str]) -> None:
        """The backend's ``rebase``, its arguments checked."""

    @abc.abstractmethod
    def release(self, holder: str) -> int:
        """Give back every slot ``holder`` still holds (it died); returns how many."""

    @abc.abstractmethod
    def stats(self) -> BufferStats: ...

    def close(self) -> None:  # noqa: B027 - optional
        """Release connections."""


class ReplayBuffer(BufferProducer, BufferConsumer):
    """Both sides of one buffer: what a backend implements and ``make_buffer`` returns.
    Groups flow put -> take -> ack; admission decides when a replica may start one."""


class HeldBuffer(BufferProducer):
    """``buffer`` with every admission, cancel and put made under one holder (a replica)."""

    def __init__(self, buffer: BufferProducer, holder: str) -> None:
        self.buffer = buffer
        self.holder = holder

    def try_admit(self, holder: str = "") -> bool:
        return self.buffer.try_admit(holder or self.holder)

    def atry_admit(self, holder: str = "") -> Awaitable[bool]:
        return self.buffer.atry_admit(holder or self.holder)

    def admit_up_to(self, n: int, holder: str = "") -> int:
        return self.buffer.admit_up_to(n, holder or self.holder)

    def aadmit_up_to(self, n: int, holder: str = "") -> Awaitable[int]:
        return self.buffer.aadmit_up_to(n, holder or self.holder)

    def cancel_admission(self, holder: str = "") -> None:
        self.buffer.cancel_admission(holder or self.holder)

    def acancel_admission(self, holder: str = "") -> Awaitable[None]:
        return self.buffer.acancel_admission(holder or self.holder)

    def put(self, group: Group, holder: str = "") -> None:
        self.buffer.put(group, holder or self.holder)

    def aput(self, group: Group, holder: str = "") -> Awaitable[None]:
        return self.buffer.aput(group, holder or self.holder)

    def put_and_admit(self, group: Group, holder: str = "") -> bool:
        return self.buffer.put_and_admit(group, holder or self.holder)

    def aput_and_admit(self, group: Group, holder: str = "") -> Awaitable[bool]:
        return self.buffer.aput_and_admit(group, holder or self.holder)


class PerLoop(Generic[T]):
    """One ``T`` per event loop, made on its first use there (any thread). Loops closed since
    are dropped then: ``asyncio.run`` per call (tests, scripts) leaves one behind each time."""

    def __init__(self, make: Callable[[asyncio.AbstractEventLoop], T]) -> None:
        self._make = make
        self._items: dict[asyncio.AbstractEventLoop, T] = {}
        self._lock = threading.Lock()

    def get(self) -> T:
        """The running loop's ``T``."""
        loop = asyncio.get_running_loop()
        with self._lock:
            item = self._items.get(loop)
            if item is None:
                for old in [old for old in self._items if old.is_closed()]:
                    del self._items[old]
                item = self._items[loop] = self._make(loop)
            return item

    def pop(self) -> T | None:
        """Forget the running loop's ``T``; it, or None if the loop had none."""
        with self._lock:
            return self._items.pop(asyncio.get_running_loop(), None)

    def take_all(self) -> list[tuple[asyncio.AbstractEventLoop, T]]:
        """Forget every loop's ``T``; them, with their loops."""
        with self._lock:
            items, self._items = list(self._items.items()), {}
        return items
