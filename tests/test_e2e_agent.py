"""End to end with an agent: `streamrl train rollout.agent=relay` in each mode.

The built-in multi-turn environment ``relay`` (agent/envs/relay.py) pays a turn for repeating
the digit of the environment's latest message; from turn 1 on that digit is new and exists only
in the observation, so a rising ``env/observation_reward`` means the tiny model learned to
condition on an observation. Every mode must raise the mean reward over a fixed number of steps,
and its observation-turn reward must beat the collapse baseline the environment reports: the
same turns scored against another prompt's digit (``env/observation_cross_reward``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from streamrl.config import load_config
from streamrl.controller import run_training

pytestmark = pytest.mark.slow

# Measured at 45 steps: observation-turn reward over the last 10 steps 0.87 (sync), 0.78
# (one_step_off) against a cross reward of 0.10; the rise starts around step 15, so sync runs 40
# steps (the suite's longest test). fully_async learns more slowly the staler its data (eta=2:
# 0.51 vs 0.18 at 40 steps alone on the machine, 0.22 vs 0.17 at 45 steps beside another vLLM
# run), so it runs with eta=1 and 50 steps here; the single-turn end-to-end test covers eta=2.
STEPS = {"sync": 40, "one_step_off": 50, "fully_async": 50}
# Four optimizer steps per batch (mini-batches of 4 groups) for the same compute per step.
COMMON = ["runtime.num_cpus=2", "trainer.logger=[jsonl]", "actor.optim.lr=3e-3",
          "task.train_batch_size=16", "actor.ppo_mini_batch_size=4",
          "rollout.agent=relay", "rollout.max_turns=2", "rollout.max_new_tokens=4",
          "rollout.max_episode_tokens=48"]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


# sync and one_step_off run by hand (-m manual) to keep the suite within 30 minutes: the agent
# loop is the same code in every mode, the single-turn end-to-end tests run all three modes in
# CI, and tests/test_e2e_serve.py has a multi-turn relay agent learn in sync.
@pytest.mark.parametrize(("mode", "eta"), [
    pytest.param("sync", 0, marks=pytest.mark.manual),
    pytest.param("one_step_off", 1, marks=pytest.mark.manual), ("fully_async", 1)])
def test_agent_learns_to_condition_on_observations(
    mode: str, eta: int, tmp_path: Path, tiny_model_dir: Path
) -> None:
    cfg = load_config([*COMMON, f"model.path={tiny_model_dir}", f"trainer.mode={mode}",
                       *(["buffer.max_staleness=1"] if mode == "fully_async" else []),
                       f"trainer.total_steps={STEPS[mode]}", f"trainer.output_dir={tmp_path}"])
    assert cfg.buffer.max_staleness == eta
    history = run_training(cfg).history
    assert [h["step"] for h in history] == list(range(1, STEPS[mode] + 1))
    assert all(h["episode/turns"] == 2 for h in history)  # every episode saw an observation
    rewards = [h["reward/mean"] for h in history]
    # Means over the last 10 steps: one step's cross reward is noisy (a few digits dominate).
    first, last = _mean(rewards[:3]), _mean(rewards[-10:])
    observed = _mean([h["env/observation_reward"] for h in history[-10:]])
    cross = _mean([h["env/observation_cross_reward"] for h in history[-10:]])
    print(f"{mode}: reward {first:.3f} -> {last:.3f}; observation turns {observed:.3f} "
          f"(cross {cross:.3f})")
    assert last > first + 0.1 and last > 2 * first, rewards
    # A policy that emits digits without reading the observation scores its cross reward.
    assert observed > cross + 0.1, (observed, cross)
    assert max(h["staleness/max"] for h in history) <= eta
