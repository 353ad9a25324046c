"""Reward servers in Ray actors, and the client a replica scores through.

- ``start_reward_servers(cfg.reward)``: one actor per server kind in ``reward.kind``
  (``model`` -> ``RewardModelServer``, ``judge`` -> ``JudgeServer``), started and loaded
  before it returns; the runtime starts them once per run and hands the handles to every
  replica, so replicas share one copy of each model instead of loading their own.
- ``RemoteScorer``: what ``make_reward_scorer`` gives a replica for such a kind; the reward
  pool's interface (``async score``, ``metrics``, ``close``). Calls are awaited on the
  replica's event loop (never a blocking ``ray.get``) and, like the pool's, never raise: a
  failed call (the actor died, the prompt is missing, the judge prompt is too long) scores 0
  and counts as ``failures``, one past ``timeout_s`` as ``timeouts`` (and is cancelled), an
  answer the judge gave no score in as ``unparseable`` (counted in ``failures`` too, so the
  replica's reward failures include it). A non-finite score is passed on: the replica drops
  its group (as it does for the pool's).

Depends on config, the two servers and ``prompt``; the runtime depends on this module.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from pathlib import Path
from typing import Any

from streamrl.config import RewardConfig
from streamrl.rollout_fleet.rewards.prompt import prompt_of

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0
"""Loading a model (or starting a vLLM judge on CPU) takes minutes at most; longer, the actor is
most likely waiting for CPUs or GPUs the run's pools already hold."""
FAILURE_KINDS = ("failures", "timeouts", "unparseable")
LOG_EVERY = 100


def resolve_paths(cfg: RewardConfig) -> dict[str, str]:
    """The model directory of each server kind in ``cfg.kinds``; a bad path is a ConfigError
    here, on the driver, before any actor starts. ``reward.model.path=tiny`` builds the offline
    tiny reward model (``tiny_rm``)."""
    from streamrl.models import default_tiny_model_dir, resolve_model_path

    paths = {}
    if "model" in cfg.kinds:
        assert cfg.model.path is not None  # validate() requires it
        if cfg.model.path == "tiny":
            from streamrl.rollout_fleet.rewards.tiny_rm import build_tiny_reward_model

            target = Path(default_tiny_model_dir()).parent / "tiny-rm"
            paths["model"] = str(build_tiny_reward_model(target))
        else:
            paths["model"] = resolve_model_path(cfg.model.path, "reward.model.path")
    if "judge" in cfg.kinds:
        assert cfg.judge.model_path is not None
        paths["judge"] = resolve_model_path(cfg.judge.model_path, "reward.judge.model_path")
    return paths


def start_reward_servers(cfg: RewardConfig) -> dict[str, Any]:
    """Start (and load) the actor of each server kind ``cfg.kind`` names; kind -> handle.
    Empty when the reward needs no server. The caller stops them (``shutdown``, then kill)."""
    import ray

    from streamrl.rollout_fleet.rewards.judge import JudgeServer
    from streamrl.rollout_fleet.rewards.reward_model import RewardModelServer

    paths = resolve_paths(cfg)
    handles: dict[str, Any] = {}
    try:
        for kind, path in paths.items():
            server_cfg = cfg.model if kind == "model" else cfg.judge
            server_cls = RewardModelServer if kind == "model" else JudgeServer
            actor_cls = ray.remote(num_cpus=server_cfg.num_cpus, num_gpus=server_cfg.num_gpus)(
                server_cls)
            handles[kind] = actor_cls.remote(server_cfg, path)
            try:
                ray.get(handles[kind].setup.remote(), timeout=START_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(
                    f"reward.{kind}: its actor did not start within {START_TIMEOUT_S:g} s: are "
                    f"reward.{kind}.num_cpus={server_cfg.num_cpus:g} / num_gpus="
                    f"{server_cfg.num_gpus:g} free outside the run's pools?") from None
    except Exception:
        for handle in handles.values():
            ray.kill(handle)
        raise
    return handles


class RemoteScorer:
    """A replica's scorer for the reward server behind ``handle``; see the module docstring."""

    def __init__(self, kind: str, handle: Any, timeout_s: float) -> None:
        self.kind, self.handle, self.timeout_s = kind, handle, timeout_s
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    async def score(
        self, data_source: str, solution_str: str, ground_truth: str | None,
        extra_info: dict[str, Any],
    ) -> float:
        self._count("calls")
        try:
            prompt = prompt_of(extra_info)
        except KeyError as exc:
            return self._fail("failures", f"{data_source}: {exc.args[0]}")
        ref = self.handle.score.remote(prompt, solution_str, ground_truth)
        try:
            value = await asyncio.wait_for(ref, self.timeout_s)
        except asyncio.TimeoutError:
            self._cancel(ref)
            return self._fail("timeouts", f"{data_source}: no score after {self.timeout_s}s")
        except asyncio.CancelledError:
            self._cancel(ref)  # the replica gave up on the group: free the server's slot
            raise
        except Exception as exc:
            return self._fail("failures", f"{data_source}: {type(exc).__name__}: {exc}")
        if value is None:
            self._count("failures")
            return self._fail("unparseable", f"{data_source}: the judge's answer has no score "
                                             "(the judge actor logs it)")
        return float(value)  # a non-finite one included: the replica drops its group

    @staticmethod
    def _cancel(ref: Any) -> None:
        import ray

        try:
            ray.cancel(ref)
        except Exception as exc:  # already finished, or the actor is gone
            logger.debug("ray.cancel of a reward call failed: %s", exc)

    def _count(self, kind: str) -> int:
        with self._lock:
            self._counts[kind] += 1
            return self._counts[kind]

    def _fail(self, kind: str, cause: str) -> float:
        n = self._count(kind)
        if n == 1 or n % LOG_EVERY == 0:
            logger.warning("reward.kind=%s %s #%d (scored 0.0): %s", self.kind, kind, n, cause)
        return 0.0

    def metrics(self) -> dict[str, float]:
        """Counts since start: calls and each failure kind."""
        with self._lock:
            return {k: float(self._counts[k]) for k in ("calls", *FAILURE_KINDS)}

    def close(self) -> None:
        """Nothing to release here: the server belongs to the run, not to one replica."""
