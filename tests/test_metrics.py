"""Step metrics of agent episodes (turns, tools, truncation and the environment's info), and
what the sinks that take the run's config out of the process write (no secrets)."""

from __future__ import annotations

import json
from pathlib import Path

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


API_KEY = "sk-serve-0123456789"
REDIS_PASSWORD = "redis-pw-9876"
SECRET_OVERRIDES = [f"serve.api_key={API_KEY}",
                    f"buffer.redis_url=redis://learner:{REDIS_PASSWORD}@127.0.0.1:6379/0"]


def test_no_sink_gets_a_secret(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    """serve.api_key and the Redis password stay in the process: `streamrl config`, the
    config every metrics sink is given (wandb's run config; console and JSONL write records
    only) and the config's repr all carry masks instead."""
    import dataclasses
    import io
    import sys
    import types

    from streamrl.cli import main
    from streamrl.config import load_config
    from streamrl.metrics import MetricsLogger

    assert main(["config", *SECRET_OVERRIDES]) == 0
    rendered = {"streamrl config": capsys.readouterr().out}
    cfg = load_config(SECRET_OVERRIDES)
    assert cfg.serve.api_key == API_KEY  # the process itself still has them

    runs: list[dict] = []
    fake_wandb = types.ModuleType("wandb")
    fake_wandb.init = lambda **kw: runs.append(kw) or types.SimpleNamespace(  # type: ignore
        log=lambda *a, **k: None, finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb)
    monkeypatch.setenv("WANDB_MODE", "offline")
    console = io.StringIO()
    # as the controller hands it over: dataclasses.asdict(cfg)
    logger = MetricsLogger(("console", "jsonl", "wandb"), tmp_path, "p", "e",
                           config=dataclasses.asdict(cfg), stream=console, total_steps=1)
    logger.log({"reward/mean": 0.5}, step=1)
    logger.close()
    rendered["wandb config"] = json.dumps(runs[0]["config"])
    rendered["console"] = console.getvalue()
    rendered["jsonl"] = (tmp_path / "metrics.jsonl").read_text()
    rendered["repr"] = repr(cfg.serve)
    for sink, text in rendered.items():
        assert API_KEY not in text and REDIS_PASSWORD not in text, sink
    for sink in ("streamrl config", "wandb config"):
        assert "***" in rendered[sink] and "redis://learner:***@127.0.0.1:6379/0" in \
            rendered[sink], sink
