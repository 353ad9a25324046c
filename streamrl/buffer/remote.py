"""The memory buffer shared across processes: hosted in a threaded Ray actor.

- ``start_buffer_actor(cfg)``: the actor holding one ``MemoryBuffer`` (bounded by the config),
- ``RemoteBuffer``: the ReplayBuffer protocol over that actor's handle; picklable, so the same
  object is handed to every replica.

Replicas ``put`` while the learner blocks in ``take``, so the actor runs methods concurrently
(``max_concurrency``); ``MemoryBuffer``'s lock keeps them atomic. A replica's groups finish in
bursts, and an actor call costs both processes about a millisecond of CPU, so an event loop's
``aput`` / ``aput_and_admit`` calls share actor calls: one is in flight at a time, and those made
meanwhile go out together in the next (``_Putter``; Redis pipelines its puts likewise). Groups
cross the process boundary as msgspec bytes (``types.encode``, as Redis stores them), never
pickled: a put is encoded by its caller and decoded in the actor, a take the other way round.
The Redis backend needs no actor: every process connects to Redis itself. Depends on base and
memory.

Recovery (kill -9 of the actor): the buffer holds only generated groups, so the run re-creates
it instead of stopping. Each incarnation is a named actor, ``<name>.<k>`` (Ray keeps a dead
actor's name taken). The driver's ``RemoteBuffer`` (given ``recreate``) starts incarnation k+1
at the learner version and consumed count it has seen, so the bound holds from its first call;
every other process's copy re-resolves the next name when a call meets the dead actor, within
``REATTACH_TIMEOUT_S``, and retries. Queued groups and the dead actor's admission counts are
lost: a re-created actor takes a put from a holder that holds no slot on it only within the
bound (else drops it, counted) and ignores its cancels, so no slot leaks and nothing older than
eta is ever taken.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import RayActorError

from streamrl.buffer.base import BufferStats, PerLoop, ReplayBuffer, expect_group
from streamrl.buffer.memory import MemoryBuffer
from streamrl.types import Group, decode, encode

if TYPE_CHECKING:
    from streamrl.config import Config

log = logging.getLogger(__name__)
ACTOR_CONCURRENCY = 64
PUT_BATCH = 64  # puts per actor call at most
REATTACH_TIMEOUT_S = 60.0
"""How long a process waits for the driver to register the next buffer actor."""

Put = tuple[bytes, str, bool]  # (encoded group, holder, claim the holder's next slot)


class BufferActor(MemoryBuffer):
    """The memory backend in a threaded actor (replicas put while the learner takes); its
    callers' groups come and go encoded (``put_many``, ``take_encoded``).

    ``version``, ``consumed``: where a re-created actor starts (``recovered``): there, a put
    from a holder holding no slot here (admitted by the dead actor) is taken only within the
    bound, else dropped and counted (``orphans_dropped``), and such a holder's cancel is a
    no-op."""

    def __init__(self, groups_per_step: int, max_staleness: int, version: int = 0,
                 consumed: int = 0, recovered: bool = False) -> None:
        super().__init__(groups_per_step, max_staleness)
        self.recovered = recovered
        self.orphans_dropped = 0
        if version or consumed:
            self._rebase(version, consumed, set())

    def _orphan(self, holder: str) -> bool:
        return self.recovered and self._held.get(holder, 0) <= 0

    def put(self, group: Group, holder: str = "") -> None:
        with self._cond:
            if (self._orphan(holder) and group.group_id not in self._seen
                    and not self.admission.slots_left(self._started, self._version)):
                self.orphans_dropped += 1
                return
            super().put(group, holder)

    def cancel_admission(self, holder: str = "") -> None:
        with self._cond:
            if not self._orphan(holder):
                super().cancel_admission(holder)

    def ack(self, group_ids: list[str]) -> None:
        with self._cond:  # ids taken from the dead actor: nothing left to ack
            super().ack([gid for gid in group_ids if not self.recovered or gid in self._taken])

    def lost_puts(self) -> int:
        return self.orphans_dropped

    def put_many(self, puts: list[Put]) -> list[bool | Exception | None]:
        """Several ``put`` / ``put_and_admit`` calls in one, in order: each one's result, or
        the error it raised."""
        out: list[bool | Exception | None] = []
        for data, holder, admit_next in puts:
            try:
                group = decode(data, Group)
                out.append(self.put_and_admit(group, holder) if admit_next
                           else self.put(group, holder))
            except Exception as exc:
                out.append(exc)
        return out

    def take_encoded(self, n: int, learner_version: int, timeout: float | None = None
                     ) -> list[bytes]:
        """``take``, each group encoded."""
        return [encode(group) for group in self.take(n, learner_version, timeout)]

    def shutdown(self) -> None:
        self.close()


def start_buffer_actor(cfg: Config, name: str, version: int = 0, consumed: int = 0,
                       recovered: bool = False) -> Any:
    """Start the actor holding the run's memory buffer, named ``name``; returns its handle."""
    actor_cls = ray.remote(num_cpus=0, max_concurrency=ACTOR_CONCURRENCY)(BufferActor)
    return actor_cls.options(name=name).remote(
        cfg.task.train_batch_size, cfg.buffer.max_staleness, version, consumed, recovered)


def actor_name(base: str, incarnation: int) -> str:
    return f"{base}.{incarnation}"


Recreate = Callable[[int, int, int, BaseException], Any]
"""(incarnation, learner version, consumed, why the last one died) -> the new actor's handle;
raises to stop the run (its re-creations used up)."""


class RemoteBuffer(ReplayBuffer):
    """A ReplayBuffer whose state lives in the buffer actor shared by all processes.

    ``base``: the actors' name (incarnation k is ``actor_name(base, k)``); ``recreate``: only
    in the driver, which then tracks the learner version and groups consumed to start the next
    incarnation from. A call that meets a dead actor re-attaches and is made again."""

    def __init__(self, handle: Any, base: str, incarnation: int = 0,
                 recreate: Recreate | None = None) -> None:
        self.handle = handle
        self.base = base
        self.incarnation = incarnation
        self.recreate = recreate
        self.version = 0
        self.consumed = 0
        self.last_stats = BufferStats()
        self.recoveries = 0
        self._lock = threading.Lock()
        self._putters: PerLoop[_Putter] = PerLoop(lambda loop: _Putter(self, loop))

    def __getstate__(self) -> dict[str, Any]:
        # Each process makes its own putters; only the driver re-creates the actor.
        return {"handle": self.handle, "base": self.base, "incarnation": self.incarnation}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["handle"], state["base"], state["incarnation"])  # type: ignore[misc]

    def _call(self, method: str, *args: Any) -> Any:
        while True:
            handle = self.handle
            try:
                return ray.get(getattr(handle, method).remote(*args))
            except RayActorError as exc:
                self._reattach(handle, exc)

    async def _acall(self, handle: Any, ref: Any, method: str, *args: Any) -> Any:
        """Await ``ref`` (``method`` already submitted to ``handle``); after a death, call
        again."""
        while True:
            try:
                return await ref
            except RayActorError as exc:
                await asyncio.to_thread(self._reattach, handle, exc)
                handle = self.handle
                ref = getattr(handle, method).remote(*args)

    def _submit(self, method: str, *args: Any) -> Awaitable[Any]:
        # Submitted now (a cancel or put is under way when this returns), awaited on the
        # caller's loop: no thread per call.
        handle = self.handle
        return self._acall(handle, getattr(handle, method).remote(*args), method, *args)

    def _reattach(self, dead: Any, exc: BaseException) -> None:
        """Point at the incarnation after ``dead`` (once, whichever thread sees it first)."""
        with self._lock:
            if self.handle is not dead:
                return
            if self.recreate is not None:
                self.handle = self.recreate(self.incarnation + 1, self.version, self.consumed,
                                            exc)
                self.incarnation += 1
                self.recoveries += 1
                last = self.last_stats
                log.warning(
                    "the memory buffer actor died (%s); re-created it as %s at learner version "
                    "%d: lost the %d group(s) queued and %d admission(s) in flight as of the "
                    "last step (their groups are put where the bound still allows, else "
                    "dropped and counted: RemoteBuffer.lost)", _first_line(exc),
                    actor_name(self.base, self.incarnation), self.version, last.queued,
                    last.in_flight)
                return
            deadline = time.monotonic() + REATTACH_TIMEOUT_S
            while True:
                try:
                    self.handle = ray.get_actor(actor_name(self.base, self.incarnation + 1))
                except ValueError:  # not registered yet: the driver re-creates it
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"the buffer actor {actor_name(self.base, self.incarnation)} died "
                            f"and the driver registered no new one within "
                            f"{REATTACH_TIMEOUT_S:.0f} s") from exc
                    time.sleep(0.2)
                    continue
                self.incarnation += 1
                log.warning("buffer actor %s died; re-attached to %s", self.base,
                            actor_name(self.base, self.incarnation))
                return

    def lost(self) -> int:
        """Puts the re-created actors dropped (their admission died with an earlier one)."""
        return int(self._call("lost_puts")) if self.recoveries else 0

    def try_admit(self, holder: str = "") -> bool:
        return bool(self._call("try_admit", holder))

    def atry_admit(self, holder: str = "") -> Awaitable[bool]:
        return self._submit("try_admit", holder)

    def admit_up_to(self, n: int, holder: str = "") -> int:
        return int(self._call("admit_up_to", n, holder))

    def aadmit_up_to(self, n: int, holder: str = "") -> Awaitable[int]:
        return self._submit("admit_up_to", n, holder)

    def cancel_admission(self, holder: str = "") -> None:
        self._call("cancel_admission", holder)

    def acancel_admission(self, holder: str = "") -> Awaitable[None]:
        return self._submit("cancel_admission", holder)

    def put(self, group: Group, holder: str = "") -> None:
        self._put_now(group, holder, admit_next=False)

    def aput(self, group: Group, holder: str = "") -> Awaitable[None]:
        return self._putters.get().submit(group, holder, admit_next=False)

    def put_and_admit(self, group: Group, holder: str = "") -> bool:
        return bool(self._put_now(group, holder, admit_next=True))

    def aput_and_admit(self, group: Group, holder: str = "") -> Awaitable[bool]:
        return self._putters.get().submit(group, holder, admit_next=True)

    def _put_now(self, group: Group, holder: str, admit_next: bool) -> bool | None:
        (result,) = self._call("put_many", [_put(group, holder, admit_next)])
        if isinstance(result, Exception):
            raise result
        return result

    def release(self, holder: str) -> int:
        return int(self._call("release", holder))

    def take(self, n: int, learner_version: int, timeout: float | None = None) -> list[Group]:
        self.version = max(self.version, learner_version)
        groups = [decode(data, Group)
                  for data in self._call("take_encoded", n, learner_version, timeout)]
        self.consumed += len(groups)
        return groups

    def ack(self, group_ids: list[str]) -> None:
        self._call("ack", group_ids)

    def set_version(self, learner_version: int) -> None:
        self._call("set_version", learner_version)
        self.version = learner_version

    def _rebase(self, learner_version: int, consumed: int, skip_ids: set[str]) -> None:
        self._call("rebase", learner_version, consumed, list(skip_ids))
        self.version, self.consumed = learner_version, consumed

    def stats(self) -> BufferStats:
        self.last_stats = self._call("stats")
        return self.last_stats


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _put(group: Group, holder: str, admit_next: bool) -> Put:
    """One put as it crosses to the actor (a TypeError for anything but a Group)."""
    return encode(expect_group(group)), holder, admit_next


class _Putter:
    """One event loop's puts: the puts submitted in one pass of the loop go out in one actor
    call, and those submitted while a call is in flight go out together in the next. A put is
    under way once submitted: cancelling its future does not withdraw it."""

    def __init__(self, buffer: RemoteBuffer, loop: asyncio.AbstractEventLoop) -> None:
        self.buffer = buffer
        self.loop = loop
        self.queue: list[tuple[Put, asyncio.Future[Any]]] = []
        self.task: asyncio.Task[None] | None = None  # sends until the queue is empty

    def submit(self, group: Group, holder: str, admit_next: bool) -> asyncio.Future[Any]:
        future = self.loop.create_future()
        try:
            put = _put(group, holder, admit_next)
        except Exception as exc:  # this put's own error: it never travels
            future.set_exception(exc)
            return future
        self.queue.append((put, future))
        if self.task is None:
            self.task = self.loop.create_task(self._send())
        return future

    async def _send(self) -> None:
        batch: list[tuple[Put, asyncio.Future[Any]]] = []
        try:
            while self.queue:
                batch, self.queue = self.queue[:PUT_BATCH], self.queue[PUT_BATCH:]
                try:
                    results = await self.buffer._submit("put_many", [put for put, _ in batch])
                except Exception as exc:  # the call failed: so did every put in it
                    results = [exc] * len(batch)
                for (_, future), result in zip(batch, results, strict=True):
                    if future.done():
                        continue  # its caller stopped waiting
                    if isinstance(result, Exception):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
        except BaseException as exc:  # the loop is closing: nobody will send the rest
            for _, future in batch + self.queue:
                if not future.done():
                    future.set_exception(exc if isinstance(exc, Exception)
                                         else RuntimeError("the event loop closed"))
            self.queue = []
            raise
        finally:
            self.task = None
