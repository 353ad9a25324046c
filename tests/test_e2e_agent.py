"""End to end with an agent: `streamrl train rollout.agent=relay` in each mode.

The built-in multi-turn environment ``relay`` (agent/envs/relay.py) pays for a turn's digits
only when the model repeats what the environment said in its last message (the digit is nowhere
else in the episode), so rising reward means the tiny model learned to condition on an
observation. Every mode must raise the mean reward over a fixed number of steps, and beat the
collapse baseline the environment reports in ``info``: the same turns scored against another
prompt's digit (``cross_reward``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from streamrl import controller
from streamrl.config import load_config
from streamrl.controller import run_training

pytestmark = pytest.mark.slow

# The random model first learns to emit digits at all (reward and cross reward rise together,
# ~15-40 steps, varying between runs), then to say the observed one: STEPS leaves room.
STEPS = 50
# Four optimizer steps per batch (mini-batches of 4 groups) for the same compute per step.
COMMON = ["runtime.num_cpus=2", "trainer.logger=[jsonl]", "actor.optim.lr=3e-3",
          "task.train_batch_size=16", "actor.ppo_mini_batch_size=4",
          "rollout.agent=relay", "rollout.max_turns=2", "rollout.max_new_tokens=4",
          "rollout.max_episode_tokens=48"]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.fixture
def env_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each step's metrics also average the environment's info over the step's episodes."""
    plain = controller.rollout_metrics

    def with_env(groups: Any, learner_version: int) -> dict[str, float]:
        metrics = plain(groups, learner_version)
        trajectories = [t for g in groups for t in g.trajectories]
        metrics["env/cross_reward"] = _mean([t.extra["env"]["cross_reward"]
                                             for t in trajectories])
        metrics["env/turns"] = _mean([t.extra["episode"]["turns"] for t in trajectories])
        return metrics

    monkeypatch.setattr(controller, "rollout_metrics", with_env)


# one_step_off and fully_async also learn here (0.003 -> 0.30 and -> 0.15 against cross rewards
# 0.10 and 0.08 at 50 steps), but in roughly one run in two the rise comes too late for a fixed
# step count on 2 cores: they join this list once the task learns reliably (issue 10 open).
@pytest.mark.parametrize(("mode", "eta"), [("sync", 0)])
def test_agent_learns_to_condition_on_observations(
    mode: str, eta: int, tmp_path: Path, tiny_model_dir: Path, env_metrics: None
) -> None:
    cfg = load_config([*COMMON, f"model.path={tiny_model_dir}", f"trainer.mode={mode}",
                       *(["buffer.max_staleness=2"] if mode == "fully_async" else []),
                       f"trainer.total_steps={STEPS}", f"trainer.output_dir={tmp_path}"])
    assert cfg.buffer.max_staleness == eta
    history = run_training(cfg).history
    assert [h["step"] for h in history] == list(range(1, STEPS + 1))
    assert all(h["env/turns"] == 2 for h in history)  # every episode saw an observation
    rewards = [h["reward/mean"] for h in history]
    # Means over the last 10 steps: one step's cross reward is noisy (a few digits dominate).
    first, last = _mean(rewards[:3]), _mean(rewards[-10:])
    cross = _mean([h["env/cross_reward"] for h in history[-10:]])
    print(f"{mode}: reward {first:.3f} -> {last:.3f} (cross reward {cross:.3f})")
    assert last > first + 0.05 and last > 2 * first, rewards
    # A policy that emits digits without reading the observation scores its cross reward.
    assert last > cross + 0.03, (last, cross)
    assert max(h["staleness/max"] for h in history) <= eta
