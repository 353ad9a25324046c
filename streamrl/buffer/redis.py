"""Redis replay buffer (``buffer.backend=redis``): shared by processes and machines, inspectable.

Parts: the key layout (``RunKeys``), ``RedisBuffer`` (the ``ReplayBuffer`` backend) and
``print_stats`` (behind ``streamrl buffer stats``). The Lua scripts that keep every counter
atomic with the data it describes live in ``redis_scripts`` (this module registers them).

Keys of run ``<run>``::

    streamrl:<run>:groups  stream, one msgspec-msgpack ``Group`` per entry (fields group_id,
                           min_version, data, holder); consumer group ``learners``, created at
                           init
    streamrl:<run>:stats   hash: learner_version produced consumed queued started in_flight
                           dropped refused malformed staleness_mean staleness_max staleness_sum
                           staleness_count groups_per_step max_staleness last_update_ts
                           bus_endpoint (the trainer's weight-bus endpoint, for streamrl serve)
    streamrl:<run>:holders hash: admissions in flight per holder (replica incarnation)
    streamrl:<run>:dead    stream, malformed and refused entries (source_id, reason, original
                           fields)
    streamrl:<run>:ids     set, every group_id ever put (put is idempotent)
    streamrl:<run>:queued  set, entry ids put and not yet taken (queued = SCARD)
    streamrl:<run>:taken   set, entry ids taken and not yet acked
    streamrl:<run>:minv    hash, entry id -> min_version of each queued entry put by PUT (lets
                           TAKE check and count a batch without reading its data)

At a glance: ``redis-cli HGETALL streamrl:<run>:stats`` (counters, learner version) and
``redis-cli XINFO GROUPS streamrl:<run>:groups`` (``lag``: entries no learner has read yet;
``pending``: read, not yet acked).

Learner lifecycle: XREADGROUP -> train -> checkpoint (with the taken group ids) -> ``ack``
(XACK). After a crash the unacked entries are delivered again: a restarted learner with the same
consumer name first reads its own pending entries (id 0); entries of a consumer that vanished
are claimed with XAUTOCLAIM once idle longer than ``claim_idle_s`` (``rebase`` claims them all
at once). Group ids already trained are passed back as ``skip_ids``: they are acked, not
delivered twice. Entries that do not decode as a ``Group`` (garbage bytes, wrong type, missing
fields) are acked, copied to the dead-letter stream, counted as ``malformed`` and logged with
their id; they never reach, nor crash, the learner. Decoding is msgspec, never pickle. Entries
with a token newer than the learner version (``base.newer_than_learner``) are refused the same
way, counted as ``refused``, the line naming the holder that put them.

Acked entries are trimmed from the head of the stream (XTRIM MINID, never XDEL, which would make
XINFO's ``lag`` unknown), so a long-running service keeps only its backlog.

Round trips (tests/buffer/test_redis_buffer.py counts them): ``try_admit``, ``admit_up_to``
(n slots in one script), ``put``, ``put_and_admit`` (the put and the next group's admission in
one script), ``cancel_admission``, ``set_version`` and ``ack`` (XACK and trim) are one script
each. The awaitable calls a replica makes from its event loop (``atry_admit``,
``aadmit_up_to``, ``aput``, ``aput_and_admit``, ``acancel_admission``)
go through that loop's writer (``_LoopWriter``): every call queued while a pipeline is out
travels in the next one, consecutive puts as one PUT script (one XADD per group inside), so a
replica with a few groups in flight pays well under one round trip per group; each caller gets
its own result or error. A ``take`` of ready entries is one round trip: XREADGROUP COUNT n and
the TAKE script pipelined, the script counting the batch the read delivered (and publishing the
learner version) when it is complete and fresh; otherwise the entries are decoded first and
counted with one CONSUME script. Every entry is decoded once. XAUTOCLAIM is polled at most once
a second.
"""

from __future__ import annotations

import asyncio
import functools
import io
import logging
import re
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import hiredis
import redis
import redis.asyncio
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.commands.core import Script
from redis.retry import Retry

import streamrl.buffer.redis_scripts as lua
from streamrl.buffer.base import (
    Admission,
    BufferStats,
    PerLoop,
    Refusals,
    ReplayBuffer,
    newer_than_learner,
)
from streamrl.errors import ConfigError, RunStopped
from streamrl.types import DecodeError, Group, decode, encode

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])

CONSUMER_GROUP = "learners"
_RUN_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
_POLL_MS = 1000  # longest single XREADGROUP block: recovery and claims are checked between
CONNECT_TIMEOUT_S = 5.0
# Longest wait for one reply: Redis answers within ms (a busy script makes it answer BUSY after
# its 5 s lua-time-limit), so a silent socket this long means a stopped or unreachable server.
READ_TIMEOUT_S = 30.0
WRITER_PIPELINES = 2  # replica-call pipelines a writer keeps in flight at once
PUT_BATCH = 256  # most groups one PUT call carries (Lua unpacks their ids at once)
RETRY_BACKOFF_CAP_S = 1.0


def _outage_is_fatal(method: F) -> F:
    """A Redis that stays unreachable longer than the client's retries (``outage_s``) stops
    the run with one line naming the URL, instead of a redis-py traceback."""
    @functools.wraps(method)
    def wrapper(self: RedisBuffer, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise self._outage(exc) from None
    return wrapper  # type: ignore[return-value]


@dataclass(frozen=True)
class RunKeys:
    groups: str
    stats: str
    dead: str
    ids: str
    queued: str
    taken: str
    holders: str
    minv: str

    @classmethod
    def of(cls, run: str) -> RunKeys:
        if not _RUN_RE.match(run):
            raise ConfigError(f"buffer.run={run!r}: use letters, digits, '_', '.', '-' only")
        p = f"streamrl:{run}:"
        return cls(p + "groups", p + "stats", p + "dead", p + "ids", p + "queued", p + "taken",
                   p + "holders", p + "minv")


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _id_order(eid: bytes) -> tuple[int, int]:
    """A stream entry id (``<ms>-<seq>``) as numbers, for ordering."""
    ms, _, seq = eid.partition(b"-")
    return int(ms), int(seq or 0)


class _Entry(NamedTuple):
    """A decoded stream entry the learner holds or has returned."""

    eid: bytes
    group: Group
    oldest: int | None
    """``group.min_version``, read from the entry's field: PUT wrote it from the same group in
    the same XADD, and scanning every token's version again costs more than the decode."""
    newest: int | None
    """``group.max_version``."""
    holder: str
    """Who put it (the entry's field; "" for entries written before it existed)."""
    counted: bool
    """Counted as consumed when read (TAKE); else CONSUME counts it when it is returned."""

    def staleness(self, learner_version: int) -> int:
        return 0 if self.oldest is None else learner_version - self.oldest


class _Call(NamedTuple):
    """One script call a replica's event loop queued for its writer."""

    script: Script
    args: list[Any]
    future: asyncio.Future[Any]


class _LoopWriter:
    """Sends the awaitable replica calls made on one event loop, from that loop: each round
    trip one pipeline of every call queued meanwhile (``RedisBuffer._send``), with up to
    ``WRITER_PIPELINES`` pipelines in flight at once (each on its own connection).

    ``submit`` queues a call and schedules a flush for when the loop has run the callbacks
    already ready, so the calls a loop iteration's tasks make travel together; a pipeline that
    completes flushes what queued meanwhile. Cancelling a caller does not withdraw its call.
    Calls in flight together are not ordered among themselves; a call made after another's
    reply runs after it (each script is atomic). No thread: it would contend with the loop for
    the GIL at every socket call."""

    def __init__(self, buffer: RedisBuffer, loop: asyncio.AbstractEventLoop) -> None:
        self.client = _connect_async(buffer._url, buffer.outage_s)
        self._buffer = buffer
        self._loop = loop
        self._queue: list[_Call] = []
        self._flush_due = False
        self._sends: set[asyncio.Task[None]] = set()
        self._stopped = ""  # why queued calls can no longer be sent

    def submit(self, script: Script, args: list[Any]) -> asyncio.Future[Any]:
        future = self._loop.create_future()
        call = _Call(script, args, future)
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
                                          name=f"redis-buffer-{self._buffer.run}-writer")
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
            log.error("buffer %s: writer pipeline failed", self._buffer.run,
                      exc_info=send.exception())
        self._flush()

    async def _send(self, calls: list[_Call]) -> None:
        why = "the event loop cancelled it"
        try:
            await self._buffer._send(self.client, calls)
        except Exception as exc:  # _send settles calls with their errors: a bug if we get here
            why = repr(exc)
            raise
        finally:  # normally every call is settled by now
            self._fail([c for c in calls if not c.future.done()], why)

    def _fail(self, calls: list[_Call], why: str) -> None:
        for call in calls:
            call.future.set_exception(RuntimeError(
                f"buffer {self._buffer.run!r}: its writer stopped ({why}) before this call's "
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
                      "(Redis at %s not answering); they fail", self._buffer.run, timeout_s,
                      self._buffer._url)
            self._stopped = f"closed after waiting {timeout_s:.0f} s for Redis"
            self._fail(self._queue, self._stopped)
            self._queue = []
            for send in list(self._sends):
                send.cancel()
            await asyncio.gather(*self._sends, return_exceptions=True)
        await self.client.aclose()


class RedisBuffer(ReplayBuffer):
    """``ReplayBuffer`` over one Redis stream + consumer group (see the module docstring).

    Replicas (any process) call ``try_admit`` / ``put`` / ``put_and_admit``, or from an event
    loop their awaitable twins (sent by that loop's writer); one learner process (consumer name
    ``consumer``) calls ``take`` / ``ack``. Take order is stream order (arrival); each returned
    batch is sorted oldest policy version first.
    """

    def __init__(
        self,
        redis_url: str,
        run: str,
        groups_per_step: int,
        max_staleness: int,
        consumer: str = "learner-0",
        skip_ids: Iterable[str] = (),
        claim_idle_s: float = 60.0,
        trim_acked: bool = True,
        client: redis.Redis | None = None,
        outage_s: float = 60.0,
    ) -> None:
        """``outage_s``: how long every call retries (reconnecting, backing off up to
        ``RETRY_BACKOFF_CAP_S``) through a Redis restart or outage before the run stops."""
        self.admission = Admission(groups_per_step, max_staleness)
        if claim_idle_s < 0:
            raise ValueError(f"claim_idle_s={claim_idle_s}: must be >= 0")
        self.run = run
        self.keys = RunKeys.of(run)
        self.consumer = consumer
        self.claim_idle_ms = int(claim_idle_s * 1000)
        self.trim_acked = trim_acked
        self._url = redis_url
        self.outage_s = outage_s
        self._r = client if client is not None else _connect(redis_url, outage_s)
        s = self._r.register_script
        self._admit, self._cancel, self._put = s(lua.ADMIT), s(lua.CANCEL), s(lua.PUT)
        self._admit_many = s(lua.ADMIT)  # the same script: its replies are counts, not flags
        self._release = s(lua.RELEASE)
        self._set_version, self._consume = s(lua.SET_VERSION), s(lua.CONSUME)
        self._take = s(lua.TAKE)
        self._discard, self._ack, self._rebase = s(lua.DISCARD), s(lua.ACK), s(lua.REBASE)
        k = self.keys
        self._admit_keys = [k.stats, k.holders]  # ADMIT, CANCEL, RELEASE
        self._put_keys = [k.stats, k.ids, k.groups, k.queued, k.holders, k.minv]
        # Awaitable replica calls: one writer per event loop, made by its first call.
        self._writers: PerLoop[_LoopWriter] = PerLoop(lambda loop: _LoopWriter(self, loop))
        self._closing: set[asyncio.Task[None]] = set()  # writers closing on their own loop
        self._lock = threading.Lock()  # learner-side state below
        self._refusals = Refusals(log, f"buffer {run}")
        self._skip: set[str] = set(skip_ids)
        self._held: list[_Entry] = []  # read, fresh, not yet returned
        self._outstanding: dict[str, bytes] = {}  # group_id -> entry id: returned, not acked
        self._recover_from: bytes | None = b"0"  # read own pending entries first (crash restart)
        self._claim_from: bytes = b"0-0"
        self._seen = b"0-0"  # highest entry id delivered to this consumer that it has seen
        self._next_claim = 0.0
        # Highest learner version this buffer has stored: take publishes only a newer one, so a
        # step's take slices cost no SET_VERSION round trip (stored versions only rise, except
        # by rebase and purge, which reset this).
        self._published = -1
        self._init_keys()

    def __reduce__(self) -> tuple[type[RedisBuffer], tuple[Any, ...]]:
        """Sent to another process (a replica), the buffer reconnects to the same run; its
        learner-side state (held and outstanding entries) stays with the sender."""
        b, eta = self.admission.groups_per_step, self.admission.max_staleness
        return (RedisBuffer, (self._url, self.run, b, eta, self.consumer, (),
                              self.claim_idle_ms / 1000, self.trim_acked, None, self.outage_s))

    def _init_keys(self) -> None:
        b, eta = self.admission.groups_per_step, self.admission.max_staleness
        try:
            self._r.xgroup_create(self.keys.groups, CONSUMER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        stored = self._r.eval(lua.INIT, 1, self.keys.stats, b, eta)
        have_b, have_eta = int(stored[0]), int(stored[1])
        if (have_b, have_eta) != (b, eta):
            raise ConfigError(
                f"buffer.run={self.run!r} at {self._url} was created with groups_per_step="
                f"{have_b}, max_staleness={have_eta}; this process has groups_per_step={b}, "
                f"max_staleness={eta} (task.train_batch_size, buffer.max_staleness): use "
                "another buffer.run, or purge this one"
            )

    # -- replicas -------------------------------------------------------------------------
    # The sync calls are one script round trip each, on the caller's thread. The awaitable ones
    # (what replicas call from their event loop) go through that loop's writer, which sends the
    # calls queued together in one pipeline, consecutive puts as one PUT call: with a few groups
    # in flight, a round trip carries several puts and admissions.
    @_outage_is_fatal
    def try_admit(self, holder: str = "") -> bool:
        return bool(self._admit(keys=self._admit_keys, args=[holder]))

    def atry_admit(self, holder: str = "") -> Awaitable[bool]:
        return self._submit(self._admit, [holder])

    @_outage_is_fatal
    def admit_up_to(self, n: int, holder: str = "") -> int:
        return int(self._admit_many(keys=self._admit_keys, args=[holder, n]))

    def aadmit_up_to(self, n: int, holder: str = "") -> Awaitable[int]:
        return self._submit(self._admit_many, [holder, n])

    @_outage_is_fatal
    def cancel_admission(self, holder: str = "") -> None:
        try:
            self._cancel(keys=self._admit_keys, args=[holder])
        except redis.ResponseError as exc:
            raise ValueError(str(exc)) from exc

    def acancel_admission(self, holder: str = "") -> Awaitable[None]:
        return self._submit(self._cancel, [holder])

    @_outage_is_fatal
    def release(self, holder: str) -> int:
        return int(self._release(keys=self._admit_keys, args=[holder]))

    @_outage_is_fatal
    def put(self, group: Group, holder: str = "") -> None:
        self._put(keys=self._put_keys, args=self._put_args(group, holder, admit_next=False))

    def aput(self, group: Group, holder: str = "") -> Awaitable[None]:
        return self._submit(self._put, self._put_args(group, holder, admit_next=False))

    @_outage_is_fatal
    def put_and_admit(self, group: Group, holder: str = "") -> bool:
        reply = self._put(keys=self._put_keys, args=self._put_args(group, holder, admit_next=True))
        return _admitted(reply, 0)

    def aput_and_admit(self, group: Group, holder: str = "") -> Awaitable[bool]:
        return self._submit(self._put, self._put_args(group, holder, admit_next=True))

    def _put_args(self, group: Group, holder: str, admit_next: bool) -> list[Any]:
        """PUT's six arguments for one group (encoded here, on the caller's thread)."""
        if not isinstance(group, Group):
            raise TypeError(f"put: expected a Group, got {type(group).__name__}")
        oldest = group.min_version
        return [group.group_id, -1 if oldest is None else oldest, encode(group), holder,
                producer(holder), int(admit_next)]

    def _submit(self, script: Script, args: list[Any]) -> asyncio.Future[Any]:
        """Queue one script call for this event loop's writer; the call is under way when this
        returns (cancelling the returned future does not withdraw it)."""
        return self._writers.get().submit(script, args)

    async def _send(self, client: redis.asyncio.Redis, calls: list[_Call]) -> None:
        """Send ``calls`` in one pipeline (consecutive puts as one PUT call) and settle each
        call's future with its result or error."""
        commands: list[tuple[Script, list[Any], list[_Call]]] = []
        for call in calls:
            if (call.script is self._put and commands and commands[-1][0] is self._put
                    and len(commands[-1][2]) < PUT_BATCH):
                commands[-1][1].extend(call.args)
                commands[-1][2].append(call)
            else:
                commands.append((call.script, list(call.args), [call]))
        try:
            for attempt in (1, 2):
                packed = []
                for script, args, _ in commands:
                    keys = self._put_keys if script is self._put else self._admit_keys
                    packed.append(("EVALSHA", script.sha, len(keys), *keys, *args))
                replies = await _exchange(client, packed)
                lost = []  # scripts Redis no longer knows (it restarted): not run; load, resend
                for command, reply in zip(commands, replies):
                    if isinstance(reply, redis.exceptions.NoScriptError) and attempt == 1:
                        lost.append(command)
                    else:
                        self._settle(command[0], command[2], reply)
                if not lost:
                    return
                for script in {id(c[0]): c[0] for c in lost}.values():
                    await client.script_load(script.script)
                commands = lost
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            error: Exception = self._outage(exc)
        except Exception as exc:  # handed to every caller
            error = exc
        for _, _, waiting in commands:
            for call in waiting:
                if not call.future.done():
                    call.future.set_exception(error)

    def _settle(self, script: Script, calls: list[_Call], reply: Any) -> None:
        """Give each call of one command its result (a caller that was cancelled has none)."""
        if isinstance(reply, Exception) and script is self._cancel:
            reply = ValueError(str(reply))
        for i, call in enumerate(calls):
            if call.future.done():
                continue
            if isinstance(reply, Exception):
                call.future.set_exception(reply)
            elif script is self._put:
                call.future.set_result(_admitted(reply, i) if call.args[5] else None)
            else:
                call.future.set_result(bool(reply) if script is self._admit
                                       else int(reply) if script is self._admit_many else None)

    def _outage(self, exc: Exception) -> RunStopped:
        return RunStopped(f"buffer.redis_url={self._url!r}: Redis unreachable for "
                          f"buffer.redis_outage_s={self.outage_s:g} ({exc})")

    # -- learner --------------------------------------------------------------------------
    @_outage_is_fatal
    def take(self, n: int, learner_version: int, timeout: float | None = None) -> list[Group]:
        if n <= 0:
            raise ValueError(f"take: n={n} must be > 0")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                self._held = [e for e in self._held if self._keep(e, learner_version)]
                if len(self._held) >= n:
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                block = _POLL_MS if remaining is None else min(_POLL_MS, int(remaining * 1000))
                for eid, fields, counted in self._read(n - len(self._held),
                                                       block if block > 0 else None,
                                                       learner_version):
                    entry = self._admit_entry(eid, fields, counted)
                    if entry is not None and self._keep(entry, learner_version):
                        self._held.append(entry)
                if len(self._held) >= n:
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"take: {n} groups wanted, {len(self._held)} ready after {timeout} s "
                        f"(run {self.run!r}: see `streamrl buffer stats --run {self.run}`)"
                    )
            batch, self._held = self._held[:n], self._held[n:]
            args: list[Any] = [learner_version]
            for entry in batch:
                if not entry.counted:
                    args += [entry.eid, entry.staleness(learner_version)]
                self._outstanding[entry.group.group_id] = entry.eid
            if len(args) > 1 or learner_version > self._published:
                self._consume(keys=[self.keys.stats, self.keys.queued, self.keys.taken,
                                    self.keys.minv], args=args)
                self._published = learner_version  # CONSUME raised it too
        batch.sort(key=lambda e: (sys.maxsize if e.oldest is None else e.oldest, e.eid))
        return [entry.group for entry in batch]

    def _read(self, count: int, block_ms: int | None, learner_version: int
              ) -> list[tuple[bytes, dict | None, bool]]:
        """Next entries for this consumer, each with whether it was counted as consumed already:
        own pending after a restart, claims, then new ones (TAKE, then a blocking XREADGROUP
        when TAKE found none). TAKE publishes the learner version before any wait: it opens
        admission."""
        if self._recover_from is not None or time.monotonic() >= self._next_claim:
            known = set(self._outstanding.values()) | {entry.eid for entry in self._held}
            while self._recover_from is not None:
                raw = self._xreadgroup(self._recover_from, count, None)
                self._recover_from = raw[-1][0] if raw else None
                got = [(eid, f, False) for eid, f in raw if eid not in known]
                if got:
                    return got
            now = time.monotonic()
            if now >= self._next_claim:
                self._next_claim = now + min(1.0, self.claim_idle_ms / 2000)
                cursor, claimed, *_ = self._r.xautoclaim(
                    self.keys.groups, CONSUMER_GROUP, self.consumer, self.claim_idle_ms,
                    start_id=self._claim_from, count=count,
                )
                self._claim_from = cursor
                claimed = [(eid, f, False) for eid, f in self._seeing(claimed) if eid not in known]
                if claimed:
                    log.warning("buffer %s: claimed %d unacked entries of a vanished learner",
                                self.run, len(claimed))
                    return claimed
        k = self.keys
        take_keys = [k.stats, k.queued, k.taken, k.groups, k.minv]
        args = [CONSUMER_GROUP, self.consumer, self._seen, count, learner_version,
                self.admission.max_staleness]
        reply, ids = _exchange_now(self._r, [  # XREADGROUP, then TAKE counts what it read
            ("XREADGROUP", "GROUP", CONSUMER_GROUP, self.consumer, "COUNT", count,
             "STREAMS", k.groups, ">"),
            ("EVALSHA", self._take.sha, len(take_keys), *take_keys, *args)])
        if isinstance(reply, Exception):
            raise reply
        counted = set(_script_result(self._take, take_keys, args, ids))
        self._published = max(self._published, learner_version)
        entries = self._seeing(_stream_entries(reply))
        if entries:
            return [(eid, f, eid in counted) for eid, f in entries]
        if block_ms is None:
            return []
        return [(eid, f, False) for eid, f in self._xreadgroup(b">", count, block_ms)]

    def _xreadgroup(self, start: bytes, count: int, block_ms: int | None) -> list:
        reply = self._r.xreadgroup(
            CONSUMER_GROUP, self.consumer, {self.keys.groups: start}, count=count, block=block_ms
        )
        return self._seeing(list(reply[0][1]) if reply else [])

    def _seeing(self, entries: list) -> list:
        """``entries``, after noting the highest id among them (TAKE counts what comes after)."""
        for eid, _ in entries:
            if _id_order(eid) > _id_order(self._seen):
                self._seen = eid
        return entries

    def _admit_entry(self, eid: bytes, fields: dict | None, counted: bool) -> _Entry | None:
        """Decode one entry (once); skipped or malformed entries are acked here and yield None.
        ``counted``: TAKE counted it as consumed already."""
        gid = _s(fields.get(b"group_id", b"")) if fields else ""
        if gid and gid in self._skip:
            self._discard_entry(eid, "skipped", "already trained (skip_ids)")
            return None
        if not fields:
            self._discard_entry(eid, "malformed", "entry was deleted from the stream")
            return None
        data = fields.get(b"data")
        if data is None:
            self._discard_entry(eid, "malformed", "no 'data' field")
            return None
        try:
            group = decode(data, Group)
        except DecodeError as exc:
            self._discard_entry(eid, "malformed", str(exc))
            return None
        if group.group_id != gid:
            self._discard_entry(eid, "malformed", f"group_id field {gid!r} != {group.group_id!r}")
            return None
        try:
            oldest: int | None = int(fields[b"min_version"])
        except (KeyError, ValueError):  # an entry that bypassed PUT: read it from the tokens
            oldest = group.min_version
        holder = _s(fields.get(b"holder", b""))
        return _Entry(eid, group, None if oldest == -1 else oldest, group.max_version, holder,
                      counted)

    def _keep(self, entry: _Entry, learner_version: int) -> bool:
        refused = newer_than_learner(entry.group, entry.newest, learner_version, entry.holder)
        if refused is not None:
            self._refusals.note(entry.holder, f"entry {_s(entry.eid)}: {refused}")
            self._discard_entry(entry.eid, "refused", refused)
            return False
        staleness = entry.staleness(learner_version)
        if staleness <= self.admission.max_staleness:  # Admission.is_fresh, on the stored field
            return True
        reason = f"staleness {staleness} > {self.admission.max_staleness}"
        self._discard_entry(entry.eid, "dropped", reason)
        return False

    def _discard_entry(self, eid: bytes, kind: str, reason: str) -> None:
        if kind not in ("skipped", "refused"):  # refusals are logged by ``_refusals``
            log.warning("buffer %s: %s entry %s: %s", self.run, kind, _s(eid), reason)
        k = self.keys
        self._discard(
            keys=[k.stats, k.queued, k.taken, k.groups, k.dead, k.minv],
            args=[eid, kind, reason, CONSUMER_GROUP],
        )

    @_outage_is_fatal
    def ack(self, group_ids: list[str]) -> None:
        with self._lock:
            unknown = [gid for gid in group_ids if gid not in self._outstanding]
            if unknown:
                raise ValueError(f"ack: group ids not taken or already acked: {unknown}")
            eids = [self._outstanding.pop(gid) for gid in group_ids]
            if eids:
                self._run_now(self._ack, [self.keys.stats, self.keys.taken, self.keys.groups],
                              [CONSUMER_GROUP, int(self.trim_acked), *eids])

    def _run_now(self, script: Script, keys: list[str], args: list[Any]) -> Any:
        """``script(keys, args)`` on the learner's thread, in one round trip without redis-py's
        command bookkeeping (``_exchange_now``); an error reply is raised."""
        (reply,) = _exchange_now(self._r, [("EVALSHA", script.sha, len(keys), *keys, *args)])
        return _script_result(script, keys, args, reply)

    @_outage_is_fatal
    def set_version(self, learner_version: int) -> None:
        try:
            self._publish(learner_version, strict=True)
        except redis.ResponseError as exc:
            raise ValueError(str(exc)) from exc

    def _publish(self, learner_version: int, strict: bool) -> None:
        stored = self._set_version(keys=[self.keys.stats], args=[learner_version, int(strict)])
        self._published = max(self._published, int(stored))

    @_outage_is_fatal
    def rebase(
        self,
        learner_version: int,
        consumed: int,
        skip_ids: Iterable[str] = (),
        in_flight: int = 0,
    ) -> None:
        """See ``ReplayBuffer.rebase``. This learner claims every pending entry, acks the ones
        in ``skip_ids`` and requeues the rest; call it from the only live learner."""
        if learner_version < 0 or consumed < 0 or in_flight < 0:
            raise ValueError(
                f"rebase: learner_version={learner_version}, consumed={consumed}, "
                f"in_flight={in_flight} must all be >= 0"
            )
        with self._lock:
            self._skip |= set(skip_ids)
            cursor: bytes = b"0-0"
            while True:
                cursor, *_ = self._r.xautoclaim(
                    self.keys.groups, CONSUMER_GROUP, self.consumer, 0,
                    start_id=cursor, count=1000,  # (redis-py drops the cursor with JUSTID)
                )
                if _s(cursor) == "0-0":
                    break
            start = b"0"
            while got := self._xreadgroup(start, 1000, None):
                for eid, fields in got:
                    gid = _s(fields.get(b"group_id", b"")) if fields else ""
                    if gid in self._skip:
                        self._discard_entry(eid, "skipped", "already trained (skip_ids)")
                start = got[-1][0]
            self._held, self._outstanding = [], {}
            self._recover_from, self._claim_from = b"0", b"0-0"
            self._published = learner_version
            b, eta = self.admission.groups_per_step, self.admission.max_staleness
            self._rebase(
                keys=[self.keys.stats, self.keys.queued, self.keys.taken, self.keys.holders],
                args=[learner_version, consumed, in_flight, b, eta],
            )

    @_outage_is_fatal
    def stats(self) -> BufferStats:
        h = {_s(k): _s(v) for k, v in self._r.hgetall(self.keys.stats).items()}
        return BufferStats(
            learner_version=int(h.get("learner_version", 0)),
            produced=int(h.get("produced", 0)),
            consumed=int(h.get("consumed", 0)),
            queued=int(h.get("queued", 0)),
            started=int(h.get("started", 0)),
            in_flight=int(h.get("in_flight", 0)),
            dropped=int(h.get("dropped", 0)),
            refused=int(h.get("refused", 0)),
            malformed=int(h.get("malformed", 0)),
            staleness_mean=float(h.get("staleness_mean", 0.0)),
            staleness_max=int(h.get("staleness_max", 0)),
            last_update_ts=float(h.get("last_update_ts", 0.0)),
        )

    @_outage_is_fatal
    def announce_bus(self, endpoint: str) -> None:
        """Record the trainer's weight-bus endpoint: a ``streamrl serve`` process sharing this
        run connects its replicas to it (and reconnects when a restarted trainer announces a
        new one)."""
        self._r.hset(self.keys.stats, "bus_endpoint", endpoint)

    @_outage_is_fatal
    def bus_endpoint(self) -> str | None:
        value = self._r.hget(self.keys.stats, "bus_endpoint")
        return _s(value) if value is not None else None

    def purge(self) -> None:
        """Delete every key of this run (tests, benchmarks, starting a run name afresh)."""
        k = self.keys
        self._r.delete(k.groups, k.stats, k.dead, k.ids, k.queued, k.taken, k.holders, k.minv)
        self._published = -1
        self._seen = b"0-0"

    def close(self) -> None:
        """Send the queued awaitable replica calls (waiting up to ``outage_s`` plus the read
        timeout; calls still unsent then fail, each with an error its caller sees), then
        disconnect. Called on the writer's own loop, it cannot wait: the writer disconnects
        once its queue is sent. The buffer stays usable: a later call reconnects."""
        writers = self._writers.take_all()
        timeout_s = self.outage_s + READ_TIMEOUT_S
        here = _running_loop()
        for loop, writer in writers:
            if loop.is_closed():
                continue
            closing = writer.aclose(timeout_s)
            if here is loop:
                task = loop.create_task(closing)
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
            elif loop.is_running():  # another thread's loop
                asyncio.run_coroutine_threadsafe(closing, loop).result(timeout_s + 5)
            elif here is None:
                loop.run_until_complete(closing)
            else:  # a stopped loop, while another one runs here: it cannot run now
                closing.close()
                log.warning("buffer %s: close() left the writer of a stopped event loop "
                            "open (call it from that loop, or await aclose() there)", self.run)
        self._r.close()

    async def aclose(self) -> None:
        """``close`` for an event loop that made awaitable replica calls, from that loop: waits
        for the calls it queued (without blocking the loop), then disconnects its writer. The
        sync client and other loops' writers are ``close``'s."""
        writer = self._writers.pop()
        if writer is not None:
            await writer.aclose(self.outage_s + READ_TIMEOUT_S)


async def _exchange(client: redis.asyncio.Redis, commands: list[tuple[Any, ...]]) -> list[Any]:
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


def _exchange_now(client: redis.Redis, commands: list[tuple[Any, ...]]) -> list[Any]:
    """``_exchange`` for the learner's blocking calls (take, ack): one round trip on one of
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


def _script_result(script: Script, keys: list[str], args: list[Any], reply: Any) -> Any:
    """The result of an EVALSHA of ``script`` that returned ``reply`` raw: an error reply is
    raised; NOSCRIPT (Redis restarted and forgot it) loads the script and runs it again."""
    if isinstance(reply, redis.exceptions.NoScriptError):
        return script(keys=keys, args=args)
    if isinstance(reply, Exception):
        raise reply
    return reply


def _stream_entries(reply: Any) -> list[tuple[bytes, dict[bytes, bytes] | None]]:
    """A raw one-stream XREADGROUP reply (RESP3: a map of stream to entries; RESP2: a list of
    [stream, entries]) as (entry id, fields) pairs; fields None: the entry was deleted."""
    if not reply:
        return []
    (entries,) = reply.values() if isinstance(reply, dict) else (s[1] for s in reply)
    return [(eid, None if f is None else dict(zip(f[::2], f[1::2]))) for eid, f in entries]


def _admitted(put_reply: bytes, i: int) -> bool:
    """Whether the ``i``-th group of a PUT call claimed its holder's next slot (the reply holds
    two characters per group: put, admitted)."""
    return put_reply[2 * i + 1:2 * i + 2] == b"1"


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _connect(url: str, outage_s: float = 60.0) -> redis.Redis:
    """A client for ``url`` that has answered a PING: a wrong or unreachable buffer.redis_url
    fails here within ``CONNECT_TIMEOUT_S``, as one ConfigError. Later, every command retries
    connection failures and unanswered reads for ``outage_s`` (a restarted Redis is reconnected
    to; a stopped one stops the run)."""
    try:
        probe = redis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                     socket_timeout=CONNECT_TIMEOUT_S)
    except ValueError as exc:
        raise ConfigError(f"buffer.redis_url={url!r}: {exc}, e.g. redis://127.0.0.1:6379/0"
                          ) from exc
    try:
        probe.ping()  # without retries: a wrong URL fails now, not after outage_s
    except redis.RedisError as exc:
        raise ConfigError(f"buffer.redis_url={url!r}: no Redis answers there ({exc}): start "
                          "redis-server, or point buffer.redis_url at one") from exc
    finally:
        probe.close()
    return redis.Redis.from_url(
        url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=READ_TIMEOUT_S,
        retry=_RetryFor(outage_s), retry_on_error=[redis.ConnectionError, redis.TimeoutError])


def _connect_async(url: str, outage_s: float) -> redis.asyncio.Redis:
    """The asyncio client of a writer, retrying like ``_connect``'s (the URL was checked)."""
    return redis.asyncio.Redis.from_url(
        url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=READ_TIMEOUT_S,
        retry=_AsyncRetryFor(outage_s), retry_on_error=[redis.ConnectionError, redis.TimeoutError])


_BACKOFF = ExponentialBackoff(cap=RETRY_BACKOFF_CAP_S, base=0.05)


class _RetryFor(Retry):
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


class _AsyncRetryFor(AsyncRetry):
    """``_RetryFor`` for the asyncio client."""

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


# --- `streamrl buffer stats` -------------------------------------------------------------------
_STAT_ROWS = ("learner_version", "groups_per_step", "max_staleness", "started", "produced",
              "consumed", "queued", "in_flight", "dropped", "refused", "malformed",
              "staleness_mean", "staleness_max")


def producer(holder: str) -> str:
    """The replica a holder name stands for: holders are ``<replica>.<incarnation>``, and the
    stats count per replica, across its restarts."""
    return holder.rpartition(".")[0] or holder


def watch_stats(redis_url: str, run: str, interval_s: float) -> int:
    """``print_stats`` every ``interval_s`` seconds, redrawn in place on a terminal, until
    Ctrl-C (0) or the first read that fails (1)."""
    redraw = sys.stdout.isatty()
    # Ctrl-C ends the loop between frames, never inside a Redis read or a half-written frame.
    interrupted: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _: interrupted.append(signum))
    try:
        while not interrupted:
            frame = io.StringIO()
            code = print_stats(redis_url, run, file=frame)
            if code:
                return code
            print(("\x1b[H\x1b[2J" if redraw else "") + frame.getvalue(), end="", flush=True)
            deadline = time.monotonic() + interval_s
            while not interrupted and (left := deadline - time.monotonic()) > 0:
                time.sleep(min(left, 0.1))
        return 0
    finally:
        signal.signal(signal.SIGINT, previous)


def print_stats(redis_url: str, run: str, file: Any = None) -> int:
    """Print the stats hash, each replica's production and lag, and the consumer-group lag of
    ``run``; 0, or 1 with a message."""
    out = file if file is not None else sys.stdout
    try:
        keys = RunKeys.of(run)
        client = redis.Redis.from_url(redis_url, socket_connect_timeout=3, socket_timeout=10)
        stats = {_s(k): _s(v) for k, v in client.hgetall(keys.stats).items()}
        if not stats:
            print(f"streamrl buffer stats: no buffer for run {run!r} at {redis_url} "
                  f"(key {keys.stats} does not exist)", file=sys.stderr)
            return 1
        groups = client.xinfo_groups(keys.groups) if client.exists(keys.groups) else []
        consumers = (client.xinfo_consumers(keys.groups, CONSUMER_GROUP)
                     if any(_s(g["name"]) == CONSUMER_GROUP for g in groups) else [])
        dead = client.xlen(keys.dead)
    except (redis.RedisError, ValueError) as exc:
        print(f"streamrl buffer stats: cannot read {redis_url} (run {run!r}): {exc}",
              file=sys.stderr)
        return 1
    v, b, eta = (int(stats.get(f, 0)) for f in ("learner_version", "groups_per_step",
                                                 "max_staleness"))
    capacity = Admission(max(b, 1), eta).capacity(v)
    started = int(stats.get("started", 0))
    ts = float(stats.get("last_update_ts", 0.0))
    print(f"streamrl buffer  run={run}  {redis_url}", file=out)
    rows = [(name, stats.get(name, "-")) for name in _STAT_ROWS]
    rows.append(("admission", f"{started}/{capacity} slots used (capacity (V+eta+1)*B), "
                              f"{max(0, capacity - started)} free"))
    rows.append(("dead_letters", str(dead)))
    rows.append(("last_update", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))
                 + f" ({time.time() - ts:.1f} s ago)"))
    for name, value in rows:
        print(f"  {name:<16} {value}", file=out)
    print("", file=out)
    replicas = sorted(k.removeprefix("produced:") for k in stats if k.startswith("produced:"))
    if replicas:
        print("  replica          produced  last_version  lag", file=out)
        for name in replicas:
            last = stats.get(f"version:{name}")
            lag = "-" if last is None else str(v - int(last))
            print(f"  {name:<16} {stats[f'produced:{name}']:>8}  {last or '-':>12}  {lag:>3}",
                  file=out)
        print("", file=out)
    header = ("consumer_group", "lag", "pending", "consumers", "last_delivered_id")
    table = [header] + [
        (_s(g["name"]), "?" if g.get("lag") is None else _s(g["lag"]), _s(g["pending"]),
         _s(g["consumers"]), _s(g["last-delivered-id"]))
        for g in groups
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip(), file=out)
    for c in consumers:
        print(f"    consumer {_s(c['name'])}: pending {c['pending']}, idle {c['idle']} ms",
              file=out)
    return 0
