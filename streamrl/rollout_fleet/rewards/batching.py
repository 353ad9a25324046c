"""MicroBatcher: single-item async calls served by one batched function.

Replicas score each response of a group as its own call, all at about the same time. The
reward model is much cheaper per text in a batch, so the batcher gathers calls: when one
arrives it waits up to ``wait_s`` for more (never past ``max_batch``), then runs ``fn`` on the
batch in a worker thread, so the event loop keeps taking calls meanwhile; those form the next
batch. One batch runs at a time (one model, one forward).

A call cancelled while waiting is left out of its batch; an exception from ``fn`` fails every
call of that batch. Calls come from one event loop at a time (the actor's; a test may use
several in turn).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class MicroBatcher(Generic[T, R]):
    def __init__(self, fn: Callable[[list[T]], list[R]], max_batch: int, wait_s: float) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch}: must be >= 1")
        self.fn, self.max_batch, self.wait_s = fn, max_batch, wait_s
        self._queue: asyncio.Queue[tuple[T, asyncio.Future[R]]] | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def submit(self, item: T) -> R:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # the serving task must live on the callers' loop
            self._loop, self._queue = loop, asyncio.Queue()
            self._task = loop.create_task(self._serve())
        assert self._queue is not None
        future: asyncio.Future[R] = loop.create_future()
        self._queue.put_nowait((item, future))
        return await future

    async def _serve(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            deadline = loop.time() + self.wait_s
            while len(batch) < self.max_batch:
                if not self._queue.empty():
                    batch.append(self._queue.get_nowait())
                    continue
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), left))
                except asyncio.TimeoutError:
                    break
            live = [(item, fut) for item, fut in batch if not fut.done()]
            if not live:
                continue
            try:
                results = await asyncio.to_thread(self.fn, [item for item, _ in live])
                if len(results) != len(live):
                    raise RuntimeError(f"batched function returned {len(results)} results "
                                       f"for {len(live)} items")
            except Exception as exc:
                for _, fut in live:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            for (_, fut), result in zip(live, results, strict=True):
                if not fut.done():
                    fut.set_result(result)

    async def close(self) -> None:
        if self._task is not None and self._loop is asyncio.get_running_loop():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._task = self._loop = None
