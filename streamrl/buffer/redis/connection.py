"""How the Redis buffer's calls reach Redis and live through an outage.

Parts: ``connect`` (the checked sync client) and ``connect_async`` (a writer's), both retrying
every command through a restart or outage for ``outage_s`` wall seconds (``RetryFor``);
``outage_is_fatal`` and ``outage_error`` (an outage longer than that stops the run with one line
naming the URL, its password masked); ``exchange`` / ``exchange_now`` (a batch of raw commands in
one round trip, without redis-py's pipeline bookkeeping). Depends on redis-py, errors and logs
(``redact_url``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import hiredis
import redis
import redis.asyncio
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from streamrl.errors import ConfigError, RunStopped
from streamrl.logs import redact_url

F = TypeVar("F", bound=Callable[..., Any])

CONNECT_TIMEOUT_S = 5.0
# Longest wait for one reply: Redis answers within ms (a busy script makes it answer BUSY after
# its 5 s lua-time-limit), so a silent socket this long means a stopped or unreachable server.
READ_TIMEOUT_S = 30.0
RETRY_BACKOFF_CAP_S = 1.0


def outage_error(url: str, outage_s: float, exc: Exception) -> RunStopped:
    return RunStopped(f"buffer.redis_url={redact_url(url)!r}: Redis unreachable for "
                      f"buffer.redis_outage_s={outage_s:g} ({redact_url(str(exc))})")


def outage_is_fatal(method: F) -> F:
    """A Redis that stays unreachable longer than the client's retries (``outage_s``) stops
    the run with one line naming the URL, instead of a redis-py traceback. For methods of an
    object with ``url`` and ``outage_s``."""
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise outage_error(self.url, self.outage_s, exc) from None
    return wrapper  # type: ignore[return-value]


def connect(url: str, outage_s: float = 60.0) -> redis.Redis:
    """A client for ``url`` that has answered a PING: a wrong or unreachable buffer.redis_url
    fails here within ``CONNECT_TIMEOUT_S``, as one ConfigError. Later, every command retries
    connection failures and unanswered reads for ``outage_s`` (a restarted Redis is reconnected
    to; a stopped one stops the run)."""
    try:
        probe = redis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                     socket_timeout=CONNECT_TIMEOUT_S)
    except ValueError as exc:
        raise ConfigError(f"buffer.redis_url={redact_url(url)!r}: {redact_url(str(exc))}, "
                          "e.g. redis://127.0.0.1:6379/0") from None
    try:
        probe.ping()  # without retries: a wrong URL fails now, not after outage_s
    except redis.RedisError as exc:
        raise ConfigError(f"buffer.redis_url={redact_url(url)!r}: no Redis answers there "
                          f"({redact_url(str(exc))}): start redis-server, or point "
                          "buffer.redis_url at one") from None
    finally:
        probe.close()
    return redis.Redis.from_url(
        url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=READ_TIMEOUT_S,
        retry=RetryFor(outage_s), retry_on_error=[redis.ConnectionError, redis.TimeoutError])


def connect_async(url: str, outage_s: float) -> redis.asyncio.Redis:
    """The asyncio client of a writer, retrying like ``connect``'s (the URL was checked)."""
    return redis.asyncio.Redis.from_url(
        url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=READ_TIMEOUT_S,
        retry=AsyncRetryFor(outage_s), retry_on_error=[redis.ConnectionError, redis.TimeoutError])


_BACKOFF = ExponentialBackoff(cap=RETRY_BACKOFF_CAP_S, base=0.05)


class RetryFor(Retry):
    """Retries a call until ``outage_s`` wall seconds have passed since it started. redis-py
    counts retries, and an attempt costs anything from a refused connect (at once) to an
    unanswered read (``READ_TIMEOUT_S``), so no count bounds the time."""

    def __init__(self, outage_s: float) -> None:
        super().__init__(_BACKOFF, retries=-1)
        self.outage_s = outage_s

    def call_with_retry(self, do: Callable[[], Any], fail: Callable[..., Any],
                        is_retryable: Callable[[Exception], bool] | None = None,
                        with_failure_count: bool = False) -> Any:
        deadline = time.monotonic() + self.outage_s

        def failed(error: Exception, *count: int) -> None:
            fail(error, *count)  # redis-py's handler: disconnects, so no stale reply is read
            if time.monotonic() >= deadline:
                raise error

        return super().call_with_retry(do, failed, is_retryable, with_failure_count)


class AsyncRetryFor(AsyncRetry):
    """``RetryFor`` for the asyncio client."""

    def __init__(self, outage_s: float) -> None:
        super().__init__(_BACKOFF, retries=-1)
        self.outage_s = outage_s

    async def call_with_retry(self, do: Callable[[], Awaitable[Any]], fail: Callable[..., Any],
                              is_retryable: Callable[[Exception], bool] | None = None,
                              with_failure_count: bool = False) -> Any:
        deadline = time.monotonic() + self.outage_s

        async def failed(error: Exception, *count: int) -> None:
            await fail(error, *count)
            if time.monotonic() >= deadline:
                raise error

        return await super().call_with_retry(do, failed, is_retryable, with_failure_count)


async def exchange(client: redis.asyncio.Redis, commands: list[tuple[Any, ...]]) -> list[Any]:
    """Send ``commands`` in one round trip on one of ``client``'s connections; each one's reply,
    or its error reply as an exception. What ``Pipeline.execute`` does, less its bookkeeping
    (command stack, observability hooks, reset), which cost a replica's writer more than the
    round trip's own packing: retried through an outage like any command of ``client``."""
    pool = client.connection_pool
    conn = await pool.get_connection()

    async def once() -> list[Any]:
        # hiredis packs in C: redis-py's asyncio connection packs in Python, and that was a
        # sixth of a replica's put time (the sync client packs with hiredis already).
        await conn.send_packed_command(b"".join(map(hiredis.pack_command, commands)))
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(await conn.read_response())
            except redis.ResponseError as exc:
                replies.append(exc)
        return replies

    async def reconnect(error: Exception) -> None:
        await conn.disconnect()

    try:
        return await conn.retry.call_with_retry(once, reconnect)
    finally:
        await pool.release(conn)


def exchange_now(client: redis.Redis, commands: list[tuple[Any, ...]]) -> list[Any]:
    """``exchange`` for the learner's blocking calls (take, ack): one round trip on one of
    ``client``'s connections, each command's raw reply or its error reply as an exception.
    redis-py's own path (a Pipeline, or a Script call) spends more of a take in its
    bookkeeping, retries and reply parsing than in the round trip."""
    pool = client.connection_pool
    conn = pool.get_connection()

    def once() -> list[Any]:
        conn.send_packed_command([b"".join(map(hiredis.pack_command, commands))])
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(conn.read_response())
            except redis.ResponseError as exc:
                replies.append(exc)
        return replies

    try:
        return conn.retry.call_with_retry(once, lambda error, *count: conn.disconnect())
    finally:
        pool.release(conn)
