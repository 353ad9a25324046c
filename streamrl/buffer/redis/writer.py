"""The awaitable replica calls of one event loop, sent from that loop (``LoopWriter``).

Each round trip is one pipeline of every call queued meanwhile, with up to
``WRITER_PIPELINES`` pipelines in flight at once (each on its own connection); what a pipeline
carries and how its replies settle the calls is the backend's ``send``. Depends on redis-py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import redis.asyncio
from redis.commands.core import Script

log = logging.getLogger(__name__)

WRITER_PIPELINES = 2  # replica-call pipelines a writer keeps in flight at once


class Call(NamedTuple):
    """One script call a replica's event loop queued for its writer."""

    script: Script
    args: list[Any]
    future: asyncio.Future[Any]


Send = Callable[[redis.asyncio.Redis, list[Call]], Awaitable[None]]
"""Sends calls in one pipeline on a client and settles each call's future."""


class LoopWriter:
    """Sends the awaitable replica calls made on one event loop, from that loop: each round
    trip one pipeline of every call queued meanwhile (``send``), with up to
    ``WRITER_PIPELINES`` pipelines in flight at once (each on its own connection).

    ``submit`` queues a call and schedules a flush for when the loop has run the callbacks
    already ready, so the calls a loop iteration's tasks make travel together; a pipeline that
    completes flushes what queued meanwhile. Cancelling a caller does not withdraw its call.
    Calls in flight together are not ordered among themselves; a call made after another's
    reply runs after it (each script is atomic). No thread: it would contend with the loop for
    the GIL at every socket call."""

    def __init__(self, loop: asyncio.AbstractEventLoop, client: redis.asyncio.Redis,
                 send: Send, run: str, url: str) -> None:
        self.client = client
        self._send_calls = send
        self._run = run
        self._url = url
        self._loop = loop
        self._queue: list[Call] = []
        self._flush_due = False
        self._sends: set[asyncio.Task[None]] = set()
        self._stopped = ""  # why queued calls can no longer be sent

    def submit(self, script: Script, args: list[Any]) -> asyncio.Future[Any]:
        future = self._loop.create_future()
        call = Call(script, args, future)
        if self._stopped:
            self._fail([call], self._stopped)
            return future
        self._queue.append(call)
        if not self._flush_due:
            self._flush_due = True
            self._loop.call_soon(self._flush)
        return future

    def _flush(self) -> None:
        """Send what is queued, shared evenly among the pipelines free now (the server works
        on one share while the next is sent); a pipeline that completes flushes again."""
        self._flush_due = False
        while self._queue and len(self._sends) < WRITER_PIPELINES:
            share = -(-len(self._queue) // (WRITER_PIPELINES - len(self._sends)))
            calls, self._queue = self._queue[:share], self._queue[share:]
            send = self._loop.create_task(self._send(calls),
                                          name=f"redis-buffer-{self._run}-writer")
            self._sends.add(send)
            send.add_done_callback(self._sent)

    def _sent(self, send: asyncio.Task[None]) -> None:
        self._sends.discard(send)
        if send.cancelled():  # the loop is closing: what is queued will not be sent
            self._stopped = "its event loop is closing"
            self._fail(self._queue, self._stopped)
            self._queue = []
            return
        if send.exception() is not None:  # its calls failed with it; later ones may not
            log.error("buffer %s: writer pipeline failed", self._run,
                      exc_info=send.exception())
        self._flush()

    async def _send(self, calls: list[Call]) -> None:
        why = "the event loop cancelled it"
        try:
            await self._send_calls(self.client, calls)
        except Exception as exc:  # send settles calls with their errors: a bug if we get here
            why = repr(exc)
            raise
        finally:  # normally every call is settled by now
            self._fail([c for c in calls if not c.future.done()], why)

    def _fail(self, calls: list[Call], why: str) -> None:
        for call in calls:
            call.future.set_exception(RuntimeError(
                f"buffer {self._run!r}: its writer stopped ({why}) before this call's "
                "reply came; the call may or may not have been applied"))

    async def aclose(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the queued calls to be sent, then disconnect."""
        deadline = self._loop.time() + timeout_s
        while self._sends or self._queue:
            self._flush()
            remaining = deadline - self._loop.time()
            if remaining <= 0 or not self._sends:
                break
            await asyncio.wait(set(self._sends), timeout=remaining)
        if self._sends or self._queue:
            log.error("buffer %s: closed with replica calls still unsent after %.0f s "
                      "(Redis at %s not answering); they fail", self._run, timeout_s,
                      self._url)
            self._stopped = f"closed after waiting {timeout_s:.0f} s for Redis"
            self._fail(self._queue, self._stopped)
            self._queue = []
            for send in list(self._sends):
                send.cancel()
            await asyncio.gather(*self._sends, return_exceptions=True)
        await self.client.aclose()
