"""Episodes of ``streamrl serve``: exact token records of client conversations (DESIGN.md §10).

A client names its episode on every call. The store keeps, per episode, one or more *segments*:
a segment is one growing token sequence, exactly as for an agent episode of the rollout fleet
(agent/loop.py): the first prompt's ids, then each call's sampled ids (loss_mask 1, the
engine's log-probs and per-token versions) and, between calls, the chat-template delta of the
messages the client added (loss_mask 0, version -1). History is never decoded and re-encoded.

A call *continues* the current segment when its messages are the segment's messages (the ones
rendered so far, including the assistant turns the service returned) plus new non-assistant
messages, with the same tools; anything else (edited history, a retried call, other tools)
starts a new segment, counted.

Calls on one episode run one at a time: a call while another is running is refused
(``EpisodeError`` 409), since both would extend the same segment. A call carrying a request
key (the service's ``Idempotency-Key``) that the episode already answered gets that answer
back (``replay``) instead of a second turn; each episode keeps its last ``RESULTS_KEPT``.

Lifecycle: ``begin`` (the first call of an unknown episode takes an admission slot: the same
staleness bound as training; refused -> ``AtCapacity``, the service's 429) -> ``commit`` after
each sampled call -> ``close`` (reward, optional group id and size, optional per-turn rewards)
turns the episode's segments into Trajectories; episodes sharing a group id become one Group
once ``group_size`` episodes closed (or ``group_timeout_s`` after the first close), an episode
without a group id is a group of one. ``expire`` drops episodes idle past their TTL and marks
timed-out groups due. ``close`` validates everything before it changes anything.

Buffer I/O never runs inside these methods: they only record what is owed (groups due to be
put, slots to give back), and ``settle`` does it with the buffer's awaitable calls, so a slow
or failing buffer (Redis) never blocks the event loop. A put that fails keeps its group (same
group id, so a retried put is deduplicated by the buffer); ``close`` of an already closed
episode returns its first answer, so a client retries a close until the put went through.
``flush`` (shutdown) puts with blocking calls.

Admission is counted in groups, as the buffer counts them. An episode that *declares* its group
when it opens (``X-Group-Id``) shares the slot its group's first episode took, so a client
running n episodes per task needs one slot per task; an episode that declares nothing takes a
slot of its own, and a group of k such episodes gives k-1 back when it is put. A slot whose
episodes all expire, or that never reach the buffer, is given back. Limits: at most
``max_group_size`` episodes per declared group (its ``group_size`` once known) and
``max_episodes_per_client`` open episodes per client (429).

Depends on types.py, the buffer protocol and agent/render.py; no HTTP, no Ray (unit-testable).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import takewhile
from typing import Any

from streamrl.buffer.base import BufferProducer
from streamrl.rollout_fleet.agent.render import ChatRenderer
from streamrl.rollout_fleet.engine import Completion
from streamrl.types import OBSERVATION_VERSION, Group, Trajectory, fits_float32, new_uid

log = logging.getLogger(__name__)

DATA_SOURCE = "serve"
RESULTS_KEPT = 8
"""Answers per episode a retried call (same request key) can get back."""
CLOSED_KEPT = 10_000
"""Closed episodes whose close answer a repeated close gets back (least recent dropped)."""


class AtCapacity(Exception):
    """Opening an episode now would pass the staleness bound (HTTP 429)."""


class EpisodeError(ValueError):
    """A request about an episode that cannot be honoured (HTTP 400 / 404 / 409 / 429)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class BufferUnavailable(Exception):
    """The buffer refused a put after its own retries (HTTP 503); the group is kept."""


def canonical(message: dict[str, Any]) -> str:
    """A message as the chat template sees it, for comparing what the client sends back with
    what was rendered: role, text, tool calls (arguments parsed), tool call id and name. Fields
    the template ignores (``refusal``, ``annotations``, null ``audio``...) do not matter."""
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts: the text parts, in order
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        args = fn.get("arguments")
        if isinstance(args, str):
            with contextlib.suppress(ValueError):  # compared as the text it is
                args = json.loads(args)
        calls.append([fn.get("name"), args])
    return json.dumps([message.get("role"), content or "", calls, message.get("tool_call_id"),
                       message.get("name")], sort_keys=True, default=str)


@dataclass
class Segment:
    prompt_ids: list[int]
    messages: list[str]
    """Canonical form of every message rendered so far (the client's and the returned turns)."""
    tools_key: str
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)
    """Offset just past each call's sampled ids in response_ids."""
    last_turn: list[int] = field(default_factory=list)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids


@dataclass
class Episode:
    episode_id: str
    declared_group: str | None = None
    """The group named when the episode opened (shares that group's admission slot)."""
    slot: bool = False
    """Holds an admission slot (its own, or its declared group's)."""
    client: str = ""
    segments: list[Segment] = field(default_factory=list)
    last_used: float = 0.0
    calls: int = 0
    busy: bool = False
    """A call is running: the next one waits for its answer (409 meanwhile)."""
    results: OrderedDict[str, tuple[str, Any]] = field(default_factory=OrderedDict)
    """Request key -> (request fingerprint, answer) of its last calls."""


@dataclass
class Call:
    """One call's plan: sample from ``prompt_ids``; ``commit`` records it."""

    episode: Episode
    segment: Segment
    prompt_ids: list[int]
    delta: list[int]
    """Observation ids appended before the call's sampled ids (continuations only)."""
    new_messages: list[str]
    key: tuple[str, str] | None = None
    """(request key, request fingerprint): ``commit`` keeps the answer under it."""

    @property
    def episode_id(self) -> str:
        return self.episode.episode_id


@dataclass
class _PendingGroup:
    group_id: str
    size: int | None
    first_close: float
    trajectories: list[Trajectory] = field(default_factory=list)
    episodes: int = 0
    slots: int = 0
    """Admission slots its closed episodes brought (the put keeps one)."""
    due: bool = False
    """Complete or timed out: put once it holds a slot and no declared member is open."""
    group: Group | None = None
    """Built at the first put attempt and kept (same id), so a retried put is deduplicated;
    from then on the group takes no more episodes."""
    putting: asyncio.Future[Any] | None = None


@dataclass
class StoreCounters:
    episodes_opened: int = 0
    episodes_closed: int = 0
    episodes_expired: int = 0
    episodes_dropped: int = 0
    """Open at shutdown (never rewarded) or closed with no sampled call."""
    segments_rewritten: int = 0
    groups_put: int = 0
    groups_timed_out: int = 0
    trajectories_put: int = 0
    admission_refused: int = 0
    put_failures: int = 0
    calls_replayed: int = 0


class EpisodeStore:
    def __init__(
        self,
        buffer: BufferProducer,
        renderer: ChatRenderer,
        *,
        ttl_s: float,
        group_timeout_s: float,
        max_group_size: int | None = None,
        max_episodes_per_client: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.buffer = buffer
        self.renderer = renderer
        self.ttl_s = ttl_s
        self.group_timeout_s = group_timeout_s
        self.max_group_size = max_group_size
        """Episodes one declared group may gather before its group_size is known (None: any)."""
        self.max_episodes_per_client = max_episodes_per_client
        self.clock = clock
        self.episodes: OrderedDict[str, Episode] = OrderedDict()
        """Open episodes, least recently used first (``expire`` stops at the first fresh one)."""
        self._members: dict[str, dict[str, Episode]] = {}
        """Open episodes by declared group (slot checks look at one group, not every episode)."""
        self._clients: dict[str, int] = {}
        """Open episodes per client (entries at 0 are dropped)."""
        self.groups: dict[str, _PendingGroup] = {}
        self.closed: OrderedDict[str, dict[str, Any]] = OrderedDict()
        """Recently closed episodes -> their close answer (a repeated close gets it back)."""
        self._owed = 0
        """Admission slots to give back at the next ``settle``."""
        self.counters = StoreCounters()

    # -- calls --------------------------------------------------------------------------------

    def begin_chat(self, episode_id: str, messages: Sequence[dict[str, Any]],
                   tools: Sequence[dict[str, Any]] | None, group_id: str | None = None,
                   slot: bool = False, client: str = "",
                   key: tuple[str, str] | None = None) -> Call:
        """Plan a chat call: continue the episode's segment or start one (see module doc).
        ``key``: (request key, fingerprint) under which ``commit`` keeps the answer."""
        if not messages:
            self._owed += slot  # a slot handed in is always held or owed back
            raise EpisodeError("messages: must hold at least one message")
        canon = [canonical(m) for m in messages]
        tools_key = json.dumps(list(tools or []), sort_keys=True, default=str)
        episode = self._episode(episode_id, group_id, slot, client)
        seg = episode.segments[-1] if episode.segments else None
        if seg is not None and self._continues(seg, canon, tools_key, messages):
            new = list(messages[len(seg.messages):])
            delta = self.renderer.observation(new, seg.last_turn)
            call = Call(episode, seg, seg.ids + delta, delta, canon[len(seg.messages):], key)
        else:
            ids = self.renderer.prompt(list(messages), list(tools) if tools else None)
            call = self._new_segment(episode, Segment(ids, [], tools_key), canon, key)
        episode.busy = True
        return call

    def begin_tokens(self, episode_id: str, prompt_ids: list[int], group_id: str | None = None,
                     slot: bool = False, client: str = "",
                     key: tuple[str, str] | None = None) -> Call:
        """Plan a completions call: token ids that extend the segment's ids continue it."""
        if not prompt_ids:
            self._owed += slot
            raise EpisodeError("prompt: is empty")
        episode = self._episode(episode_id, group_id, slot, client)
        seg = episode.segments[-1] if episode.segments else None
        call = None
        if seg is not None and seg.last_turn:
            done = seg.ids
            if len(prompt_ids) > len(done) and prompt_ids[:len(done)] == done:
                call = Call(episode, seg, list(prompt_ids), list(prompt_ids[len(done):]), [],
                            key)
        if call is None:
            call = self._new_segment(episode, Segment(list(prompt_ids), [], "tokens"), [], key)
        episode.busy = True
        return call

    def replay(self, episode_id: str, key: tuple[str, str]) -> Any:
        """The answer an open episode gave the call with this request key, or None. The same
        key on another request is refused: it would silently answer the wrong question."""
        episode = self.episodes.get(episode_id)
        hit = episode.results.get(key[0]) if episode is not None else None
        if hit is None:
            return None
        if hit[0] != key[1]:
            raise EpisodeError(f"Idempotency-Key: {key[0]!r} already answered another request "
                               f"of episode {episode_id!r}; use a new key per call")
        self.counters.calls_replayed += 1
        return hit[1]

    def commit(self, call: Call, completion: Completion, assistant: dict[str, Any] | None,
               answer: Any = None) -> None:
        """Record a finished call: the delta (masked) and the sampled ids, log-probs, versions;
        ``answer`` is kept under the call's request key."""
        episode, seg = call.episode, call.segment
        episode.busy = False
        if self.episodes.get(episode.episode_id) is not episode or seg not in episode.segments:
            return  # closed or expired while sampling: nothing to record into
        n = len(call.delta)
        seg.response_ids += call.delta + list(completion.token_ids)
        seg.loss_mask += [0] * n + [1] * len(completion.token_ids)
        seg.logprobs += [0.0] * n + list(completion.logprobs)
        seg.versions += [OBSERVATION_VERSION] * n + list(completion.versions)
        seg.turn_ends.append(len(seg.response_ids))
        seg.last_turn = list(completion.token_ids)
        seg.messages += call.new_messages
        if assistant is not None:
            seg.messages.append(canonical(assistant))
        if call.key is not None:
            episode.results[call.key[0]] = (call.key[1], answer)
            while len(episode.results) > RESULTS_KEPT:
                episode.results.popitem(last=False)
        episode.calls += 1
        self._touch(episode)

    def abandon(self, call: Call) -> None:
        """The call failed: the segment stays as it was, free for the next call."""
        call.episode.busy = False

    # -- closing ------------------------------------------------------------------------------

    def close(self, episode_id: str, reward: float, group_id: str | None = None,
              group_size: int | None = None, turn_rewards: Sequence[float] | None = None
              ) -> dict[str, Any]:
        """Close an episode (its group is put by the next ``settle``); returns a summary. Every
        check comes first: a refused close changes nothing. An episode closed already gets its
        first summary back (its group may still be waiting to be put)."""
        episode = self.episodes.get(episode_id)
        if episode is None and episode_id in self.closed:
            return self.closed[episode_id]
        if not fits_float32(reward):
            raise EpisodeError(f"reward: {reward} is not finite in float32 (the learner's "
                               "reward tensors)")
        if group_size is not None and group_size < 1:
            raise EpisodeError(f"group_size: {group_size} must be >= 1")
        if episode is None:
            raise EpisodeError(f"episode {episode_id!r} is not open (never opened, already "
                               "closed long ago, or expired)", status=404)
        if episode.busy:
            raise EpisodeError(f"episode {episode_id!r} has a call still running", status=409)
        declared = episode.declared_group
        if declared is not None and group_id not in (None, declared):
            raise EpisodeError(f"group_id: {group_id!r}, but episode {episode_id!r} opened in "
                               f"group {declared!r}")
        group_id = group_id if group_id is not None else declared
        segments = [s for s in episode.segments if s.turn_ends]
        turns = sum(len(s.turn_ends) for s in segments)
        if turn_rewards is not None:
            if len(turn_rewards) != turns:
                raise EpisodeError(f"turn_rewards: has {len(turn_rewards)} values, episode "
                                   f"{episode_id!r} has {turns} calls")
            if not all(map(fits_float32, turn_rewards)):
                raise EpisodeError("turn_rewards: holds a value not finite in float32")
        pending = self.groups.get(group_id) if group_id is not None else None
        if pending is not None:
            self._check_joins(pending, group_size)

        self._remove(episode)
        self.counters.episodes_closed += 1
        gid = group_id if group_id is not None else new_uid()
        if pending is None:
            pending = self.groups[gid] = _PendingGroup(
                gid, group_size if group_id is not None else 1, self.clock())
        elif pending.size is None:
            pending.size = group_size
        pending.episodes += 1
        pending.slots += self._release(episode)
        per_turn = iter(turn_rewards or [])
        for k, seg in enumerate(segments):
            pending.trajectories.append(self._trajectory(
                episode, seg, k, reward, [next(per_turn) for _ in seg.turn_ends]
                if turn_rewards is not None else None))
        if not segments:
            self.counters.episodes_dropped += 1
        pending.due = pending.due or (pending.size is not None and pending.episodes >= pending.size)
        summary = {"episode_id": episode_id, "group_id": gid, "trajectories": len(segments),
                   "group_complete": pending.due}
        self.closed[episode_id] = summary
        while len(self.closed) > CLOSED_KEPT:
            self.closed.popitem(last=False)
        return summary

    @staticmethod
    def _check_joins(pending: _PendingGroup, group_size: int | None) -> None:
        gid = pending.group_id
        if pending.group is not None:
            raise EpisodeError(f"group {gid!r} is complete and being put in the buffer; retry "
                               "the close once it is in, or close under another group_id",
                               status=409)
        if group_size is None:
            return
        if pending.size is not None and pending.size != group_size:
            raise EpisodeError(f"group_size: {group_size} but group {gid!r} was opened with "
                               f"size {pending.size}")
        if pending.size is None and group_size <= pending.episodes:
            raise EpisodeError(f"group_size: {group_size} but group {gid!r} already has "
                               f"{pending.episodes} closed episodes")

    def expire(self) -> None:
        """Drop episodes idle past the TTL; mark groups waiting past the group timeout due."""
        now = self.clock()
        # Least recently used first: the idle ones are a prefix.
        for episode in list(takewhile(lambda e: now - e.last_used > self.ttl_s,
                                      self.episodes.values())):
            if not episode.busy:
                self._remove(episode)
                self.counters.episodes_expired += 1
                self._expire_slot(episode)
        for pending in self.groups.values():
            if now - pending.first_close > self.group_timeout_s and not pending.due:
                self.counters.groups_timed_out += 1
                pending.due = True

    async def settle(self, group_id: str | None = None) -> None:
        """Do the buffer I/O owed, off the event loop: put due groups (``group_id``: that one
        only), then give slots back. Raises ``BufferUnavailable`` when a put fails after the
        buffer's retries; the group stays, and the next ``settle`` tries it again."""
        ready = [p for p in self.groups.values()
                 if (group_id is None or p.group_id == group_id) and self._ready(p)]
        failed: list[str] = []
        for pending in ready:
            if self.groups.get(pending.group_id) is not pending:
                continue  # put meanwhile by a concurrent settle
            try:
                await self._aput(pending)
            except BufferUnavailable as exc:
                failed.append(str(exc))
        await self.give_back()
        if failed:
            raise BufferUnavailable("; ".join(failed))

    @property
    def owes(self) -> bool:
        return self._owed > 0

    def owe(self, slots: int) -> None:
        """Slots claimed for this store that no episode holds (given back by ``give_back``)."""
        self._owed += slots

    async def give_back(self) -> None:
        """Give the owed admission slots back (a failure keeps them owed for the next try)."""
        while self._owed:
            self._owed -= 1
            try:
                await self.buffer.acancel_admission()
            except Exception:
                self._owed += 1
                log.warning("serve: giving an admission slot back failed; retrying later",
                            exc_info=True)
                return

    def flush(self) -> None:
        """Shutdown: put every group that has trajectories; open episodes give slots back. Blocking
        buffer calls: the server has stopped."""
        self.counters.episodes_dropped += len(self.episodes)
        for episode in list(self.episodes.values()):
            self._remove(episode)
            self._expire_slot(episode)
        for pending in list(self.groups.values()):
            pending.due = True
            if not self._ready(pending):
                continue
            group = self._group_of(pending)
            try:
                if group is not None:
                    self.buffer.put(group)
            except Exception:
                log.exception("serve: shutdown: group %s (%d trajectories) could not be put",
                              pending.group_id, len(pending.trajectories))
                continue
            self._put_done(pending)
        try:
            while self._owed:
                self.buffer.cancel_admission()
                self._owed -= 1
        except Exception:
            log.exception("serve: shutdown: %d admission slots could not be given back",
                          self._owed)

    @property
    def open_episodes(self) -> int:
        return len(self.episodes)

    # -- internals ----------------------------------------------------------------------------

    def wants_slot(self, episode_id: str, group_id: str | None, client: str = "") -> bool:
        """Whether a call would open an episode that needs an admission slot of its own (the
        service takes it off the event loop first and passes ``slot=True``). Raises what
        opening would (a busy episode, a full group, a client at its limit) before any slot
        is taken."""
        episode = self.episodes.get(episode_id)
        if episode is not None:
            self._check_idle(episode)
            return False
        self._check_open(group_id, client)
        return not self._group_holds_slot(group_id)

    def _episode(self, episode_id: str, group_id: str | None, slot: bool,
                 client: str) -> Episode:
        """The open episode, opening it if new. ``slot``: the caller already took an admission
        slot for it; it ends up held by the new episode or owed back (not needed any more, or
        the call refused), exactly once."""
        try:
            episode = self.episodes.get(episode_id)
            if episode is not None:
                self._check_idle(episode)
                if group_id not in (None, episode.declared_group):
                    raise EpisodeError(f"group id {group_id!r}: episode {episode_id!r} opened "
                                       f"in group {episode.declared_group!r}")
            else:
                self._check_open(group_id, client)
            needed = episode is None and not self._group_holds_slot(group_id)
            if needed and not slot and not self.buffer.try_admit():
                self.counters.admission_refused += 1
                raise AtCapacity(episode_id)
        except BaseException:
            self._owed += slot
            raise
        if slot and not needed:
            self._owed += 1
        if episode is None:
            episode = Episode(episode_id, group_id, needed, client)
            self.episodes[episode_id] = episode
            if group_id is not None:
                self._members.setdefault(group_id, {})[episode_id] = episode
            self._clients[client] = self._clients.get(client, 0) + 1
            self.closed.pop(episode_id, None)  # the id names a new episode now
            self.counters.episodes_opened += 1
        self._touch(episode)
        return episode

    @staticmethod
    def _check_idle(episode: Episode) -> None:
        if episode.busy:
            raise EpisodeError(
                f"episode {episode.episode_id!r}: a call is still running; calls of one episode "
                "go one at a time (retry after it answers; a retry with the same "
                "Idempotency-Key gets that answer)", status=409)

    def _check_open(self, group_id: str | None, client: str) -> None:
        limit = self.max_episodes_per_client
        if limit is not None and self._clients.get(client, 0) >= limit:
            raise EpisodeError(
                f"client {client or '?'}: {limit} episodes open (serve.max_episodes_per_client);"
                " close some (POST /v1/episodes/{id}/reward) or wait for them to expire",
                status=429)
        if group_id is None:
            return
        pending = self.groups.get(group_id)
        if pending is not None and pending.due:
            raise EpisodeError(f"X-Group-Id: group {group_id!r} is complete or timed out; "
                               "open this episode in a new group")
        size = pending.size if pending is not None and pending.size else self.max_group_size
        count = len(self._members.get(group_id, {})) + (pending.episodes if pending else 0)
        if size is not None and count >= size:
            what = ("its group_size" if pending is not None and pending.size
                    else "serve.max_group_size")
            raise EpisodeError(f"X-Group-Id: group {group_id!r} already has {count} episodes "
                               f"({what}={size})")

    def _touch(self, episode: Episode) -> None:
        episode.last_used = self.clock()
        self.episodes.move_to_end(episode.episode_id)

    def _remove(self, episode: Episode) -> None:
        del self.episodes[episode.episode_id]
        left = self._clients[episode.client] - 1
        if left:
            self._clients[episode.client] = left
        else:
            del self._clients[episode.client]
        group = episode.declared_group
        if group is not None:
            members = self._members[group]
            del members[episode.episode_id]
            if not members:
                del self._members[group]

    def _group_holds_slot(self, group_id: str | None) -> bool:
        """Whether declared group ``group_id`` holds an admission slot: through an open episode,
        or, once its open episodes all closed, through its pending (not yet put) entry. A member
        that opens late (its first calls were refused at the bound, and it retried after its
        siblings finished) joins that slot; taking another would deadlock a full buffer, the
        group waiting for the member and the member for a slot."""
        if group_id is None:
            return False
        pending = self.groups.get(group_id)
        return (pending is not None and pending.slots > 0) or any(
            e.slot for e in self._members.get(group_id, {}).values())

    def _release(self, episode: Episode) -> int:
        """The slot a closing episode holds, handed to its group (0 or 1). A declared group's
        slot stays with its open members; it goes to the pending group with the last one."""
        if not episode.slot:
            return 0
        episode.slot = False
        heir = self._heir(episode)
        if heir is not None:
            heir.slot = True
            return 0
        return 1

    def _expire_slot(self, episode: Episode) -> None:
        """An episode left without closing: its slot goes to an open member of its declared
        group, else to the group's pending entry, else back to the buffer."""
        if not episode.slot:
            return
        episode.slot = False
        heir = self._heir(episode)
        pending = self.groups.get(episode.declared_group or "")
        if heir is not None:
            heir.slot = True
        elif pending is not None:
            pending.slots += 1
        else:
            self._owed += 1

    def _heir(self, episode: Episode) -> Episode | None:
        if episode.declared_group is None:
            return None
        return next((e for e in self._members.get(episode.declared_group, {}).values()
                     if e is not episode), None)

    @staticmethod
    def _continues(seg: Segment, canon: list[str], tools_key: str,
                   messages: Sequence[dict[str, Any]]) -> bool:
        n = len(seg.messages)
        return (bool(seg.last_turn) and tools_key == seg.tools_key
                and len(canon) > n and canon[:n] == seg.messages
                and all(m.get("role") != "assistant" for m in messages[n:]))

    def _new_segment(self, episode: Episode, seg: Segment, canon: list[str],
                     key: tuple[str, str] | None) -> Call:
        if any(s.turn_ends for s in episode.segments):
            self.counters.segments_rewritten += 1
        episode.segments = [s for s in episode.segments if s.turn_ends]
        episode.segments.append(seg)
        return Call(episode, seg, list(seg.prompt_ids), [], canon, key)

    def _trajectory(self, episode: Episode, seg: Segment, index: int, reward: float,
                    turn_rewards: list[float] | None) -> Trajectory:
        token_rewards = None
        total = reward
        if turn_rewards is not None:
            token_rewards = [0.0] * len(seg.response_ids)
            for end, r in zip(seg.turn_ends, turn_rewards):
                token_rewards[end - 1] += r
            token_rewards[-1] += reward
            total = reward + sum(turn_rewards)
        return Trajectory(
            uid=new_uid(), group_id="", prompt_ids=seg.prompt_ids,
            response_ids=seg.response_ids, loss_mask=seg.loss_mask, logprobs=seg.logprobs,
            versions=seg.versions, reward=total, token_rewards=token_rewards,
            finish_reason="stop", data_source=DATA_SOURCE,
            extra={"episode": {"id": episode.episode_id, "segment": index,
                               "turns": len(seg.turn_ends)}},
        )

    def _ready(self, pending: _PendingGroup) -> bool:
        """A due group goes to the buffer once it holds its slot (a declared group's slot stays
        with its open members) and no declared member is still open (it would be left out)."""
        return pending.due and pending.slots > 0 and pending.group_id not in self._members

    def _group_of(self, pending: _PendingGroup) -> Group | None:
        """The group to put (built once: its id is kept for retries); None when no episode of
        it sampled anything."""
        if pending.group is None and pending.trajectories:
            uid = new_uid()  # buffer ids must be unique across clients and runs
            for t in pending.trajectories:
                t.group_id = uid
                t.extra["group"] = pending.group_id
            pending.group = Group(group_id=uid, trajectories=pending.trajectories,
                                  created_ts=time.time())
        return pending.group

    async def _aput(self, pending: _PendingGroup) -> None:
        """Put one group with the buffer's awaitable call; concurrent settles share one put."""
        if pending.putting is None:
            group = self._group_of(pending)
            if group is None:
                self._put_done(pending)
                return
            pending.putting = asyncio.ensure_future(self.buffer.aput(group))
            pending.putting.add_done_callback(lambda f: self._after_put(pending, f))
        try:
            # Shielded: a caller that goes away does not cancel the put under way.
            await asyncio.shield(pending.putting)
        except Exception as exc:
            raise BufferUnavailable(
                f"buffer: putting group {pending.group_id!r} failed after the buffer's retries "
                f"({type(exc).__name__}: {exc}); its episodes are kept: retry the close"
            ) from exc

    def _after_put(self, pending: _PendingGroup, put: asyncio.Future[Any]) -> None:
        pending.putting = None
        if put.cancelled() or put.exception() is not None:
            self.counters.put_failures += 1
            return
        self._put_done(pending)

    def _put_done(self, pending: _PendingGroup) -> None:
        """The group is in the buffer (or had nothing to put): drop it, give extra slots back.
        A no-op the second time (the shutdown flush may race an upkeep put)."""
        if self.groups.get(pending.group_id) is not pending:
            return
        del self.groups[pending.group_id]
        if pending.group is None:
            self._owed += pending.slots
            return
        self._owed += pending.slots - 1
        self.counters.groups_put += 1
        self.counters.trajectories_put += len(pending.trajectories)
