"""EpisodeStore: exact token records across calls, segments, groups, admission, expiry.

Real parts: the tiny model's tokenizer and chat template, the memory buffer; completions are
built by hand (what an engine returned), so every id can be checked exactly.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from streamrl.buffer.memory import MemoryBuffer
from streamrl.rollout_fleet.agent.render import ChatRenderer
from streamrl.rollout_fleet.engine import Completion
from streamrl.serve.episodes import (
    RESULTS_KEPT,
    AtCapacity,
    BufferUnavailable,
    EpisodeError,
    EpisodeStore,
    canonical,
)
from streamrl.types import OBSERVATION_VERSION, Group


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def make_store(tokenizer, groups_per_step: int = 4, eta: int = 0, clock=None, **limits: Any):
    buffer = MemoryBuffer(groups_per_step, eta)
    store = EpisodeStore(buffer, ChatRenderer(tokenizer), ttl_s=60, group_timeout_s=30,
                         clock=clock or Clock(), **limits)
    return store, buffer


def close(store: EpisodeStore, episode_id: str, reward: float, **kw: Any) -> dict[str, Any]:
    """Close, then do the buffer I/O it owes (the service awaits ``settle`` the same way)."""
    summary = store.close(episode_id, reward, **kw)
    asyncio.run(store.settle())
    return summary


def expire(store: EpisodeStore) -> None:
    store.expire()
    asyncio.run(store.settle())


def sampled(tokenizer, text: str, version: int) -> Completion:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return Completion(ids, [-0.25] * len(ids), [version] * len(ids), "stop")


USER = {"role": "user", "content": "what is 2 + 3"}


def test_continued_calls_reuse_recorded_tokens_exactly(tokenizer):
    store, buffer = make_store(tokenizer, eta=1)  # the episode spans versions 3 and 4
    renderer = ChatRenderer(tokenizer)
    first = store.begin_chat("e1", [USER], None)
    assert first.prompt_ids == renderer.prompt([USER])
    c1 = sampled(tokenizer, "<think>add</think> the sum is 5", version=3)
    reply = {"role": "assistant", "content": "the sum is 5", "refusal": None}
    store.commit(first, c1, reply)

    # The client sends the conversation back (as the openai client does) plus a new message.
    tool = {"role": "user", "content": "and times 2"}
    second = store.begin_chat("e1", [USER, reply, tool], None)
    delta = renderer.observation([tool], c1.token_ids)
    assert second.prompt_ids == first.prompt_ids + c1.token_ids + delta  # nothing re-encoded
    c2 = sampled(tokenizer, "10", version=4)
    store.commit(second, c2, {"role": "assistant", "content": "10"})

    close(store, "e1", reward=1.0)
    (group,) = buffer.take(1, learner_version=4)
    (t,) = group.trajectories
    assert t.prompt_ids == first.prompt_ids
    assert t.response_ids == c1.token_ids + delta + c2.token_ids
    assert t.loss_mask == [1] * len(c1.token_ids) + [0] * len(delta) + [1] * len(c2.token_ids)
    assert t.versions == ([3] * len(c1.token_ids) + [OBSERVATION_VERSION] * len(delta)
                          + [4] * len(c2.token_ids))
    assert t.logprobs == [-0.25] * len(c1.token_ids) + [0.0] * len(delta) + [-0.25] * len(
        c2.token_ids)
    assert t.reward == 1.0 and t.extra["episode"] == {"id": "e1", "segment": 0, "turns": 2}
    assert store.counters.segments_rewritten == 0


def test_rewritten_history_starts_a_counted_segment(tokenizer):
    store, buffer = make_store(tokenizer)
    call = store.begin_chat("e", [USER], None)
    store.commit(call, sampled(tokenizer, "5", 1), {"role": "assistant", "content": "5"})
    # The client edits the assistant's answer: the recorded tokens no longer match the text.
    edited = [USER, {"role": "assistant", "content": "6"}, {"role": "user", "content": "ok"}]
    again = store.begin_chat("e", edited, None)
    assert again.prompt_ids == ChatRenderer(tokenizer).prompt(edited)
    assert store.counters.segments_rewritten == 1
    store.commit(again, sampled(tokenizer, "7", 1), {"role": "assistant", "content": "7"})
    # A retried call (the same messages as before the last answer) is a rewrite too.
    store.abandon(store.begin_chat("e", edited, None))
    assert store.counters.segments_rewritten == 2
    summary = close(store, "e", reward=0.5)
    assert summary["trajectories"] == 2  # both sampled segments are kept, same reward
    (group,) = buffer.take(1, learner_version=1)
    assert [t.extra["episode"]["segment"] for t in group.trajectories] == [0, 1]
    assert {t.reward for t in group.trajectories} == {0.5}


def test_other_tools_or_a_trailing_assistant_message_do_not_continue(tokenizer):
    store, _ = make_store(tokenizer)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    call = store.begin_chat("e", [USER], tools)
    store.commit(call, sampled(tokenizer, "5", 0), {"role": "assistant", "content": "5"})
    history = [USER, {"role": "assistant", "content": "5"}]
    store.abandon(store.begin_chat("e", [*history, {"role": "user", "content": "x"}], None))
    assert store.counters.segments_rewritten == 1
    call = store.begin_chat("e", [USER], tools)
    store.commit(call, sampled(tokenizer, "5", 0), {"role": "assistant", "content": "5"})
    store.begin_chat("e", [*history, {"role": "assistant", "content": "prefill"}], tools)
    assert store.counters.segments_rewritten == 3


def test_canonical_ignores_fields_the_template_does_not_render():
    ours = {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]}
    echoed = {"role": "assistant", "content": "", "refusal": None, "audio": None,
              "tool_calls": [{"id": "call_1", "type": "function",
                              "function": {"name": "add", "arguments": '{"b": 2, "a": 1}'}}]}
    assert canonical(ours) == canonical(echoed)
    assert canonical({**echoed, "content": "x"}) != canonical(ours)


def test_groups_close_when_complete_and_give_back_extra_slots(tokenizer):
    store, buffer = make_store(tokenizer, groups_per_step=4, eta=0)
    for i in range(3):
        call = store.begin_chat(f"e{i}", [USER], None)
        store.commit(call, sampled(tokenizer, str(i), 0), {"role": "assistant", "content": "x"})
    assert buffer.stats().started == 3  # one admission slot per open episode
    assert not close(store, "e0", 0.0, group_id="g", group_size=3)["group_complete"]
    assert not close(store, "e1", 1.0, group_id="g")["group_complete"]
    assert buffer.stats().queued == 0
    assert close(store, "e2", 2.0, group_id="g")["group_complete"]
    stats = buffer.stats()
    assert stats.queued == 1 and stats.started == 1  # the group holds one slot, as any group
    (group,) = buffer.take(1, learner_version=0)
    assert sorted(t.reward for t in group.trajectories) == [0.0, 1.0, 2.0]
    assert {t.extra["group"] for t in group.trajectories} == {"g"}
    # Closing again (a client retrying) gets the first answer; nothing more is put.
    assert close(store, "e0", 1.0)["group_id"] == "g"
    assert buffer.stats().queued == 0
    with pytest.raises(EpisodeError, match="not open"):
        close(store, "never", 1.0)


def test_close_checks_its_input(tokenizer):
    store, _ = make_store(tokenizer)
    call = store.begin_chat("e", [USER], None)
    with pytest.raises(EpisodeError, match="still running") as busy:
        close(store, "e", 1.0)
    assert busy.value.status == 409
    store.commit(call, sampled(tokenizer, "5", 0), {"role": "assistant", "content": "5"})
    with pytest.raises(EpisodeError, match=r"turn_rewards: has 2 values, .* has 1 calls"):
        close(store, "e", 1.0, turn_rewards=[0.1, 0.2])
    with pytest.raises(EpisodeError, match="group_size"):
        close(store, "e", 1.0, group_id="g", group_size=0)
    # 1e39 is a finite Python float, but inf in the learner's float32 tensors
    for bad in (float("nan"), 1e39):
        with pytest.raises(EpisodeError, match=r"reward: .* is not finite in float32"):
            close(store, "e", bad)
        with pytest.raises(EpisodeError, match="turn_rewards: holds a value not finite in"):
            close(store, "e", 1.0, turn_rewards=[bad])
    assert store.open_episodes == 1  # nothing lost by a refused close
    close(store, "e", 1.0, turn_rewards=[0.25])
    (group,) = store.buffer.take(1, learner_version=0)
    (t,) = group.trajectories
    assert t.reward == 1.25 and t.token_rewards is not None
    assert t.token_rewards[-1] == 1.25 and sum(t.token_rewards) == 1.25


def test_admission_bound_refuses_new_episodes_but_not_open_ones(tokenizer):
    store, buffer = make_store(tokenizer, groups_per_step=2, eta=0)  # 2 slots at version 0
    calls = [store.begin_chat(f"e{i}", [USER], None) for i in range(2)]
    with pytest.raises(AtCapacity):
        store.begin_chat("e2", [USER], None)
    assert store.counters.admission_refused == 1
    for call in calls:
        store.commit(call, sampled(tokenizer, "1", 0), {"role": "assistant", "content": "1"})
    # An open episode continues at the bound: it already holds its slot.
    more = [USER, {"role": "assistant", "content": "1"}, {"role": "user", "content": "go"}]
    store.abandon(store.begin_chat("e0", more, None))
    for i in range(2):
        close(store, f"e{i}", 1.0)
    buffer.take(2, learner_version=0)
    buffer.set_version(1)  # the learner moved on: two more slots
    store.begin_chat("e2", [USER], None)


def test_idle_episodes_expire_and_late_groups_are_put(tokenizer):
    clock = Clock()
    store, buffer = make_store(tokenizer, clock=clock)
    for i in range(2):
        call = store.begin_chat(f"e{i}", [USER], None)
        store.commit(call, sampled(tokenizer, "1", 0), {"role": "assistant", "content": "1"})
    close(store, "e0", 1.0, group_id="g", group_size=2)
    clock.now = 31.0  # past the group timeout, within the episode TTL
    expire(store)
    assert buffer.stats().queued == 1 and store.counters.groups_timed_out == 1
    assert store.open_episodes == 1
    clock.now = 100.0
    expire(store)
    assert store.open_episodes == 0 and store.counters.episodes_expired == 1
    assert buffer.stats().started == 1  # the expired episode gave its slot back


def test_an_episode_in_use_outlives_idle_ones_opened_after_it(tokenizer):
    """Expiry follows last use, not opening order (the store keeps episodes least recently used
    first and stops at the first fresh one)."""
    clock = Clock()
    store, _ = make_store(tokenizer, clock=clock)
    for i in range(3):
        store.commit(store.begin_chat(f"e{i}", [USER], None), sampled(tokenizer, "1", 0), None)
        clock.now += 1.0
    clock.now = 50.0
    store.commit(store.begin_chat("e0", [USER], None), sampled(tokenizer, "1", 0), None)
    clock.now = 63.0  # e1 and e2 idle 61-62 s (over the 60 s TTL), e0 13 s
    expire(store)
    assert list(store.episodes) == ["e0"] and store.counters.episodes_expired == 2


def test_flush_puts_closed_groups_and_frees_open_episodes(tokenizer):
    store, buffer = make_store(tokenizer)
    for i in range(3):
        call = store.begin_chat(f"e{i}", [USER], None)
        store.commit(call, sampled(tokenizer, "1", 0), {"role": "assistant", "content": "1"})
    close(store, "e0", 1.0, group_id="g", group_size=2)
    store.flush()
    stats = buffer.stats()
    assert stats.queued == 1 and stats.started == 1
    assert store.counters.episodes_dropped == 2


def test_token_prompts_continue_when_they_extend_the_record(tokenizer):
    store, buffer = make_store(tokenizer)
    first = store.begin_tokens("c", [5, 6, 7])
    store.commit(first, Completion([8, 9], [-1.0, -1.0], [2, 2], "stop"), None)
    second = store.begin_tokens("c", [5, 6, 7, 8, 9, 10, 11])
    assert second.delta == [10, 11]
    store.commit(second, Completion([12], [-1.0], [2], "length"), None)
    close(store, "c", 0.0)
    (group,) = buffer.take(1, learner_version=2)
    (t,) = group.trajectories
    assert t.prompt_ids == [5, 6, 7] and t.response_ids == [8, 9, 10, 11, 12]
    assert t.loss_mask == [1, 1, 0, 0, 1]


def test_a_declared_group_shares_one_admission_slot(tokenizer):
    clock = Clock()
    store, buffer = make_store(tokenizer, groups_per_step=1, eta=0, clock=clock)  # one slot
    calls = [store.begin_chat(f"e{i}", [USER], None, group_id="g") for i in range(3)]
    assert buffer.stats().started == 1  # three episodes, one group, one slot
    with pytest.raises(AtCapacity):
        store.begin_chat("other", [USER], None)
    for call in calls[1:]:
        store.commit(call, sampled(tokenizer, "1", 0), {"role": "assistant", "content": "1"})
    # The slot's first holder goes idle and expires: the slot passes to an open sibling.
    store.abandon(calls[0])
    clock.now = 61.0
    store.episodes["e1"].last_used = store.episodes["e2"].last_used = 60.0
    expire(store)
    assert store.counters.episodes_expired == 1 and buffer.stats().started == 1
    with pytest.raises(EpisodeError, match="opened in group 'g'"):
        close(store, "e1", 1.0, group_id="h")
    assert not close(store, "e1", 1.0, group_size=2)["group_complete"]  # the header's group
    assert buffer.stats().queued == 0  # the slot is still with e2
    assert close(store, "e2", 0.0)["group_complete"]
    stats = buffer.stats()
    assert stats.queued == 1 and stats.started == 1
    (group,) = buffer.take(1, learner_version=0)
    assert sorted(t.reward for t in group.trajectories) == [0.0, 1.0]


def test_a_group_member_opening_after_its_siblings_closed_joins_their_slot(tokenizer):
    """A client runs a group's episodes concurrently; at the bound their first calls get 429 and
    retry at different times, so one member may open only after the others closed. It must
    join the slot the pending group holds: a slot of its own cannot come while the buffer is
    full, and the group would wait for it until the group timeout."""
    store, buffer = make_store(tokenizer, groups_per_step=1, eta=0)  # one slot
    call = store.begin_chat("early", [USER], None, group_id="g")
    store.commit(call, sampled(tokenizer, "1", 0), {"role": "assistant", "content": "1"})
    assert not close(store, "early", 1.0, group_size=2)["group_complete"]
    assert buffer.stats().started == 1 and buffer.stats().queued == 0

    assert not store.wants_slot("late", "g")
    late = store.begin_chat("late", [USER], None, group_id="g")  # no AtCapacity: same slot
    with pytest.raises(AtCapacity):
        store.begin_chat("other", [USER], None, group_id="h")
    store.commit(late, sampled(tokenizer, "2", 0), {"role": "assistant", "content": "2"})
    assert close(store, "late", 0.0)["group_complete"]
    stats = buffer.stats()
    assert stats.queued == 1 and stats.started == 1
    (group,) = buffer.take(1, learner_version=0)
    assert sorted(t.reward for t in group.trajectories) == [0.0, 1.0]


# -- clients that retry, race, fail to close, or ask too much ----------------------------------


def test_a_call_while_another_runs_on_the_episode_is_refused(tokenizer):
    """Two calls extending one segment at once would interleave their tokens, masks and
    log-probs: the second is refused (409) until the first is recorded."""
    store, buffer = make_store(tokenizer)
    first = store.begin_chat("e", [USER], None)
    with pytest.raises(EpisodeError, match="a call is still running") as busy:
        store.begin_chat("e", [USER], None)
    assert busy.value.status == 409
    reply = {"role": "assistant", "content": "5"}
    store.commit(first, sampled(tokenizer, "5", 0), reply)
    more = [USER, reply, {"role": "user", "content": "and times 2"}]
    second = store.begin_chat("e", more, None)  # a continuation marks the episode busy too
    for racing in (lambda: store.begin_chat("e", more, None),
                   lambda: store.begin_tokens("e", [*second.prompt_ids, 5])):
        with pytest.raises(EpisodeError, match="still running"):
            racing()
    store.commit(second, sampled(tokenizer, "10", 0), {"role": "assistant", "content": "10"})
    close(store, "e", 1.0)
    (group,) = buffer.take(1, learner_version=0)
    (t,) = group.trajectories
    assert t.extra["episode"]["turns"] == 2 and store.counters.segments_rewritten == 0


def test_a_retried_call_gets_its_answer_back(tokenizer):
    store, _ = make_store(tokenizer)
    call = store.begin_chat("e", [USER], None, key=("k1", "request-1"))
    store.commit(call, sampled(tokenizer, "5", 0), {"role": "assistant", "content": "5"},
                 answer="the first answer")
    assert store.replay("e", ("k1", "request-1")) == "the first answer"
    assert store.replay("e", ("k2", "request-1")) is None and store.counters.calls_replayed == 1
    with pytest.raises(EpisodeError, match="Idempotency-Key: 'k1' already answered another"):
        store.replay("e", ("k1", "request-2"))
    for i in range(RESULTS_KEPT + 3):  # bounded: the oldest answers are dropped
        more = [USER, {"role": "assistant", "content": "5"}, {"role": "user", "content": "x"}]
        store.commit(store.begin_chat("e", more, None, key=(f"n{i}", "r")),
                     sampled(tokenizer, "5", 0), {"role": "assistant", "content": "5"}, i)
    assert len(store.episodes["e"].results) == RESULTS_KEPT


def test_a_refused_close_changes_nothing(tokenizer):
    """A close that names the wrong group size used to remove the episode and then refuse:
    its slot leaked and its group never completed."""
    store, buffer = make_store(tokenizer)
    for e in ("a", "b"):
        store.commit(store.begin_chat(e, [USER], None), sampled(tokenizer, "1", 0), None)
    close(store, "a", 1.0, group_id="g", group_size=2)
    with pytest.raises(EpisodeError, match="group_size: 3 but group 'g' was opened with size 2"):
        close(store, "b", 0.0, group_id="g", group_size=3)
    assert store.open_episodes == 1 and buffer.stats().started == 2
    assert close(store, "b", 0.0, group_id="g")["group_complete"]
    stats = buffer.stats()
    assert stats.queued == 1 and stats.started == 1


class FlakyBuffer(MemoryBuffer):
    """Its first ``fails`` puts raise, as a Redis buffer does once its own retries ran out."""

    def __init__(self, fails: int) -> None:
        super().__init__(4, 0)
        self.fails = fails

    def put(self, group: Group, holder: str = "") -> None:
        if self.fails:
            self.fails -= 1
            raise ConnectionError("Redis is unreachable")
        super().put(group, holder)


def test_a_failed_put_keeps_the_group_for_a_retried_close(tokenizer):
    buffer = FlakyBuffer(fails=1)
    store = EpisodeStore(buffer, ChatRenderer(tokenizer), ttl_s=60, group_timeout_s=30)
    store.commit(store.begin_chat("e", [USER], None), sampled(tokenizer, "1", 0), None)
    summary = store.close("e", 1.0)
    with pytest.raises(BufferUnavailable, match=r"buffer: putting group .* failed .*"
                                                r"ConnectionError: Redis is unreachable"):
        asyncio.run(store.settle(summary["group_id"]))
    assert buffer.stats().queued == 0 and store.counters.put_failures == 1
    assert store.close("e", 1.0) == summary  # the retried close: same answer, put again
    asyncio.run(store.settle(summary["group_id"]))
    stats = buffer.stats()
    assert stats.queued == 1 and stats.started == 1 and store.counters.groups_put == 1


def test_episodes_are_limited_per_group_and_per_client(tokenizer):
    store, buffer = make_store(tokenizer, max_group_size=2, max_episodes_per_client=3)
    for e in ("a", "b"):
        store.commit(store.begin_chat(e, [USER], None, group_id="g", client="c1"),
                     sampled(tokenizer, "1", 0), None)
    with pytest.raises(EpisodeError, match=r"group 'g' already has 2 episodes \(serve\."
                                           r"max_group_size=2\)"):
        store.wants_slot("x", "g", "c2")  # refused before any slot is taken
    store.begin_chat("c", [USER], None, client="c1")
    with pytest.raises(EpisodeError, match="client c1: 3 episodes open") as limited:
        store.begin_chat("d", [USER], None, client="c1")
    assert limited.value.status == 429
    store.abandon(store.begin_chat("d", [USER], None, client="c2"))
    # Once a close names the group's size, that size is the limit.
    close(store, "a", 1.0, group_size=2)
    with pytest.raises(EpisodeError, match=r"already has 2 episodes \(its group_size=2\)"):
        store.begin_chat("x", [USER], None, group_id="g", client="c2")
    close(store, "b", 1.0)
    store.begin_chat("d2", [USER], None, client="c1")  # closing freed c1's room
    assert buffer.stats().started == 4  # g's slot was put; c, d, d2 hold theirs


def test_a_slot_handed_in_is_held_or_given_back_once(tokenizer):
    """The service takes a new episode's slot before planning the call; whatever the plan
    does with it (refuses the call, or finds the slot not needed), it goes back exactly once."""
    store, buffer = make_store(tokenizer, groups_per_step=8, max_group_size=1)
    store.begin_chat("a", [USER], None, group_id="g")
    for refused in (lambda: store.begin_chat("b", [USER], None, group_id="g", slot=True),
                    lambda: store.begin_chat("a", [USER], None, slot=True),
                    lambda: store.begin_chat("c", [], None, slot=True)):
        assert buffer.try_admit()
        with pytest.raises(EpisodeError):
            refused()
    store.max_group_size = None
    assert buffer.try_admit()
    store.begin_chat("b", [USER], None, group_id="g", slot=True)  # g holds one: not needed
    asyncio.run(store.give_back())
    assert buffer.stats().started == 1 and not store.owes
