"""Partial rollouts are part of the run's state: what a replica saves when it stops mid-generation
and picks up when it starts again (issue 44).

Parts:
- Wire types (msgspec, MessagePack; decoding never runs code): ``PartialSample`` (one sample's
  tokens so far with their behaviour log-probs and per-token versions), ``PartialGroup`` (a group
  in flight: its prompt, its group id, and each sample so far), ``PartialSnapshot`` (one
  replica's groups in flight and the prompt cursor *at the same instant*, so a resume neither
  skips nor repeats a prompt).
- ``PartialStore``: save / take one snapshot per replica. ``FilePartialStore`` (a directory:
  the run's ``partials/`` beside its checkpoints, written atomically) and ``RedisPartialStore``
  (a hash ``streamrl:<run>:partials``, one field per replica, with a TTL so snapshots of a run
  nobody resumes expire; ``pending`` leaves out the groups the Redis buffer holds already).
- ``usable``: what of a saved group may still be trained at the current learner version.

The replica (``replica.py``) records each sample's tokens whenever a request of it comes back
aborted, and resumes a saved sample exactly as it resumes one an abort-policy weight update
interrupted: prompt + tokens so far as the prompt, the token budget reduced by what was
sampled, the saved tokens keeping their log-probs and versions.

Dependencies: types.py (encode / decode); the Redis client is passed in.
"""

from __future__ import annotations

import abc
import os
import time
from pathlib import Path
from typing import Any

import msgspec

from streamrl.files import write_atomic
from streamrl.types import decode, encode

PARTIALS_TTL_S = 7 * 24 * 3600
"""How long Redis keeps a run's snapshots after their last save: a run resumed later than this
regenerates its in-flight groups."""


class PartialSample(msgspec.Struct, kw_only=True):
    """One sample of a group so far; ``finish_reason`` "abort" means it is not finished."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str = "abort"


class PartialGroup(msgspec.Struct, kw_only=True):
    """A group in flight. Its prompt fields make it a prompt (``replica.PromptLike``) too.
    ``samples`` None: nothing sampled is recorded (not started yet, or an agent group, whose
    episodes are not saved): the group starts again from its prompt, under the same id."""

    group_id: str
    index: int
    prompt_ids: list[int]
    data_source: str
    ground_truth: str | None
    extra: dict[str, Any] = msgspec.field(default_factory=dict)
    samples: list[PartialSample] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples or ())


class PartialSnapshot(msgspec.Struct, kw_only=True):
    replica: str
    cursor: int
    """The replica's prompt cursor at the snapshot: every prompt before it is in ``groups``, in
    the buffer, or done."""
    saved_ts: float
    groups: list[PartialGroup]

    @property
    def num_tokens(self) -> int:
        return sum(g.num_tokens for g in self.groups)


def usable(group: PartialGroup, learner_version: int, max_staleness: int
           ) -> PartialGroup | None:
    """``group`` as it may be resumed at ``learner_version``, or None when a token it keeps
    would be staler than ``max_staleness`` (the bound ``buffer.base.Admission.is_fresh``
    checks at take: staleness = V - oldest policy version): such tokens are dropped and the
    group starts again from its prompt. Tokens newer than the learner (sampled after the
    checkpoint it resumed from) are cut, with everything after them."""
    if not group.samples:
        return group
    samples = []
    for s in group.samples:
        keep = next((i for i, v in enumerate(s.versions) if v > learner_version),
                    len(s.versions))
        cut = keep < len(s.token_ids)
        samples.append(PartialSample(
            token_ids=s.token_ids[:keep], logprobs=s.logprobs[:keep], versions=s.versions[:keep],
            finish_reason="abort" if cut else s.finish_reason))
    oldest = min((v for s in samples for v in s.versions), default=learner_version)
    if learner_version - oldest > max_staleness:
        return None
    return msgspec.structs.replace(group, samples=samples)


class PartialStore(abc.ABC):
    """One snapshot per replica name: the latest ``save`` wins; ``take`` reads and removes it
    (a snapshot is resumed once: a later crash resumes from what the run saved after it)."""

    @abc.abstractmethod
    def save(self, snapshot: PartialSnapshot) -> None: ...

    @abc.abstractmethod
    def take(self, replica: str) -> PartialSnapshot | None: ...

    def pending(self, groups: list[PartialGroup]) -> list[PartialGroup]:
        """The saved ``groups`` not in the buffer yet. A group finished and put after its
        snapshot was saved must not be sampled again: its id is spent (a put is idempotent on
        it, so the copy's admission would never be settled). Files need no check: they serve
        the memory buffer, which a resumed trainer starts empty."""
        return groups


class FilePartialStore(PartialStore):
    """``<directory>/<replica>.msgpack``, replaced atomically (temp file, fsync, rename)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def _path(self, replica: str) -> Path:
        return self.directory / f"{replica}.msgpack"

    def save(self, snapshot: PartialSnapshot) -> None:
        data = encode(snapshot)  # before any file is touched: it may not encode
        self.directory.mkdir(parents=True, exist_ok=True)
        write_atomic(self._path(snapshot.replica), data)

    def take(self, replica: str) -> PartialSnapshot | None:
        path = self._path(replica)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        snapshot = decode(data, PartialSnapshot)
        path.unlink()
        return snapshot


class RedisPartialStore(PartialStore):
    """Hash ``streamrl:<run>:partials`` (field: replica name), expiring ``ttl_s`` after the
    last save. ``client``: a ``redis.Redis`` (``buffer.redis.connection.connect``);
    ``put_ids``: the buffer's set of every group id put (``RunKeys.ids``), which ``pending``
    checks (a flush is up to ``rollout.partial_flush_s`` older than the groups put since)."""

    def __init__(self, client: Any, run: str, ttl_s: int = PARTIALS_TTL_S,
                 put_ids: str | None = None) -> None:
        self.client = client
        self.key = f"streamrl:{run}:partials"
        self.ttl_s = ttl_s
        self.put_ids = put_ids

    def save(self, snapshot: PartialSnapshot) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(self.key, snapshot.replica, encode(snapshot))
        pipe.expire(self.key, self.ttl_s)
        pipe.execute()

    def take(self, replica: str) -> PartialSnapshot | None:
        pipe = self.client.pipeline(transaction=True)
        pipe.hget(self.key, replica)
        pipe.hdel(self.key, replica)
        data, _ = pipe.execute()
        return None if data is None else decode(data, PartialSnapshot)

    def pending(self, groups: list[PartialGroup]) -> list[PartialGroup]:
        if self.put_ids is None or not groups:
            return groups
        put = self.client.smismember(self.put_ids, [g.group_id for g in groups])
        return [g for g, was_put in zip(groups, put, strict=True) if not was_put]


def snapshot_of(replica: str, cursor: int, groups: list[PartialGroup]) -> PartialSnapshot:
    return PartialSnapshot(replica=replica, cursor=cursor, saved_ts=time.time(), groups=groups)
