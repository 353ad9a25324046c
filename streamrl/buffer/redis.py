"""Redis replay buffer (``buffer.backend=redis``): shared by processes and machines, inspectable.

Parts: the key layout (``RunKeys``), ``RedisBuffer`` (the ``ReplayBuffer`` backend) and
``print_stats`` (behind ``streamrl buffer stats``). The Lua scripts that keep every counter
atomic with the data it describes live in ``redis_scripts`` (this module registers them).

Keys of run ``<run>``::

    streamrl:<run>:groups  stream, one msgspec-msgpack ``Group`` per entry (fields group_id,
                           min_version, data); consumer group ``learners``, created at init
    streamrl:<run>:stats   hash: learner_version produced consumed queued started in_flight
                           dropped malformed staleness_mean staleness_max staleness_sum
                           staleness_count groups_per_step max_staleness last_update_ts
                           bus_endpoint (the trainer's weight-bus endpoint, for streamrl serve)
    streamrl:<run>:holders hash: admissions in flight per holder (replica incarnation)
    streamrl:<run>:dead    stream, malformed entries (source_id, reason, original fields)
    streamrl:<run>:ids     set, every group_id ever put (put is idempotent)
    streamrl:<run>:queued  set, entry ids put and not yet taken (queued = SCARD)
    streamrl:<run>:taken   set, entry ids taken and not yet acked

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
their id; they never reach, nor crash, the learner. Decoding is msgspec, never pickle.

Acked entries are trimmed from the head of the stream (XTRIM MINID, never XDEL, which would make
XINFO's ``lag`` unknown), so a long-running service keeps only its backlog.

Round trips (tests/buffer/test_redis_buffer.py counts them): ``try_admit``, ``put``,
``cancel_admission``, ``set_version`` and ``ack`` (XACK and trim) are one script each; a
``take`` of ready entries is one XREADGROUP COUNT n plus the counting script, and also publishes
its learner version first when it is newer than the one this buffer stored, and polls XAUTOCLAIM
at most once a second.
"""

from __future__ import annotations

import functools
import io
import logging
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

import streamrl.buffer.redis_scripts as lua
from streamrl.buffer.base import Admission, BufferStats, ReplayBuffer
from streamrl.errors import ConfigError, RunStopped
from streamrl.types import DecodeError, Group, decode, encode

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])

CONSUMER_GROUP = "learners"
_RUN_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
_POLL_MS = 1000  # longest single XREADGROUP block: recovery and claims are checked between
CONNECT_TIMEOUT_S = 5.0
RETRY_BACKOFF_CAP_S = 1.0


def _outage_is_fatal(method: F) -> F:
    """A Redis that stays unreachable longer than the client's retries (``outage_s``) stops
    the run with one line naming the URL, instead of a redis-py traceback."""
    @functools.wraps(method)
    def wrapper(self: RedisBuffer, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise RunStopped(f"buffer.redis_url={self._url!r}: Redis unreachable for "
                             f"buffer.redis_outage_s={self.outage_s:g} ({exc})") from None
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

    @classmethod
    def of(cls, run: str) -> RunKeys:
        if not _RUN_RE.match(run):
            raise ConfigError(f"buffer.run={run!r}: use letters, digits, '_', '.', '-' only")
        p = f"streamrl:{run}:"
        return cls(p + "groups", p + "stats", p + "dead", p + "ids", p + "queued", p + "taken",
                   p + "holders")


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _Entry(NamedTuple):
    """A decoded stream entry the learner holds or has returned."""

    eid: bytes
    group: Group
    oldest: int | None
    """``group.min_version``, read from the entry's field: PUT wrote it from the same group in
    the same XADD, and scanning every token's version again costs more than the decode."""

    def staleness(self, learner_version: int) -> int:
        return 0 if self.oldest is None else learner_version - self.oldest


class RedisBuffer(ReplayBuffer):
    """``ReplayBuffer`` over one Redis stream + consumer group (see the module docstring).

    Replicas (any process) call ``try_admit`` / ``put``; one learner process (consumer name
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
        self._release = s(lua.RELEASE)
        self._set_version, self._consume = s(lua.SET_VERSION), s(lua.CONSUME)
        self._discard, self._ack, self._rebase = s(lua.DISCARD), s(lua.ACK), s(lua.REBASE)
        self._lock = threading.Lock()  # learner-side state below
        self._skip: set[str] = set(skip_ids)
        self._held: list[_Entry] = []  # read, fresh, not yet returned
        self._outstanding: dict[str, bytes] = {}  # group_id -> entry id: returned, not acked
        self._recover_from: bytes | None = b"0"  # read own pending entries first (crash restart)
        self._claim_from: bytes = b"0-0"
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
    @_outage_is_fatal
    def try_admit(self, holder: str = "") -> bool:
        return bool(self._admit(keys=[self.keys.stats, self.keys.holders], args=[holder]))

    @_outage_is_fatal
    def cancel_admission(self, holder: str = "") -> None:
        try:
            self._cancel(keys=[self.keys.stats, self.keys.holders], args=[holder])
        except redis.ResponseError as exc:
            raise ValueError(str(exc)) from exc

    @_outage_is_fatal
    def release(self, holder: str) -> int:
        return int(self._release(keys=[self.keys.stats, self.keys.holders], args=[holder]))

    @_outage_is_fatal
    def put(self, group: Group, holder: str = "") -> None:
        if not isinstance(group, Group):
            raise TypeError(f"put: expected a Group, got {type(group).__name__}")
        oldest = group.min_version
        self._put(
            keys=[self.keys.stats, self.keys.ids, self.keys.groups, self.keys.queued,
                  self.keys.holders],
            args=[group.group_id, -1 if oldest is None else oldest, encode(group), holder,
                  producer(holder)],
        )

    # -- learner --------------------------------------------------------------------------
    @_outage_is_fatal
    def take(self, n: int, learner_version: int, timeout: float | None = None) -> list[Group]:
        if n <= 0:
            raise ValueError(f"take: n={n} must be > 0")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            if learner_version > self._published:  # before waiting: it opens admission
                self._publish(learner_version, strict=False)
            while True:
                self._held = [e for e in self._held if self._keep(e, learner_version)]
                if len(self._held) >= n:
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                block = _POLL_MS if remaining is None else min(_POLL_MS, int(remaining * 1000))
                for eid, fields in self._read(n - len(self._held), block if block > 0 else None):
                    entry = self._admit_entry(eid, fields)
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
                args += [entry.eid, entry.staleness(learner_version)]
                self._outstanding[entry.group.group_id] = entry.eid
            self._consume(keys=[self.keys.stats, self.keys.queued, self.keys.taken], args=args)
            self._published = max(self._published, learner_version)  # CONSUME raised it too
        batch.sort(key=lambda e: (sys.maxsize if e.oldest is None else e.oldest, e.eid))
        return [entry.group for entry in batch]

    def _read(self, count: int, block_ms: int | None) -> list[tuple[bytes, dict]]:
        """Next entries for this consumer: own pending after a restart, claims, then new ones."""
        known = set(self._outstanding.values()) | {entry.eid for entry in self._held}
        while self._recover_from is not None:
            raw = self._xreadgroup(self._recover_from, count, None)
            self._recover_from = raw[-1][0] if raw else None
            got = [(eid, f) for eid, f in raw if eid not in known]
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
            claimed = [(eid, f) for eid, f in claimed if eid not in known]
            if claimed:
                log.warning("buffer %s: claimed %d unacked entries of a vanished learner",
                            self.run, len(claimed))
                return claimed
        return self._xreadgroup(b">", count, block_ms)

    def _xreadgroup(self, start: bytes, count: int, block_ms: int | None) -> list:
        reply = self._r.xreadgroup(
            CONSUMER_GROUP, self.consumer, {self.keys.groups: start}, count=count, block=block_ms
        )
        return list(reply[0][1]) if reply else []

    def _admit_entry(self, eid: bytes, fields: dict | None) -> _Entry | None:
        """Decode one entry (once); skipped or malformed entries are acked here and yield None."""
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
        return _Entry(eid, group, None if oldest == -1 else oldest)

    def _keep(self, entry: _Entry, learner_version: int) -> bool:
        staleness = entry.staleness(learner_version)
        if staleness <= self.admission.max_staleness:  # Admission.is_fresh, on the stored field
            return True
        reason = f"staleness {staleness} > {self.admission.max_staleness}"
        self._discard_entry(entry.eid, "dropped", reason)
        return False

    def _discard_entry(self, eid: bytes, kind: str, reason: str) -> None:
        if kind != "skipped":
            log.warning("buffer %s: %s entry %s: %s", self.run, kind, _s(eid), reason)
        k = self.keys
        self._discard(
            keys=[k.stats, k.queued, k.taken, k.groups, k.dead],
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
                self._ack(keys=[self.keys.stats, self.keys.taken, self.keys.groups],
                          args=[CONSUMER_GROUP, int(self.trim_acked), *eids])

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
        self._r.delete(k.groups, k.stats, k.dead, k.ids, k.queued, k.taken, k.holders)
        self._published = -1

    def close(self) -> None:
        self._r.close()


def _connect(url: str, outage_s: float = 60.0) -> redis.Redis:
    """A client for ``url`` that has answered a PING: a wrong or unreachable buffer.redis_url
    fails here within ``CONNECT_TIMEOUT_S``, as one ConfigError. Later, every command retries
    connection failures for about ``outage_s`` (a restarted Redis is reconnected to)."""
    try:
        probe = redis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S)
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
    backoff = ExponentialBackoff(cap=RETRY_BACKOFF_CAP_S, base=0.05)
    retries, waited = 0, 0.0
    while waited < outage_s:  # as many retries as their backoffs take to add up to outage_s
        retries += 1
        waited += backoff.compute(retries)
    return redis.Redis.from_url(
        url, socket_connect_timeout=CONNECT_TIMEOUT_S, retry=Retry(backoff, retries),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError])


# --- `streamrl buffer stats` -------------------------------------------------------------------
_STAT_ROWS = ("learner_version", "groups_per_step", "max_staleness", "started", "produced",
              "consumed", "queued", "in_flight", "dropped", "malformed", "staleness_mean",
              "staleness_max")


def producer(holder: str) -> str:
    """The replica a holder name stands for: holders are ``<replica>.<incarnation>``, and the
    stats count per replica, across its restarts."""
    return holder.rpartition(".")[0] or holder


def watch_stats(redis_url: str, run: str, interval_s: float) -> int:
    """``print_stats`` every ``interval_s`` seconds, redrawn in place on a terminal, until
    Ctrl-C (0) or the first read that fails (1)."""
    redraw = sys.stdout.isatty()
    try:
        while True:
            frame = io.StringIO()
            code = print_stats(redis_url, run, file=frame)
            if code:
                return code
            print(("\x1b[H\x1b[2J" if redraw else "") + frame.getvalue(), end="", flush=True)
            time.sleep(interval_s)
    except KeyboardInterrupt:
        return 0


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
