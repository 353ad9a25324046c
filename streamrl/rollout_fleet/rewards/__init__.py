"""Rewards for the rollout fleet: rule functions in a process pool, reward models and LLM
judges in shared Ray actors, and their weighted sums.

Parts: ``gsm8k`` (``####`` answers: verl's methods and a lenient default), ``math_answer``
(math-verify), ``rgym`` (reasoning-gym's own scorers), the toy task (``streamrl.data.toy``),
``custom`` (verl-style ``custom_reward_function.path/name``), ``dispatch`` (which scorer a
data_source gets; runs in the workers) and ``pool`` (``RewardScorer``: the process pool,
timeouts, failure counting); ``reward_model`` (``RewardModelServer``: an HF sequence-
classification RM, micro-batched by ``batching``), ``judge`` (``JudgeServer``: an LLM judge on a
rollout engine), ``remote`` (``start_reward_servers``: their actors; ``RemoteScorer``: a
replica's client), ``combine`` (``WeightedScorer``), ``prompt`` (how the prompt reaches them)
and ``tiny_rm`` (an offline tiny reward model for tests and examples).

``reward.kind`` picks the parts: ``rule`` (the scorer ``reward.name`` picks), ``custom``
(``reward.custom_path``), ``model``, ``judge``, or a list of them added with ``reward.weights``.
The runtime calls ``start_reward_servers(cfg.reward)`` once per run; each replica calls
``make_reward_scorer(cfg.reward, servers)``; ``await scorer.score(data_source, solution_str,
ground_truth, extra_info)``; ``scorer.metrics()``; ``scorer.close()``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from streamrl.config import RewardConfig
from streamrl.rollout_fleet.rewards.combine import WeightedScorer
from streamrl.rollout_fleet.rewards.dispatch import ScorerSpec, compute_score, scorer_for
from streamrl.rollout_fleet.rewards.pool import RewardConfigError, RewardScorer
from streamrl.rollout_fleet.rewards.remote import RemoteScorer, start_reward_servers

__all__ = [
    "RemoteScorer", "RewardConfigError", "RewardScorer", "ScorerSpec", "WeightedScorer",
    "compute_score", "make_reward_scorer", "scorer_for", "start_reward_servers",
]


def make_reward_scorer(cfg: RewardConfig, servers: Mapping[str, Any] | None = None,
                       sources: tuple[str, ...] = ()) -> Any:
    """The scorer ``cfg.kind`` describes; ``servers``: ``start_reward_servers(cfg)``'s handles
    (needed for ``model`` and ``judge``); ``sources``: the task's data sources, when known (the
    rule workers then import only their scorers). One kind of weight 1 is that kind's scorer
    itself."""
    kinds = cfg.kinds
    weights = cfg.weights or (1.0,) * len(kinds)
    parts: list[tuple[str, float, Any]] = []
    try:
        for kind, weight in zip(kinds, weights, strict=True):
            parts.append((kind, float(weight), _one_scorer(cfg, kind, servers or {}, sources)))
    except Exception:
        for _, _, part in parts:
            part.close()
        raise
    if len(parts) == 1 and parts[0][1] == 1.0:
        return parts[0][2]
    return WeightedScorer(parts)


def _one_scorer(cfg: RewardConfig, kind: str, servers: Mapping[str, Any],
                sources: tuple[str, ...]) -> Any:
    if kind == "rule":
        # Beside reward.kind=custom, the rule part keeps to the built-in scorers.
        rule_cfg = dataclasses.replace(cfg, custom_path=None) if "custom" in cfg.kinds else cfg
        return RewardScorer(rule_cfg, sources=sources)
    if kind == "custom":
        return RewardScorer(dataclasses.replace(cfg, name="custom"))
    if kind not in servers:
        raise RewardConfigError(f"reward.kind={kind}: no {kind} server was started (the "
                                "runtime calls start_reward_servers(cfg.reward) for it)")
    timeout = cfg.model.timeout_s if kind == "model" else cfg.judge.timeout_s
    return RemoteScorer(kind, servers[kind], timeout)
