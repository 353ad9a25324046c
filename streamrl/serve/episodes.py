"""Episodes of ``streamrl serve``: exact token records of client conversations (DESIGN.md §10).

A client names its episode on every call. The store keeps, per episode, one or more *segments*:
a segment is one growing token sequence, exactly as for an agent episode of the rollout fleet
(agent/loop.py): the first prompt's ids, then each call's sampled ids (loss_mask 1, the
engine's log-probs and per-token versions) and, between calls, the chat-template delta of the
messages the client added (loss_mask 0, version -1). History is never decoded and re-encoded.

A call *continues* the current segment when its messages are the segment's messages (the ones
rendered so far, including the assistant turns the service returned) plus new non-assistant
messages, with the same tools; anything else (edited history, a retried call, other tools, a
call while the previous one is still running) starts a new segment, counted.

Lifecycle: ``begin`` (the first call of an unknown episode takes an admission slot: the same
staleness bound as training; refused -> ``AtCapacity``, the service's 429) -> ``commit`` after
each sampled call -> ``close`` (reward, optional group id and size, optional per-turn rewards)
turns the episode's segments into Trajectories; episodes sharing a group id become one Group
once ``group_size`` episodes closed (or ``group_timeout_s`` after the first close), an episode
without a group id is a group of one. ``expire`` drops episodes idle past their TTL and flushes
timed-out groups.

Admission is counted in groups, as the buffer counts them. An episode that *declares* its group
when it opens (``X-Group-Id``) shares the slot its group's first episode took, so a client
running n episodes per task needs one slot per task; an episode that declares nothing takes a
slot of its own, and a group of k such episodes gives k-1 back when it is put. A slot whose
episodes all expire, or that never reach the buffer, is given back.

Depends on types.py, the buffer protocol and agent/render.py; no HTTP, no Ray (unit-testable).
"""

from __future__ import annotations

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


class AtCapacity(Exception):
    """Opening an episode now would pass the staleness bound (HTTP 429)."""


class EpisodeError(ValueError):
    """A request about an episode that cannot be honoured (HTTP 400 / 404 / 409)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


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
    busy: bool = False

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
    segments: list[Segment] = field(default_factory=list)
    last_used: float = 0.0
    calls: int = 0


@dataclass
class Call:
    """One call's plan: sample from ``prompt_ids``; ``commit`` records it."""

    episode_id: str
    segment: Segment
    prompt_ids: list[int]
    delta: list[int]
    """Observation ids appended before the call's sampled ids (continuations only)."""
    new_messages: list[str]


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
    """Complete or timed out: put as soon as it holds a slot."""


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


class EpisodeStore:
    def __init__(
        self,
        buffer: BufferProducer,
        renderer: ChatRenderer,
        *,
        ttl_s: float,
        group_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.buffer = buffer
        self.renderer = renderer
        self.ttl_s = ttl_s
        self.group_timeout_s = group_timeout_s
        self.clock = clock
        self.episodes: OrderedDict[str, Episode] = OrderedDict()
        """Open episodes, least recently used first (``expire`` stops at the first fresh one)."""
        self._members: dict[str, dict[str, Episode]] = {}
        """Open episodes by declared group (slot checks look at one group, not every episode)."""
        self.groups: dict[str, _PendingGroup] = {}
        self.counters = StoreCounters()

    # -- calls --------------------------------------------------------------------------------

    def begin_chat(self, episode_id: str, messages: Sequence[dict[str, Any]],
                   tools: Sequence[dict[str, Any]] | None, group_id: str | None = None,
                   slot: bool = False) -> Call:
        """Plan a chat call: continue the episode's segment or start one (see module doc)."""
        if not messages:
            raise EpisodeError("messages: must hold at least one message")
        canon = [canonical(m) for m in messages]
        tools_key = json.dumps(list(tools or []), sort_keys=True, default=str)
        episode = self._episode(episode_id, group_id, slot)
        seg = episode.segments[-1] if episode.segments else None
        if seg is not None and self._continues(seg, canon, tools_key, messages):
            new = list(messages[len(seg.messages):])
            delta = self.renderer.observation(new, seg.last_turn)
            return Call(episode_id, seg, seg.ids + delta, delta, canon[len(seg.messages):])
        ids = self.renderer.prompt(list(messages), list(tools) if tools else None)
        return self._new_segment(episode, Segment(ids, [], tools_key), canon)

    def begin_tokens(self, episode_id: str, prompt_ids: list[int], group_id: str | None = None,
                     slot: bool = False) -> Call:
        """Plan a completions call: token ids that extend the segment's ids continue it."""
        if not prompt_ids:
            raise EpisodeError("prompt: is empty")
        episode = self._episode(episode_id, group_id, slot)
        seg = episode.segments[-1] if episode.segments else None
        if seg is not None and not seg.busy and seg.last_turn:
            done = seg.ids
            if len(prompt_ids) > len(done) and prompt_ids[:len(done)] == done:
                delta = list(prompt_ids[len(done):])
                return Call(episode_id, seg, list(prompt_ids), delta, [])
        return self._new_segment(episode, Segment(list(prompt_ids), [], "tokens"), [])

    def commit(self, call: Call, completion: Completion, assistant: dict[str, Any] | None
               ) -> None:
        """Record a finished call: the delta (masked) and the sampled ids, log-probs, versions."""
        seg = call.segment
        seg.busy = False
        episode = self.episodes.get(call.episode_id)
        if episode is None or seg not in episode.segments:
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
        episode.calls += 1
        self._touch(episode)

    def abandon(self, call: Call) -> None:
        """The call failed: the segment stays as it was, free for the next call."""
        call.segment.busy = False

    # -- closing ------------------------------------------------------------------------------

    def close(self, episode_id: str, reward: float, group_id: str | None = None,
              group_size: int | None = None, turn_rewards: Sequence[float] | None = None
              ) -> dict[str, Any]:
        """Close an episode into the buffer (possibly waiting for its group); returns a summary."""
        if not fits_float32(reward):
            raise EpisodeError(f"reward: {reward} is not finite in float32 (the learner's "
                               "reward tensors)")
        if group_size is not None and group_size < 1:
            raise EpisodeError(f"group_size: {group_size} must be >= 1")
        episode = self.episodes.get(episode_id)
        if episode is None:
            raise EpisodeError(f"episode {episode_id!r} is not open (never opened, already "
                               "closed, or expired)", status=404)
        if any(s.busy for s in episode.segments):
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
        self._remove(episode)
        self.counters.episodes_closed += 1
        gid = group_id if group_id is not None else new_uid()
        pending = self.groups.get(gid)
        if pending is None:
            pending = self.groups[gid] = _PendingGroup(
                gid, group_size if group_id is not None else 1, self.clock())
        elif group_size is not None and pending.size not in (None, group_size):
            raise EpisodeError(f"group_size: {group_size} but group {gid!r} was opened with "
                               f"size {pending.size}")
        pending.episodes += 1
        pending.slots += self._release(episode)
        per_turn = iter(turn_rewards or [])
        for k, seg in enumerate(segments):
            pending.trajectories.append(self._trajectory(
                episode, seg, k, reward, [next(per_turn) for _ in seg.turn_ends]
                if turn_rewards is not None else None))
        if not segments:
            self.counters.episodes_dropped += 1
        pending.due = pending.size is not None and pending.episodes >= pending.size
        self._maybe_put(pending)
        return {"episode_id": episode_id, "group_id": gid, "trajectories": len(segments),
                "group_complete": pending.due}

    def expire(self) -> None:
        """Drop episodes idle past the TTL; put groups waiting past the group timeout."""
        now = self.clock()
        # Least recently used first: the idle ones are a prefix.
        for episode in list(takewhile(lambda e: now - e.last_used > self.ttl_s,
                                      self.episodes.values())):
            if not any(s.busy for s in episode.segments):
                self._remove(episode)
                self.counters.episodes_expired += 1
                self._expire_slot(episode)
        for pending in list(self.groups.values()):
            if now - pending.first_close > self.group_timeout_s and not pending.due:
                self.counters.groups_timed_out += 1
                pending.due = True
            self._maybe_put(pending)

    def flush(self) -> None:
        """Shutdown: put every group that has trajectories; open episodes give slots back."""
        self.counters.episodes_dropped += len(self.episodes)
        for episode in list(self.episodes.values()):
            self._remove(episode)
            self._expire_slot(episode)
        for pending in list(self.groups.values()):
            pending.due = True
            self._maybe_put(pending)

    @property
    def open_episodes(self) -> int:
        return len(self.episodes)

    # -- internals ----------------------------------------------------------------------------

    def wants_slot(self, episode_id: str, group_id: str | None) -> bool:
        """Whether a call would open an episode that needs an admission slot of its own (the
        service takes it off the event loop first and passes ``slot=True``)."""
        return episode_id not in self.episodes and not self._group_holds_slot(group_id)

    def _episode(self, episode_id: str, group_id: str | None, slot: bool) -> Episode:
        """The open episode, opening it if new. ``slot``: the caller already took an admission
        slot for it (given back if, meanwhile, it is not needed any more)."""
        episode = self.episodes.get(episode_id)
        needed = episode is None and not self._group_holds_slot(group_id)
        if slot and not needed:
            self._give_back(1)
        if episode is None:
            if needed and not slot and not self.buffer.try_admit():
                self.counters.admission_refused += 1
                raise AtCapacity(episode_id)
            episode = Episode(episode_id, group_id, needed)
            self.episodes[episode_id] = episode
            if group_id is not None:
                self._members.setdefault(group_id, {})[episode_id] = episode
            self.counters.episodes_opened += 1
        elif group_id not in (None, episode.declared_group):
            raise EpisodeError(f"group id {group_id!r}: episode {episode_id!r} opened in group "
                               f"{episode.declared_group!r}")
        self._touch(episode)
        return episode

    def _touch(self, episode: Episode) -> None:
        episode.last_used = self.clock()
        self.episodes.move_to_end(episode.episode_id)

    def _remove(self, episode: Episode) -> None:
        del self.episodes[episode.episode_id]
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
            self._maybe_put(pending)
        else:
            self._give_back(1)

    def _heir(self, episode: Episode) -> Episode | None:
        if episode.declared_group is None:
            return None
        return next((e for e in self._members.get(episode.declared_group, {}).values()
                     if e is not episode), None)

    @staticmethod
    def _continues(seg: Segment, canon: list[str], tools_key: str,
                   messages: Sequence[dict[str, Any]]) -> bool:
        n = len(seg.messages)
        return (not seg.busy and bool(seg.last_turn) and tools_key == seg.tools_key
                and len(canon) > n and canon[:n] == seg.messages
                and all(m.get("role") != "assistant" for m in messages[n:]))

    def _new_segment(self, episode: Episode, seg: Segment, canon: list[str]) -> Call:
        if episode.segments and any(s.turn_ends for s in episode.segments):
            self.counters.segments_rewritten += 1
        episode.segments = [s for s in episode.segments if s.turn_ends or s.busy]
        episode.segments.append(seg)
        seg.busy = True
        return Call(episode.episode_id, seg, list(seg.prompt_ids), [], canon)

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

    def _maybe_put(self, pending: _PendingGroup) -> None:
        """Put a due group once it holds its slot (a declared group's slot stays with its open
        members until the last one closes or expires)."""
        if pending.due and pending.slots:
            self._put(pending)

    def _put(self, pending: _PendingGroup) -> None:
        del self.groups[pending.group_id]
        if not pending.trajectories:  # no episode of it sampled anything
            self._give_back(pending.slots)
            return
        uid = new_uid()  # buffer ids must be unique across clients and runs
        for t in pending.trajectories:
            t.group_id = uid
            t.extra["group"] = pending.group_id
        self._give_back(pending.slots - 1)
        self.buffer.put(Group(group_id=uid, trajectories=pending.trajectories,
                              created_ts=time.time()))
        self.counters.groups_put += 1
        self.counters.trajectories_put += len(pending.trajectories)

    def _give_back(self, slots: int) -> None:
        for _ in range(slots):
            self.buffer.cancel_admission()
