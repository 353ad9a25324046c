"""Step metrics of agent episodes: turns, tools, truncation and the environment's info."""

from __future__ import annotations

import pytest

from streamrl.metrics import episode_metrics, rollout_metrics
from streamrl.testing import make_group, make_trajectory
from streamrl.types import Group


def test_episode_metrics_average_summaries_and_numeric_env_info() -> None:
    def episode(turns: int, truncated: bool, env: dict) -> dict:
        return {"episode": {"turns": turns, "tool_calls": turns - 1, "tool_errors": 0,
                            "truncated": truncated}, "env": env}

    trajectories = [
        make_trajectory("a", "g", extra=episode(2, False, {"score": 1.0, "name": "x", "ok": True})),
        make_trajectory("b", "g", extra=episode(4, True, {"score": 0.0, "extra": 3})),
    ]
    metrics = episode_metrics(trajectories)
    assert metrics == {"episode/turns": 3.0, "episode/tool_calls": 2.0, "episode/tool_errors": 0.0,
                       "episode/truncated": 0.5, "env/score": 0.5, "env/extra": 3.0}
    step = rollout_metrics([Group(group_id="g", trajectories=trajectories)], learner_version=4)
    assert step["env/score"] == pytest.approx(0.5)


def test_single_turn_groups_add_no_episode_metrics() -> None:
    assert episode_metrics(make_group([3, 4]).trajectories) == {}
    assert not any(k.startswith(("env/", "episode/"))
                   for k in rollout_metrics([make_group([4])], learner_version=4))
