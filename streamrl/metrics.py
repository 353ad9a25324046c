"""Metric sinks (console, JSONL, wandb) and small timing/aggregation helpers for the controller."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from streamrl.types import Group, Trajectory

CONSOLE_KEYS = (
    ("step", "step", "{:d}"),
    ("reward/mean", "reward", "{:.3f}"),
    ("staleness/mean", "stale", "{:.2f}"),
    ("throughput/tokens_per_s", "tok/s", "{:.0f}"),
    ("timing/take", "take", "{:.2f}s"),
    ("timing/prepare", "prep", "{:.2f}s"),
    ("timing/update", "upd", "{:.2f}s"),
    ("timing/publish", "pub", "{:.2f}s"),
)


class Timer:
    """Collects named phase durations: ``with timer("update"): ...``."""

    def __init__(self) -> None:
        self.durations: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.durations[f"timing/{name}"] = time.perf_counter() - start


def rollout_metrics(groups: Sequence[Group], learner_version: int) -> dict[str, float]:
    """Reward, length and staleness statistics of the groups a step trained on."""
    rewards = np.array([t.reward for g in groups for t in g.trajectories], dtype=np.float64)
    lengths = np.array([len(t.response_ids) for g in groups for t in g.trajectories])
    staleness = np.array([g.staleness(learner_version) for g in groups])
    solved = np.array([max(g.rewards) > min(g.rewards) for g in groups])
    trajectories = [t for g in groups for t in g.trajectories]
    return {
        "reward/mean": float(rewards.mean()),
        "reward/max": float(rewards.max()),
        "reward/min": float(rewards.min()),
        "response_length/mean": float(lengths.mean()),
        "staleness/mean": float(staleness.mean()),
        "staleness/max": float(staleness.max()),
        "groups/with_signal": float(solved.mean()),
        **episode_metrics(trajectories),
    }


def episode_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Agent episodes: mean turns, tool calls and errors, truncated share, and the mean of each
    numeric value the environment put in ``info`` (``env/<key>``, over the episodes that
    report it). Empty for single-turn trajectories."""
    episodes = [t.extra["episode"] for t in trajectories if "episode" in t.extra]
    if not episodes:
        return {}
    out: dict[str, float] = {}
    for key in ("turns", "tool_calls", "tool_errors", "truncated"):
        present = [float(e[key]) for e in episodes if key in e]  # serve records fewer keys
        if present:
            out[f"episode/{key}"] = float(np.mean(present))
    values: dict[str, list[float]] = {}
    for t in trajectories:
        for key, value in (t.extra.get("env") or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                values.setdefault(key, []).append(float(value))
    out.update({f"env/{key}": float(np.mean(v)) for key, v in values.items()})
    return out


class MetricsLogger:
    """Fans one metrics dict per step out to the configured sinks."""

    def __init__(
        self,
        sinks: Sequence[str],
        output_dir: str | os.PathLike[str],
        project: str,
        experiment: str,
        config: dict[str, Any] | None = None,
        stream: TextIO = sys.stdout,
    ) -> None:
        self.sinks = tuple(sinks)
        self.stream = stream
        self._jsonl: TextIO | None = None
        self._wandb: Any = None
        if "jsonl" in self.sinks:
            path = Path(output_dir) / "metrics.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            self._jsonl = path.open("a", encoding="utf-8")
            self.jsonl_path = path
        if "wandb" in self.sinks:
            import wandb

            # No API key: log offline (wandb sync later), never block on a login prompt.
            if not os.environ.get("WANDB_API_KEY") and "WANDB_MODE" not in os.environ:
                os.environ["WANDB_MODE"] = "offline"
            self._wandb = wandb.init(
                project=project, name=experiment, config=config, dir=str(output_dir)
            )

    def log(self, metrics: dict[str, float], step: int) -> None:
        record = {"step": step, **metrics}
        if "console" in self.sinks:
            parts = []
            for key, label, fmt in CONSOLE_KEYS:
                if key in record:
                    parts.append(f"{label} {fmt.format(record[key])}")
            print(" | ".join(parts), file=self.stream, flush=True)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._wandb is not None:
            self._wandb.finish()
