"""The Redis buffer's stats: ``read_stats`` (the stats hash as ``BufferStats``) and
``print_stats`` / ``watch_stats`` (behind ``streamrl buffer stats``: the hash, each replica's
production and lag, the holders of admission slots and their leases, and the consumer group's
lag). Depends on base, logs (the URL is printed with its password masked) and wire.
"""

from __future__ import annotations

import io
import signal
import sys
import time
from typing import Any

import redis

from streamrl.buffer.base import Admission, BufferStats
from streamrl.buffer.redis.wire import CONSUMER_GROUP, RunKeys, text
from streamrl.logs import redact_url

_STAT_ROWS = ("learner_version", "groups_per_step", "max_staleness", "started", "produced",
              "consumed", "queued", "in_flight", "dropped", "refused", "malformed",
              "reclaimed", "lost", "staleness_mean", "staleness_max")


def stats_hash(client: redis.Redis, keys: RunKeys) -> dict[str, str]:
    return {text(k): text(v) for k, v in client.hgetall(keys.stats).items()}


def read_stats(client: redis.Redis, keys: RunKeys) -> BufferStats:
    h = stats_hash(client, keys)
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
        reclaimed=int(h.get("reclaimed", 0)),
        staleness_mean=float(h.get("staleness_mean", 0.0)),
        staleness_max=int(h.get("staleness_max", 0)),
        last_update_ts=float(h.get("last_update_ts", 0.0)),
    )


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
    shown = redact_url(redis_url)
    try:
        keys = RunKeys.of(run)
        client = redis.Redis.from_url(redis_url, socket_connect_timeout=3, socket_timeout=10)
        stats = stats_hash(client, keys)
        if not stats:
            print(f"streamrl buffer stats: no buffer for run {run!r} at {shown} "
                  f"(key {keys.stats} does not exist)", file=sys.stderr)
            return 1
        groups = client.xinfo_groups(keys.groups) if client.exists(keys.groups) else []
        consumers = (client.xinfo_consumers(keys.groups, CONSUMER_GROUP)
                     if any(text(g["name"]) == CONSUMER_GROUP for g in groups) else [])
        dead = client.xlen(keys.dead)
        holders = {text(k): int(v) for k, v in client.hgetall(keys.holders).items()}
        leases = {text(k): float(v) for k, v in
                  client.zrange(keys.leases, 0, -1, withscores=True)}
        now = client.time()
    except (redis.RedisError, ValueError) as exc:
        print(f"streamrl buffer stats: cannot read {shown} (run {run!r}): "
              f"{redact_url(str(exc))}", file=sys.stderr)
        return 1
    v, b, eta = (int(stats.get(f, 0)) for f in ("learner_version", "groups_per_step",
                                                 "max_staleness"))
    capacity = Admission(max(b, 1), eta).capacity(v)
    started = int(stats.get("started", 0))
    ts = float(stats.get("last_update_ts", 0.0))
    print(f"streamrl buffer  run={run}  {shown}", file=out)
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
    if holders:
        redis_now = now[0] + now[1] / 1e6
        print("  holder                                    slots  lease", file=out)
        for name, slots in sorted(holders.items()):
            until = leases.get(name)
            lease = "none" if until is None else (
                f"{until - redis_now:.0f} s left" if until > redis_now else "expired")
            print(f"  {name:<40} {slots:>6}  {lease}", file=out)
        print("", file=out)
    header = ("consumer_group", "lag", "pending", "consumers", "last_delivered_id")
    table = [header] + [
        (text(g["name"]), "?" if g.get("lag") is None else text(g["lag"]), text(g["pending"]),
         text(g["consumers"]), text(g["last-delivered-id"]))
        for g in groups
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip(), file=out)
    for c in consumers:
        print(f"    consumer {text(c['name'])}: pending {c['pending']}, idle {c['idle']} ms",
              file=out)
    return 0
