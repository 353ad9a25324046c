"""DAPO in the replica (replica.py): dynamic sampling, soft overlong punishment, overlong
filtering. No model: a scripted engine and scorer choose every reward, length and finish reason
(tests/support/rollout.py), and the buffer is the real MemoryBuffer, so admission accounting is
the production code's.

- a group whose rewards are all equal never reaches ``take``; its admission comes back
  (``started == consumed + queued + in_flight``, nothing left in flight), it is counted in
  ``groups_filtered``, and the replica samples other groups until the learner is served;
- the property test drives random reward patterns, batch sizes, staleness bounds and in-flight
  limits through the same loop;
- the overlong penalty and mask are checked against hand-computed values, and the filter sees
  the shaped rewards;
- agent groups are filtered the same way; a take that runs out names the filtered count;
- ``algorithm=dapo`` selects every part, and bad values are one line naming key and value.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamrl.buffer.memory import MemoryBuffer
from streamrl.config import OverlongBufferConfig, RolloutConfig
from streamrl.data import ListPromptSource, Prompt, PromptStream
from streamrl.rollout_fleet.agent import Environment, StepResult
from streamrl.rollout_fleet.replica import Replica, overlong_penalty
from streamrl.types import Group
from tests.support.rollout import (
    IdTokenizer,
    ListBuffer,
    ListedRewards,
    ScriptedEngine,
    scripted_prompts,
    train_steps,
    wait_until,
)


def _equal(rewards: list[float]) -> bool:
    return len(set(rewards)) == 1


def _replica(engine: ScriptedEngine, buffer, rewards: list[list[float]], **rollout) -> Replica:
    cfg = RolloutConfig(**{"n": len(rewards[0]), "max_new_tokens": 8, **rollout})
    return Replica(engine, buffer, scripted_prompts(rewards), ListedRewards(), IdTokenizer(),
                   cfg, admit_backoff_s=0.001)


# -- dynamic sampling ---------------------------------------------------------------------------

PATTERNS = [[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0],
            [0.5, 0.5, 0.5, 0.5], [1.0, 0.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]]


def test_equal_reward_groups_are_filtered_and_give_admission_back():
    buffer = MemoryBuffer(groups_per_step=2, max_staleness=0)
    engine = ScriptedEngine()
    replica = _replica(engine, buffer, PATTERNS, filter_groups=True, max_inflight_groups=2)

    batches = train_steps(buffer, replica, steps=3)
    taken = [g for batch in batches for g in batch]
    assert len(taken) == 6
    assert {g.prompt_index for g in taken} == {1, 4}  # only the informative prompts
    assert not any(_equal(g.rewards) for g in taken)
    equal_answered = sum(_equal(PATTERNS[i]) for i in engine.answered)
    assert equal_answered >= 6  # the replica sampled past the 4 equal prompts of each cycle
    assert replica.metrics()["groups_filtered"] == equal_answered
    s = buffer.stats()
    assert s.in_flight == 0 and s.started == s.consumed + s.queued, s
    assert s.produced == len(engine.answered) - equal_answered


def test_without_filter_groups_equal_reward_groups_are_trained_on():
    buffer = MemoryBuffer(groups_per_step=2, max_staleness=0)
    replica = _replica(ScriptedEngine(), buffer, PATTERNS, max_inflight_groups=2)

    taken = [g for batch in train_steps(buffer, replica, steps=3) for g in batch]
    assert [g.prompt_index for g in taken] == [0, 1, 2, 3, 4, 5]
    assert replica.metrics()["groups_filtered"] == 0


REWARD = st.sampled_from([0.0, 0.5, 1.0])


@st.composite
def reward_patterns(draw: st.DrawFn) -> list[list[float]]:
    n = draw(st.integers(2, 4))
    patterns = draw(st.lists(st.lists(REWARD, min_size=n, max_size=n), min_size=1, max_size=8))
    informative = draw(st.lists(REWARD, min_size=n, max_size=n).filter(lambda r: not _equal(r)))
    patterns.insert(draw(st.integers(0, len(patterns))), informative)
    return patterns


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(patterns=reward_patterns(), b=st.integers(1, 3), eta=st.integers(0, 2),
       inflight=st.integers(1, 4), steps=st.integers(1, 4))
def test_property_no_equal_reward_group_is_taken_and_admission_stays_exact(
    patterns: list[list[float]], b: int, eta: int, inflight: int, steps: int
):
    buffer = MemoryBuffer(groups_per_step=b, max_staleness=eta)
    engine = ScriptedEngine()
    replica = _replica(engine, buffer, patterns, filter_groups=True, max_inflight_groups=inflight)

    batches = train_steps(buffer, replica, steps)
    assert [len(batch) for batch in batches] == [b] * steps
    for batch in batches:
        assert not any(_equal(g.rewards) for g in batch), [g.rewards for g in batch]
    filtered = sum(_equal(patterns[i]) for i in engine.answered)
    m = replica.metrics()
    assert m["groups_filtered"] == filtered
    assert m["groups_failed"] == m["groups_cancelled"] == 0
    s = buffer.stats()
    assert s.in_flight == 0 and s.started == s.consumed + s.queued, s
    assert s.consumed == steps * b and s.produced == len(engine.answered) - filtered, s
    assert s.started <= buffer.admission.capacity(steps), s


class OneTurn(Environment):
    """One turn, scored ``prompt.extra["reward"]``, or at random where that is None."""

    def reset(self, prompt):
        self.reward = prompt.extra["reward"]
        return [{"role": "user", "content": "go"}]

    def step(self, turn):
        return StepResult(None, random.random() if self.reward is None else self.reward, True)


def test_agent_groups_with_equal_rewards_are_filtered(tokenizer):
    prompts = [Prompt(index=i, prompt_ids=[1], data_source="one_turn", ground_truth=None,
                      extra={"reward": reward}) for i, reward in enumerate([1.0, None, 0.0])]
    stream = PromptStream(ListPromptSource(prompts, name="one_turn"), shuffle=False, seed=0)
    rollout = RolloutConfig(agent=f"{__name__}:OneTurn", n=3, max_inflight_groups=2,
                            filter_groups=True)
    buffer = MemoryBuffer(groups_per_step=1, max_staleness=0)
    replica = Replica(ScriptedEngine(), buffer, stream, ListedRewards(), tokenizer, rollout,
                      admit_backoff_s=0.001)

    taken = [g for batch in train_steps(buffer, replica, steps=3) for g in batch]
    assert [g.prompt_index for g in taken] == [1, 1, 1]
    m = replica.metrics()
    assert m["groups_filtered"] >= 4 and m["episodes"] == 3 * (m["groups"] + m["groups_filtered"])
    s = buffer.stats()
    assert s.in_flight == 0 and s.started == s.consumed + s.queued, s


# -- overlong shaping and filtering ----------------------------------------------------------


@pytest.mark.parametrize(("length", "budget", "buffer_len", "factor", "expected"), [
    (5, 8, 2, 1.0, 0.0),      # short of the zone
    (6, 8, 2, 1.0, 0.0),      # the zone starts after L - len = 6 tokens
    (7, 8, 2, 1.0, -0.5),
    (8, 8, 2, 1.0, -1.0),     # the whole budget: -factor
    (17, 20, 4, 0.5, -0.125),  # -(17 - 16) / 4 * 0.5
    (20, 20, 4, 0.5, -0.5),
    (3, 4, 4, 2.0, -1.5),     # zone = the whole budget: -(3 - 0) / 4 * 2
])
def test_overlong_penalty_hand_computed(length, budget, buffer_len, factor, expected):
    assert overlong_penalty(length, budget, buffer_len, factor) == pytest.approx(expected)


def _one_group(shapes: list[tuple[int, str]], rewards: list[float], **rollout) -> tuple[
        Group | None, Replica]:
    buffer = ListBuffer(capacity=1)
    replica = _replica(ScriptedEngine({0: shapes}), buffer, [rewards], **rollout)

    async def scenario():
        replica.start()
        await wait_until(lambda: replica.counters.groups + replica.counters.groups_filtered,
                         timeout=10, what="one group")
        await replica.stop()

    asyncio.run(scenario())
    return (buffer.groups[0] if buffer.groups else None), replica


SHAPES = [(5, "stop"), (7, "stop"), (8, "length"), (8, "length")]
OVERLONG = OverlongBufferConfig(enable=True, len=2, penalty_factor=1.0)


def test_overlong_punishment_and_filtering_hand_computed():
    group, replica = _one_group(SHAPES, [1.0, 1.0, 1.0, 0.0], overlong_buffer=OVERLONG,
                                overlong_filter=True)
    assert group is not None
    assert group.rewards == pytest.approx([1.0, 0.5, 0.0, -1.0])
    assert [t.metrics["overlong_penalty"] for t in group.trajectories] == [0.0, -0.5, -1.0, -1.0]
    # Truncated responses stay in the group (their rewards set the baseline) but train nothing.
    assert [t.loss_mask for t in group.trajectories] == [[1] * 5, [1] * 7, [0] * 8, [0] * 8]
    assert replica.metrics()["overlong_filtered"] == 2


def test_overlong_shaping_off_leaves_rewards_and_masks_alone():
    group, replica = _one_group(SHAPES, [1.0, 1.0, 1.0, 0.0])
    assert group is not None
    assert group.rewards == [1.0, 1.0, 1.0, 0.0]
    assert all(sum(t.loss_mask) == len(t.response_ids) for t in group.trajectories)
    assert "overlong_penalty" not in group.trajectories[0].metrics
    assert replica.metrics()["overlong_filtered"] == 0


def test_filter_sees_shaped_rewards():
    # Equal scores, different lengths: the penalty makes them differ, so the group is kept ...
    kept, _ = _one_group([(5, "stop"), (8, "length")], [1.0, 1.0], filter_groups=True,
                         overlong_buffer=OVERLONG)
    assert kept is not None and kept.rewards == [1.0, 0.0]
    # ... and different scores that the penalty evens out make it a zero-variance group.
    dropped, replica = _one_group([(6, "stop"), (7, "stop")], [1.0, 1.5], filter_groups=True,
                                  overlong_buffer=OVERLONG)
    assert dropped is None and replica.metrics()["groups_filtered"] >= 1
    assert replica.buffer.given_back == replica.metrics()["groups_filtered"]
    assert replica.buffer.started == 0


# -- a run where every group is filtered says so -----------------------------------------------


class FilteringFleet:
    """The fleet handle the controller sees, with replicas that filter every group."""

    members = ("replica-0",)
    failure = None

    def status(self) -> str:
        return "1 of 1 replicas live"

    def metrics(self) -> dict[str, float]:
        return {"replica/groups_filtered": 37.0}


def test_controller_names_filtered_groups_when_no_batch_comes():
    from types import SimpleNamespace

    from streamrl.config import Config, replace
    from streamrl.controller import Controller
    from streamrl.errors import RunStopped

    cfg = replace(Config(), **{"rollout.filter_groups": True, "buffer.take_timeout_s": 0.05})
    caught_up: list[int] = []  # while it waits, the controller offers late replicas version 0
    runtime = SimpleNamespace(learner=object(), weight_bus=SimpleNamespace(
                                  catch_up=caught_up.append), fleet=FilteringFleet(),
                              buffer=MemoryBuffer(groups_per_step=2, max_staleness=1))
    with pytest.raises(RunStopped, match=r"37 groups filtered for equal rewards "
                                         r"\(rollout.filter_groups=true\)"):
        Controller(cfg, runtime)._take(2, 0)
    assert caught_up and set(caught_up) == {0}


# -- the algorithm=dapo preset and its validation ---------------------------------------------


def test_dapo_preset_selects_every_part():
    from streamrl.config import load_config

    cfg = load_config(["algorithm=dapo"])
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.algorithm.norm_adv_by_std_in_grpo
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high) == (0.2, 0.28)
    assert cfg.actor.loss_agg_mode == "token-mean"
    assert cfg.rollout.filter_groups and cfg.rollout.overlong_buffer.enable
    assert cfg.rollout.overlong_buffer.len <= cfg.rollout.max_new_tokens
    assert not cfg.rollout.overlong_filter
    # Overrides and the mode presets still compose with it.
    cfg = load_config(["algorithm=dapo", "trainer.mode=sync", "rollout.overlong_filter=true",
                       "rollout.overlong_buffer.len=4"])
    assert cfg.buffer.max_staleness == 0 and cfg.rollout.overlong_filter
    assert cfg.rollout.overlong_buffer.len == 4 and cfg.rollout.filter_groups
    default = load_config([])
    assert not default.rollout.filter_groups and not default.rollout.overlong_buffer.enable


@pytest.mark.parametrize(("overrides", "message"), [
    (["rollout.max_new_tokens=1"],
     r"^rollout.overlong_buffer.len=2: must be in \(0, rollout.max_new_tokens=1\]"),
    (["rollout.overlong_buffer.len=0"], r"^rollout.overlong_buffer.len=0: must be in \(0, "),
    (["rollout.overlong_buffer.penalty_factor=-0.5"],
     r"^rollout.overlong_buffer.penalty_factor=-0.5: must be a finite number >= 0"),
    (["rollout.agent=relay", "rollout.max_episode_tokens=1"],
     r"^rollout.overlong_buffer.len=2: must be in \(0, rollout.max_episode_tokens=1\]"),
    (["algorithm.adv_estimator=reinforce_plus_plus", "rollout.n=1"],
     r"^rollout.n=1: must be >= 2 with rollout.filter_groups=true"),
])
def test_dapo_bad_values_are_one_line(overrides: list[str], message: str):
    from streamrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message) as info:
        load_config(["algorithm=dapo", *overrides])
    assert "\n" not in str(info.value)


# -- algorithm=remax: its preset and validation (the greedy baseline: test_replica.py) ---------


def test_remax_preset_turns_on_the_greedy_baseline():
    from streamrl.config import ConfigError, load_config

    cfg = load_config(["algorithm=remax"])
    assert cfg.algorithm.adv_estimator == "remax" and cfg.rollout.greedy_baseline
    with pytest.raises(ConfigError, match=r"^algorithm.adv_estimator='remax': needs "
                                          r"rollout.greedy_baseline=true"):
        load_config(["algorithm.adv_estimator=remax"])
    with pytest.raises(ConfigError, match=r"^rollout.greedy_baseline=True: is for single-turn"):
        load_config(["algorithm=remax", "rollout.agent=relay"])
