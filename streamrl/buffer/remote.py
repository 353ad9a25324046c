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
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

import ray

from streamrl.buffer.base import BufferStats, PerLoop, ReplayBuffer, expect_group
from streamrl.buffer.memory import MemoryBuffer
from streamrl.types import Group, decode, encode

if TYPE_CHECKING:
    from streamrl.config import Config

ACTOR_CONCURRENCY = 64
PUT_BATCH = 64  # puts per actor call at most

Put = tuple[bytes, str, bool]  # (encoded group, holder, claim the holder's next slot)


class BufferActor(MemoryBuffer):
    """The memory backend in a threaded actor (replicas put while the learner takes); its
    callers' groups come and go encoded (``put_many``, ``take_encoded``)."""

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


def start_buffer_actor(cfg: Config) -> Any:
    """Start the actor holding the run's memory buffer; returns its handle."""
    actor_cls = ray.remote(num_cpus=0, max_concurrency=ACTOR_CONCURRENCY)(BufferActor)
    return actor_cls.remote(cfg.task.train_batch_size, cfg.buffer.max_staleness)


class RemoteBuffer(ReplayBuffer):
    """A ReplayBuffer whose state lives in the buffer actor shared by all processes."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self._putters: PerLoop[_Putter] = PerLoop(lambda loop: _Putter(handle, loop))

    def __getstate__(self) -> dict[str, Any]:
        return {"handle": self.handle}  # each process makes its own putters

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["handle"])  # type: ignore[misc]

    def try_admit(self, holder: str = "") -> bool:
        return bool(ray.get(self.handle.try_admit.remote(holder)))

    def atry_admit(self, holder: str = "") -> Awaitable[bool]:
        # The ObjectRef itself, awaited on the caller's loop: no thread per call.
        return self.handle.try_admit.remote(holder)

    def admit_up_to(self, n: int, holder: str = "") -> int:
        return int(ray.get(self.handle.admit_up_to.remote(n, holder)))

    def aadmit_up_to(self, n: int, holder: str = "") -> Awaitable[int]:
        return self.handle.admit_up_to.remote(n, holder)

    def cancel_admission(self, holder: str = "") -> None:
        ray.get(self.handle.cancel_admission.remote(holder))

    def acancel_admission(self, holder: str = "") -> Awaitable[None]:
        return self.handle.cancel_admission.remote(holder)  # submitted now, like aput

    def put(self, group: Group, holder: str = "") -> None:
        self._put_now(group, holder, admit_next=False)

    def aput(self, group: Group, holder: str = "") -> Awaitable[None]:
        return self._putters.get().submit(group, holder, admit_next=False)

    def put_and_admit(self, group: Group, holder: str = "") -> bool:
        return bool(self._put_now(group, holder, admit_next=True))

    def aput_and_admit(self, group: Group, holder: str = "") -> Awaitable[bool]:
        return self._putters.get().submit(group, holder, admit_next=True)

    def _put_now(self, group: Group, holder: str, admit_next: bool) -> bool | None:
        (result,) = ray.get(self.handle.put_many.remote([_put(group, holder, admit_next)]))
        if isinstance(result, Exception):
            raise result
        return result

    def release(self, holder: str) -> int:
        return int(ray.get(self.handle.release.remote(holder)))

    def take(self, n: int, learner_version: int, timeout: float | None = None) -> list[Group]:
        return [decode(data, Group)
                for data in ray.get(self.handle.take_encoded.remote(n, learner_version, timeout))]

    def ack(self, group_ids: list[str]) -> None:
        ray.get(self.handle.ack.remote(group_ids))

    def set_version(self, learner_version: int) -> None:
        ray.get(self.handle.set_version.remote(learner_version))

    def _rebase(self, learner_version: int, consumed: int, skip_ids: set[str]) -> None:
        ray.get(self.handle.rebase.remote(learner_version, consumed, list(skip_ids)))

    def stats(self) -> BufferStats:
        return ray.get(self.handle.stats.remote())


def _put(group: Group, holder: str, admit_next: bool) -> Put:
    """One put as it crosses to the actor (a TypeError for anything but a Group)."""
    return encode(expect_group(group)), holder, admit_next


class _Putter:
    """One event loop's puts: the puts submitted in one pass of the loop go out in one actor
    call, and those submitted while a call is in flight go out together in the next. A put is
    under way once submitted: cancelling its future does not withdraw it."""

    def __init__(self, handle: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.handle = handle
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
                    results = await self.handle.put_many.remote([put for put, _ in batch])
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
