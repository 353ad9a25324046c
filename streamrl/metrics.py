"""Metric sinks (console progress, JSONL, wandb, TensorBoard) and the small timing and
aggregation helpers of the controller. Every key is listed in docs/metrics.md. A sink given the
run's config (wandb) gets it through ``logs.redacted``: no secret leaves the process."""

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

from streamrl.logs import redacted
from streamrl.types import Group, Trajectory

CONSOLE_KEYS = (
    ("reward/mean", "reward", "{:.3f}"),
    ("val/reward/mean", "val", "{:.3f}"),
    ("staleness/mean", "stale", "{:.2f}"),
    ("staleness/max", "max", "{:.0f}"),
    ("perf/throughput", "tok/s", "{:.0f}"),
    ("buffer/queued", "buffer", "{:.0f}"),
    ("trainer/idle_ratio", "idle learner", "{:.2f}"),
    ("rollouter/idle_ratio", "rollout", "{:.2f}"),
)
PHASE_KEYS = {"take": "timing_s/take", "prepare": "timing_s/old_log_prob",
              "update": "timing_s/update_actor", "publish": "timing_s/update_weights",
              "step": "timing_s/step"}
"""The controller's phases under verl's metric names where verl has one."""


class Timer:
    """Collects phase durations (``with timer("update"): ...``) under ``PHASE_KEYS`` names,
    and their wall-clock spans for the trace."""

    def __init__(self) -> None:
        self.durations: dict[str, float] = {}
        self.spans: list[tuple[str, float, float]] = []
        """(phase, wall start, seconds)"""

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        wall, start = time.time(), time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            self.durations[PHASE_KEYS[name]] = seconds
            self.spans.append((name, wall, seconds))


class RolloutIdle:
    """``rollouter/idle_ratio``: the share of replica wall time since the previous call with
    no request in the engine, from the fleet's summed ``replica/busy_s`` and
    ``replica/uptime_s`` (a replica that restarted resets both: that window is skipped)."""

    def __init__(self) -> None:
        self._last: tuple[float, float] | None = None

    def __call__(self, fleet: dict[str, float]) -> dict[str, float]:
        if "replica/busy_s" not in fleet:
            return {}
        now = (fleet["replica/busy_s"], fleet["replica/uptime_s"])
        last, self._last = self._last, now
        if last is None or now[1] <= last[1] or now[0] < last[0]:
            return {}
        return {"rollouter/idle_ratio": min(1.0, max(0.0, 1 - (now[0] - last[0])
                                                      / (now[1] - last[1])))}


def rollout_metrics(groups: Sequence[Group], learner_version: int) -> dict[str, float]:
    """Reward, length and staleness statistics of the groups a step trained on, and the mean
    generation and reward seconds of their trajectories."""
    rewards = np.array([t.reward for g in groups for t in g.trajectories], dtype=np.float64)
    lengths = np.array([len(t.response_ids) for g in groups for t in g.trajectories])
    staleness = np.array([g.staleness(learner_version) for g in groups])
    solved = np.array([max(g.rewards) > min(g.rewards) for g in groups])
    trajectories = [t for g in groups for t in g.trajectories]
    token_staleness = np.array([learner_version - v for t in trajectories
                                for v in t.policy_versions])
    timings = {key: [t.metrics[name] for t in trajectories if name in t.metrics]
               for key, name in (("timing_s/gen", "gen_s"), ("timing_s/reward", "score_s"))}
    return {
        "reward/mean": float(rewards.mean()),
        "reward/max": float(rewards.max()),
        "reward/min": float(rewards.min()),
        "response_length/mean": float(lengths.mean()),
        "staleness/mean": float(staleness.mean()),
        "staleness/max": float(staleness.max()),
        "groups/with_signal": float(solved.mean()),
        **({"staleness/token_mean": float(token_staleness.mean()),
            "staleness/token_p90": float(np.percentile(token_staleness, 90)),
            "staleness/token_max": float(token_staleness.max())}
           if token_staleness.size else {}),
        **{key: float(np.mean(values)) for key, values in timings.items() if values},
        **({"reward/greedy_baseline": float(np.mean([g.baseline_reward for g in groups]))}
           if all(g.baseline_reward is not None for g in groups) else {}),
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


class Progress:
    """The console sink: one self-updating line on a terminal (rich; engine and Ray lines
    scroll above it), one plain line per step when output goes to a file or CI. Shows
    step/total, ETA, reward, staleness, tokens/s, buffer depth and the idle ratios."""

    def __init__(self, total_steps: int, stream: TextIO) -> None:
        self.total = total_steps
        self.stream = stream
        self._start = time.perf_counter()
        self._first_step: int | None = None  # a resumed run starts past step 1
        self._live: Any = None
        if stream.isatty():
            from rich.console import Console
            from rich.live import Live

            self._live = Live(console=Console(file=stream), auto_refresh=False,
                              redirect_stdout=True, redirect_stderr=True)
            self._live.start()

    def line(self, record: dict[str, float], step: int) -> str:
        if self._first_step is None:
            self._first_step = step
        done = step - self._first_step + 1
        eta = (time.perf_counter() - self._start) / done * (self.total - step)
        parts = [f"step {step}/{self.total}", f"eta {_clock(eta)}"]
        parts += [f"{label} {fmt.format(record[key])}" for key, label, fmt in CONSOLE_KEYS
                  if key in record]
        return " | ".join(parts)

    def update(self, record: dict[str, float], step: int) -> None:
        text = self.line(record, step)
        if self._live is not None:
            from rich.text import Text

            # one line however narrow the terminal: cut, never wrapped
            self._live.update(Text(text, no_wrap=True, overflow="ellipsis"), refresh=True)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()


def _clock(seconds: float) -> str:
    if not np.isfinite(seconds):
        return "?"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class MetricsLogger:
    """Fans one metrics dict per step out to the configured sinks. ``config`` (the run's, as a
    dict) is recorded by the sinks that keep one (wandb), secrets masked."""

    def __init__(
        self,
        sinks: Sequence[str],
        output_dir: str | os.PathLike[str],
        project: str,
        experiment: str,
        config: dict[str, Any] | None = None,
        stream: TextIO = sys.stdout,
        total_steps: int = 0,
    ) -> None:
        self.sinks = tuple(sinks)
        config = None if config is None else redacted(config)
        self._progress = Progress(total_steps, stream) if "console" in self.sinks else None
        self._jsonl: TextIO | None = None
        self._wandb: Any = None
        self._tensorboard: Any = None
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
        if "tensorboard" in self.sinks:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(Path(output_dir) / "tensorboard"))

    def log(self, metrics: dict[str, float], step: int) -> None:
        record = {"step": step, **metrics}
        if self._progress is not None:
            self._progress.update(record, step)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if self._tensorboard is not None:
            for key, value in metrics.items():
                self._tensorboard.add_scalar(key, value, step)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tensorboard is not None:
            self._tensorboard.close()
