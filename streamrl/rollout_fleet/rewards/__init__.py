"""Reward functions for the rollout fleet, run in a process pool with a per-call timeout.

Parts: ``gsm8k`` (verl's ``####`` extraction), ``math_answer`` (math-verify), ``rgym``
(reasoning-gym's own scorers), the toy task (``streamrl.data.toy``), ``custom`` (verl-style
``custom_reward_function.path/name``), ``dispatch`` (which scorer a data_source gets; runs in
the workers) and ``pool`` (``RewardScorer``: the process pool, timeouts, failure counting).

Replicas use only ``make_reward_scorer(cfg.reward)``; ``await scorer.score(data_source,
solution_str, ground_truth, extra_info)``; ``scorer.metrics()``; ``scorer.close()``.
"""

from streamrl.rollout_fleet.rewards.dispatch import ScorerSpec, compute_score, scorer_for
from streamrl.rollout_fleet.rewards.pool import RewardConfigError, RewardScorer, make_reward_scorer

__all__ = [
    "RewardConfigError", "RewardScorer", "ScorerSpec", "compute_score", "make_reward_scorer",
    "scorer_for",
]
