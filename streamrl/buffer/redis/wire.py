"""What the Redis buffer stores, and in what form: the keys of a run (``RunKeys``) and the
stream entries of groups, written (``put_args``) and read back (``decode_entry``, ``Entry``).

An entry's fields: ``group_id``, ``min_version`` (-1: none; lets the TAKE script check a batch
without reading its data), ``data`` (the ``Group``, msgspec MessagePack: decoding never runs
code) and ``holder`` (who put it). Depends on base and types.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, NamedTuple

from streamrl.buffer.base import expect_group
from streamrl.errors import ConfigError
from streamrl.types import DecodeError, Group, decode, encode

CONSUMER_GROUP = "learners"
_RUN_RE = re.compile(r"^[A-Za-z0-9_.-]+$")

Fields = dict[bytes, bytes]


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
    leases: str

    @classmethod
    def of(cls, run: str) -> RunKeys:
        if not _RUN_RE.match(run):
            raise ConfigError(f"buffer.run={run!r}: use letters, digits, '_', '.', '-' only")
        p = f"streamrl:{run}:"
        return cls(p + "groups", p + "stats", p + "dead", p + "ids", p + "queued", p + "taken",
                   p + "holders", p + "minv", p + "leases")


def text(value: Any) -> str:
    """A reply value (bytes, or a number) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


def producer(holder: str) -> str:
    """The replica a holder name stands for: holders are ``<replica>.<incarnation>``, and the
    stats count per replica, across its restarts."""
    return holder.rpartition(".")[0] or holder


def held_as(holder: str, session: str) -> str:
    """How Redis counts ``holder``'s admissions: under its name and its client's session, so
    ``replica-0.0`` of a restarted trainer is not taken for the one that died with the previous
    trainer, nor two ``streamrl serve`` processes (both admit as "") for one another."""
    return f"{holder}@{session}"


def put_args(group: Group, holder: str, session: str, lease_s: float) -> list[Any]:
    """The PUT script's six arguments for one group (encoded here, on the caller's thread);
    ``lease_s`` > 0 also claims the holder's next slot, leased for that long."""
    oldest = expect_group(group).min_version
    return [group.group_id, -1 if oldest is None else oldest, encode(group),
            held_as(holder, session), producer(holder), lease_s]


def id_order(eid: bytes) -> tuple[int, int]:
    """A stream entry id (``<ms>-<seq>``) as numbers, for ordering."""
    ms, _, seq = eid.partition(b"-")
    return int(ms), int(seq or 0)


def stream_entries(reply: Any) -> list[tuple[bytes, Fields | None]]:
    """A raw one-stream XREADGROUP reply (RESP3: a map of stream to entries; RESP2: a list of
    [stream, entries]) as (entry id, fields) pairs; fields None: the entry was deleted."""
    if not reply:
        return []
    (entries,) = reply.values() if isinstance(reply, dict) else (s[1] for s in reply)
    return [(eid, None if f is None else dict(zip(f[::2], f[1::2]))) for eid, f in entries]


def group_id(fields: Fields | None) -> str:
    """The entry's ``group_id`` field ("" when it has none, or was deleted)."""
    return text(fields.get(b"group_id", b"")) if fields else ""


class Entry(NamedTuple):
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


class MalformedEntry(ValueError):
    """A stream entry that is no group: garbage bytes, a wrong type, missing fields."""


def decode_entry(eid: bytes, fields: Fields | None, counted: bool) -> Entry:
    """The entry ``eid`` decoded (once); ``MalformedEntry`` saying why it is not a group.
    ``counted``: TAKE counted it as consumed already."""
    if not fields:
        raise MalformedEntry("entry was deleted from the stream")
    data = fields.get(b"data")
    if data is None:
        raise MalformedEntry("no 'data' field")
    try:
        group = decode(data, Group)
    except DecodeError as exc:
        raise MalformedEntry(str(exc)) from None
    gid = group_id(fields)
    if group.group_id != gid:
        raise MalformedEntry(f"group_id field {gid!r} != {group.group_id!r}")
    try:
        oldest: int | None = int(fields[b"min_version"])
    except (KeyError, ValueError):  # an entry that bypassed PUT: read it from the tokens
        oldest = group.min_version
    return Entry(eid, group, None if oldest == -1 else oldest, group.max_version,
                 text(fields.get(b"holder", b"")), counted)
