"""``RedisBuffer``: the ``ReplayBuffer`` backend over one Redis stream and consumer group (the
key layout, lifecycle and round trips are in the package docstring).

Replica calls (``try_admit``, ``put``, ``put_and_admit``, ... and their awaitable twins, sent by
that loop's ``writer.LoopWriter``) are one script each; the learner's ``take`` reads entries
(XREADGROUP, own pending after a restart, XAUTOCLAIM of a vanished learner's), decodes each once
(``wire.decode_entry``), drops stale, refuses newer-than-learner and dead-letters malformed ones
(``_keep``, ``_discard_entry``), and counts what it returns (TAKE or CONSUME). Admissions are
leases (``leases``): counted under the holder's name and this client's session
(``wire.held_as``), renewed by this client's heartbeat, reclaimed when it stops. Depends on base,
on logs (URLs in messages have their password masked), and on this package's connection,
leases, scripts, wire, writer and stats.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Iterable
from typing import Any

import redis
import redis.asyncio
from redis.commands.core import Script

from streamrl.buffer.base import (
    Admission,
    BufferStats,
    PerLoop,
    Refusals,
    ReplayBuffer,
    newer_than_learner,
)
from streamrl.buffer.redis.connection import (
    READ_TIMEOUT_S,
    connect,
    connect_async,
    exchange,
    exchange_now,
    outage_error,
    outage_is_fatal,
)
from streamrl.buffer.redis.leases import Heartbeat
from streamrl.buffer.redis.scripts import INIT, Scripts, admitted, script_result
from streamrl.buffer.redis.stats import read_stats
from streamrl.buffer.redis.wire import (
    CONSUMER_GROUP,
    Entry,
    Fields,
    MalformedEntry,
    RunKeys,
    decode_entry,
    group_id,
    held_as,
    id_order,
    put_args,
    stream_entries,
    text,
)
from streamrl.buffer.redis.writer import Call, LoopWriter
from streamrl.errors import ConfigError
from streamrl.logs import redact_url
from streamrl.types import Group

log = logging.getLogger(__name__)

_POLL_MS = 1000  # longest single XREADGROUP block: recovery and claims are checked between
PUT_BATCH = 256  # most groups one PUT call carries (Lua unpacks their ids at once)
REAP_EVERY_S = 1.0  # a learner waiting in take reclaims dead holders' slots this often at most


def new_session() -> str:
    """A name for one client's holders, unique across hosts and restarts (no '.': holder names
    end in ``.<incarnation>``)."""
    host = socket.gethostname().replace(".", "-")
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


class RedisBuffer(ReplayBuffer):
    """``ReplayBuffer`` over one Redis stream + consumer group (see the package docstring).

    Replicas (any process) call ``try_admit`` / ``put`` / ``put_and_admit``, or from an event
    loop their awaitable twins (sent by that loop's writer); one learner process (consumer name
    ``consumer``) calls ``take`` / ``ack``. Take order is stream order (arrival); each returned
    batch is sorted oldest policy version first.

    Holders are counted as ``<holder>@<session>`` (``wire.held_as``): a buffer sent to a replica
    keeps its sender's session, so the supervisor's ``release`` names what the replica
    claimed; a process that builds its own (``streamrl serve``) has a session of its own.
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
        lease_ttl_s: float = 30.0,
        session: str | None = None,
    ) -> None:
        """``outage_s``: how long every call retries (reconnecting, backing off up to
        ``connection.RETRY_BACKOFF_CAP_S``) through a Redis restart or outage before the run
        stops. ``lease_ttl_s``: how long this client's admissions outlive its last heartbeat
        (``leases``). ``session``: the name its holders are counted under (None: a new one)."""
        self.admission = Admission(groups_per_step, max_staleness)
        if claim_idle_s < 0:
            raise ValueError(f"claim_idle_s={claim_idle_s}: must be >= 0")
        if lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s={lease_ttl_s}: must be > 0")
        self.run = run
        self.keys = RunKeys.of(run)
        self.consumer = consumer
        self.claim_idle_ms = int(claim_idle_s * 1000)
        self.trim_acked = trim_acked
        self.url = redis_url
        self.outage_s = outage_s
        self.lease_ttl_s = lease_ttl_s
        self.session = session or new_session()
        self._r = client if client is not None else connect(redis_url, outage_s)
        self._lua = Scripts(self._r)
        k = self.keys
        self._admit_keys = [k.stats, k.holders, k.leases]  # ADMIT, CANCEL, RELEASE, LEASE
        self._put_keys = [k.stats, k.ids, k.groups, k.queued, k.holders, k.minv, k.leases]
        self._heartbeat = Heartbeat(self._beat, lease_ttl_s / 3,
                                    f"redis-buffer-{run}-leases")
        self._next_reap = 0.0
        # Awaitable replica calls: one writer per event loop, made by its first call.
        self._writers: PerLoop[LoopWriter] = PerLoop(self._writer)
        self._closing: set[asyncio.Task[None]] = set()  # writers closing on their own loop
        self._lock = threading.Lock()  # learner-side state below
        self._refusals = Refusals(log, f"buffer {run}")
        self._skip: set[str] = set(skip_ids)
        self._held: list[Entry] = []  # read, fresh, not yet returned
        self._outstanding: dict[str, bytes] = {}  # group_id -> entry id: returned, not acked
        self._recover_from: bytes | None = b"0"  # read own pending entries first (crash restart)
        self._claim_from: bytes = b"0-0"
        self._seen = b"0-0"  # highest entry id delivered to this consumer that it has seen
        self._next_claim = 0.0
        # Highest learner version this buffer has stored: take publishes only a newer one, so a
        # step's take slices cost no SET_VERSION round trip (stored versions only rise, except
        # by rebase and purge, which reset this).
        self._published = -1
        # What the learner knows, to make the run's keys again if Redis loses them
        # (``_recreate``): groups it took, the last stats it read, the endpoint it announced.
        self._consumed = 0
        self._last_stats = BufferStats()
        self._endpoint: str | None = None
        self._init_keys()

    def __reduce__(self) -> tuple[type[RedisBuffer], tuple[Any, ...]]:
        """Sent to another process (a replica), the buffer reconnects to the same run; its
        learner-side state (held and outstanding entries) stays with the sender."""
        b, eta = self.admission.groups_per_step, self.admission.max_staleness
        return (RedisBuffer, (self.url, self.run, b, eta, self.consumer, (),
                              self.claim_idle_ms / 1000, self.trim_acked, None, self.outage_s,
                              self.lease_ttl_s, self.session))

    def _init_keys(self) -> None:
        b, eta = self.admission.groups_per_step, self.admission.max_staleness
        try:
            self._r.xgroup_create(self.keys.groups, CONSUMER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        stored = self._r.eval(INIT, 1, self.keys.stats, b, eta)
        have_b, have_eta = int(stored[0]), int(stored[1])
        if (have_b, have_eta) != (b, eta):
            raise ConfigError(
                f"buffer.run={self.run!r} at {redact_url(self.url)} was created with "
                f"groups_per_step={have_b}, max_staleness={have_eta}; this process has "
                f"groups_per_step={b}, "
                f"max_staleness={eta} (task.train_batch_size, buffer.max_staleness): use "
                "another buffer.run, or purge this one"
            )

    # -- replicas -------------------------------------------------------------------------
    # The sync calls are one script round trip each, on the caller's thread. The awaitable ones
    # (what replicas call from their event loop) go through that loop's writer, which sends the
    # calls queued together in one pipeline, consecutive puts as one PUT call: with a few groups
    # in flight, a round trip carries several puts and admissions.
    @outage_is_fatal
    def try_admit(self, holder: str = "") -> bool:
        return bool(self._lua.admit(keys=self._admit_keys, args=self._admit_args(holder, 1)))

    def atry_admit(self, holder: str = "") -> Awaitable[bool]:
        return self._submit(self._lua.admit, self._admit_args(holder, 1))

    @outage_is_fatal
    def admit_up_to(self, n: int, holder: str = "") -> int:
        return int(self._lua.admit_many(keys=self._admit_keys, args=self._admit_args(holder, n)))

    def aadmit_up_to(self, n: int, holder: str = "") -> Awaitable[int]:
        return self._submit(self._lua.admit_many, self._admit_args(holder, n))

    @outage_is_fatal
    def cancel_admission(self, holder: str = "") -> None:
        try:
            self._lua.cancel(keys=self._admit_keys, args=[held_as(holder, self.session)])
        except redis.ResponseError as exc:
            raise ValueError(str(exc)) from exc

    def acancel_admission(self, holder: str = "") -> Awaitable[None]:
        return self._submit(self._lua.cancel, [held_as(holder, self.session)])

    @outage_is_fatal
    def release(self, holder: str) -> int:
        held = held_as(holder, self.session)
        self._heartbeat.drop(held)
        return int(self._lua.release(keys=self._admit_keys, args=[held]))

    @outage_is_fatal
    def put(self, group: Group, holder: str = "") -> None:
        self._lua.put(keys=self._put_keys, args=put_args(group, holder, self.session, 0))

    def aput(self, group: Group, holder: str = "") -> Awaitable[None]:
        return self._submit(self._lua.put, put_args(group, holder, self.session, 0))

    @outage_is_fatal
    def put_and_admit(self, group: Group, holder: str = "") -> bool:
        reply = self._lua.put(keys=self._put_keys, args=self._put_admit_args(group, holder))
        return admitted(reply, 0)

    def aput_and_admit(self, group: Group, holder: str = "") -> Awaitable[bool]:
        return self._submit(self._lua.put, self._put_admit_args(group, holder))

    def _admit_args(self, holder: str, n: int) -> list[Any]:
        """ADMIT's arguments; from here on this client's heartbeat renews the holder's lease."""
        held = held_as(holder, self.session)
        self._heartbeat.hold(held)
        return [held, n, self.lease_ttl_s]

    def _put_admit_args(self, group: Group, holder: str) -> list[Any]:
        """A put that claims the holder's next slot, leased like ``_admit_args``'s."""
        self._heartbeat.hold(held_as(holder, self.session))
        return put_args(group, holder, self.session, self.lease_ttl_s)

    def _beat(self, renew: list[str]) -> None:
        """Renew the leases of ``renew`` and reclaim the slots of holders whose lease is not
        live (one LEASE script), logging each reclaim."""
        reply = self._lua.lease(keys=self._admit_keys, args=[self.lease_ttl_s, *renew])
        for holder, slots in zip(reply[::2], reply[1::2]):
            if int(slots):
                log.warning("buffer %s: reclaimed %d admission slot(s) of holder %s: its "
                            "lease expired (its process stopped renewing it: it died, or "
                            "stalled past buffer.lease_ttl_s)", self.run, int(slots),
                            text(holder))

    def _writer(self, loop: asyncio.AbstractEventLoop) -> LoopWriter:
        return LoopWriter(loop, connect_async(self.url, self.outage_s), self._send, self.run,
                          redact_url(self.url))

    def _submit(self, script: Script, args: list[Any]) -> asyncio.Future[Any]:
        """Queue one script call for this event loop's writer; the call is under way when this
        returns (cancelling the returned future does not withdraw it)."""
        return self._writers.get().submit(script, args)

    async def _send(self, client: redis.asyncio.Redis, calls: list[Call]) -> None:
        """Send ``calls`` in one pipeline (consecutive puts as one PUT call) and settle each
        call's future with its result or error."""
        put = self._lua.put
        commands: list[tuple[Script, list[Any], list[Call]]] = []
        for call in calls:
            if (call.script is put and commands and commands[-1][0] is put
                    and len(commands[-1][2]) < PUT_BATCH):
                commands[-1][1].extend(call.args)
                commands[-1][2].append(call)
            else:
                commands.append((call.script, list(call.args), [call]))
        try:
            for attempt in (1, 2):
                packed = []
                for script, args, _ in commands:
                    keys = self._put_keys if script is put else self._admit_keys
                    packed.append(("EVALSHA", script.sha, len(keys), *keys, *args))
                replies = await exchange(client, packed)
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
            error: Exception = outage_error(self.url, self.outage_s, exc)
        except Exception as exc:  # handed to every caller
            error = exc
        for _, _, waiting in commands:
            for call in waiting:
                if not call.future.done():
                    call.future.set_exception(error)

    def _settle(self, script: Script, calls: list[Call], reply: Any) -> None:
        """Give each call of one command its result (a caller that was cancelled has none)."""
        if isinstance(reply, Exception) and script is self._lua.cancel:
            reply = ValueError(str(reply))
        for i, call in enumerate(calls):
            if call.future.done():
                continue
            if isinstance(reply, Exception):
                call.future.set_exception(reply)
            elif script is self._lua.put:
                call.future.set_result(admitted(reply, i) if call.args[5] else None)
            else:
                call.future.set_result(bool(reply) if script is self._lua.admit
                                       else int(reply) if script is self._lua.admit_many
                                       else None)

    # -- learner --------------------------------------------------------------------------
    @outage_is_fatal
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
                try:
                    read = self._read(n - len(self._held), block if block > 0 else None,
                                      learner_version)
                except redis.ResponseError as exc:
                    if not _keys_gone(exc):
                        raise
                    self._recreate(learner_version)
                    continue
                for eid, fields, counted in read:
                    entry = self._decode(eid, fields, counted)
                    if entry is not None and self._keep(entry, learner_version):
                        self._held.append(entry)
                if len(self._held) >= n:
                    break
                self._reap()
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
                self._lua.consume(keys=[self.keys.stats, self.keys.queued, self.keys.taken,
                                        self.keys.minv], args=args)
                self._published = learner_version  # CONSUME raised it too
            self._consumed += len(batch)
        batch.sort(key=lambda e: (sys.maxsize if e.oldest is None else e.oldest, e.eid))
        return [entry.group for entry in batch]

    def _reap(self) -> None:
        """While the learner waits: reclaim the slots of dead holders (at most once every
        ``REAP_EVERY_S``), which may be what it waits for."""
        now = time.monotonic()
        if now >= self._next_reap:
            self._next_reap = now + REAP_EVERY_S
            self._beat([])

    def _read(self, count: int, block_ms: int | None, learner_version: int
              ) -> list[tuple[bytes, Fields | None, bool]]:
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
        reply, ids = exchange_now(self._r, [  # XREADGROUP, then TAKE counts what it read
            ("XREADGROUP", "GROUP", CONSUMER_GROUP, self.consumer, "COUNT", count,
             "STREAMS", k.groups, ">"),
            ("EVALSHA", self._lua.take.sha, len(take_keys), *take_keys, *args)])
        if isinstance(reply, Exception):
            raise reply
        counted = set(script_result(self._lua.take, take_keys, args, ids))
        self._published = max(self._published, learner_version)
        entries = self._seeing(stream_entries(reply))
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
            if id_order(eid) > id_order(self._seen):
                self._seen = eid
        return entries

    def _decode(self, eid: bytes, fields: Fields | None, counted: bool) -> Entry | None:
        """Decode one entry (``wire.decode_entry``); skipped or malformed entries are acked
        here and yield None. ``counted``: TAKE counted it as consumed already."""
        gid = group_id(fields)
        if gid and gid in self._skip:
            self._discard_entry(eid, "skipped", "already trained (skip_ids)")
            return None
        try:
            return decode_entry(eid, fields, counted)
        except MalformedEntry as exc:
            self._discard_entry(eid, "malformed", str(exc))
            return None

    def _keep(self, entry: Entry, learner_version: int) -> bool:
        refused = newer_than_learner(entry.group, entry.newest, learner_version, entry.holder)
        if refused is not None:
            self._refusals.note(entry.holder, f"entry {text(entry.eid)}: {refused}")
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
            log.warning("buffer %s: %s entry %s: %s", self.run, kind, text(eid), reason)
        k = self.keys
        self._lua.discard(
            keys=[k.stats, k.queued, k.taken, k.groups, k.dead, k.minv],
            args=[eid, kind, reason, CONSUMER_GROUP],
        )

    @outage_is_fatal
    def ack(self, group_ids: list[str]) -> None:
        with self._lock:
            unknown = [gid for gid in group_ids if gid not in self._outstanding]
            if unknown:
                raise ValueError(f"ack: group ids not taken or already acked: {unknown}")
            eids = [self._outstanding.pop(gid) for gid in group_ids]
            if not eids:
                return
            keys = [self.keys.stats, self.keys.taken, self.keys.groups]
            args = [CONSUMER_GROUP, int(self.trim_acked), *eids]
            try:
                self._run_now(self._lua.ack, keys, args)
            except redis.ResponseError as exc:
                if not _keys_gone(exc):
                    raise
                # The entries went with the keys: acking them in the new stream is a no-op.
                self._recreate(max(self._published, 0))
                self._run_now(self._lua.ack, keys, args)

    def _recreate(self, learner_version: int) -> None:
        """The run's keys are gone (Redis restarted empty: no persistence; or they were
        deleted): make them again as a rebase from what this learner knows (``learner_version``,
        the groups it consumed), so admission reopens within the bound, and warn once with what
        was lost: the groups queued there as of the last stats read. Groups in flight are put as
        they finish (a put without admission takes a fresh slot); groups this learner holds
        (read or taken) stay here. Called with ``_lock`` held."""
        # Of the last stats' queued groups, those read and not yet counted are held here.
        lost = max(0, self._last_stats.queued - sum(not e.counted for e in self._held))
        self._init_keys()  # the consumer group from id 0: groups put since are delivered
        self._held = [entry._replace(counted=False) for entry in self._held]  # count them anew
        self._recover_from, self._claim_from, self._seen = None, b"0-0", b"0-0"
        b, eta = self.admission.groups_per_step, self.admission.max_staleness
        k = self.keys
        queued, *_ = self._lua.rebase(keys=[k.stats, k.queued, k.taken, k.holders, k.leases],
                                      args=[learner_version, self._consumed, b, eta])
        self._published = learner_version
        # produced - consumed - queued - dropped balances again; ``lost`` says what did not.
        self._r.hset(k.stats, mapping={"produced": self._consumed + int(queued), "lost": lost})
        if self._endpoint is not None:
            self._r.hset(k.stats, "bus_endpoint", self._endpoint)
        log.warning(
            "buffer %s: the run's keys are gone from Redis at %s (it restarted empty, without "
            "persistence, or they were deleted); re-created them at learner version %d with %d "
            "group(s) consumed: lost the %d group(s) queued there as of the last stats read "
            "(groups in flight are put as they finish)", self.run, redact_url(self.url),
            learner_version, self._consumed, lost)

    def _run_now(self, script: Script, keys: list[str], args: list[Any]) -> Any:
        """``script(keys, args)`` on the learner's thread, in one round trip without redis-py's
        command bookkeeping (``exchange_now``); an error reply is raised."""
        (reply,) = exchange_now(self._r, [("EVALSHA", script.sha, len(keys), *keys, *args)])
        return script_result(script, keys, args, reply)

    @outage_is_fatal
    def set_version(self, learner_version: int) -> None:
        try:
            self._publish(learner_version, strict=True)
        except redis.ResponseError as exc:
            raise ValueError(str(exc)) from exc

    def _publish(self, learner_version: int, strict: bool) -> None:
        stored = self._lua.set_version(keys=[self.keys.stats], args=[learner_version, int(strict)])
        self._published = max(self._published, int(stored))

    @outage_is_fatal
    def _rebase(self, learner_version: int, consumed: int, skip_ids: set[str]) -> None:
        """This learner claims every pending entry, acks the ones in ``skip_ids`` and requeues
        the rest; the admissions of holders with a live lease are kept, the others dropped.
        Call it from the only live learner."""
        with self._lock:
            self._skip |= skip_ids
            cursor: bytes = b"0-0"
            while True:
                cursor, *_ = self._r.xautoclaim(
                    self.keys.groups, CONSUMER_GROUP, self.consumer, 0,
                    start_id=cursor, count=1000,  # (redis-py drops the cursor with JUSTID)
                )
                if text(cursor) == "0-0":
                    break
            start = b"0"
            while got := self._xreadgroup(start, 1000, None):
                for eid, fields in got:
                    if group_id(fields) in self._skip:
                        self._discard_entry(eid, "skipped", "already trained (skip_ids)")
                start = got[-1][0]
            self._held, self._outstanding = [], {}
            self._recover_from, self._claim_from = b"0", b"0-0"
            self._published = learner_version
            self._consumed = consumed
            b, eta = self.admission.groups_per_step, self.admission.max_staleness
            k = self.keys
            _, kept, live, dropped, gone = self._lua.rebase(
                keys=[k.stats, k.queued, k.taken, k.holders, k.leases],
                args=[learner_version, consumed, b, eta],
            )
            if kept or dropped:
                log.info("buffer %s: rebase kept %d admission slot(s) of %d live holder(s) "
                         "and dropped %d of %d holder(s) that are gone", self.run, kept, live,
                         dropped, gone)

    @outage_is_fatal
    def stats(self) -> BufferStats:
        self._last_stats = read_stats(self._r, self.keys)
        return self._last_stats

    @outage_is_fatal
    def announce_bus(self, endpoint: str) -> None:
        """Record the trainer's weight-bus endpoint: a ``streamrl serve`` process sharing this
        run connects its replicas to it (and reconnects when a restarted trainer announces a
        new one)."""
        self._endpoint = endpoint  # announced again if Redis loses the run's keys
        self._r.hset(self.keys.stats, "bus_endpoint", endpoint)

    @outage_is_fatal
    def bus_endpoint(self) -> str | None:
        value = self._r.hget(self.keys.stats, "bus_endpoint")
        return text(value) if value is not None else None

    def purge(self) -> None:
        """Delete every key of this run (tests, benchmarks, starting a run name afresh)."""
        self._r.delete(*dataclasses.astuple(self.keys))
        self._published = -1
        self._seen = b"0-0"

    def close(self) -> None:
        """Send the queued awaitable replica calls (waiting up to ``outage_s`` plus the read
        timeout; calls still unsent then fail, each with an error its caller sees), end this
        client's leases (slots its holders still hold are reclaimed by the next heartbeat or
        waiting learner), then disconnect. Called on the writer's own loop, it cannot wait: the
        writer disconnects once its queue is sent. The buffer stays usable: a later call
        reconnects, and a later admission leases again."""
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
        if leased := self._heartbeat.stop():
            try:
                self._r.zrem(self.keys.leases, *leased)
            except redis.RedisError as exc:  # closing must not fail for it: they expire
                log.warning("buffer %s: could not end this client's leases (%s); they expire "
                            "in buffer.lease_ttl_s=%g s", self.run, exc, self.lease_ttl_s)
        self._r.close()

    async def aclose(self) -> None:
        """``close`` for an event loop that made awaitable replica calls, from that loop: waits
        for the calls it queued (without blocking the loop), then disconnects its writer. The
        sync client and other loops' writers are ``close``'s."""
        writer = self._writers.pop()
        if writer is not None:
            await writer.aclose(self.outage_s + READ_TIMEOUT_S)


def _keys_gone(exc: redis.ResponseError) -> bool:
    """Whether a learner call failed because the run's stream or consumer group is gone."""
    message = str(exc)  # a blocked read whose stream is deleted is unblocked with the second
    return "NOGROUP" in message or "no longer exists" in message


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
