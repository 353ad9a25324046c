"""Which scorer grades a response, and the entry points the reward worker processes run.

``compute_score`` is streamrl's ``default_compute_score``: with ``reward.name=auto`` it picks
the scorer from ``data_source`` as verl does ("openai/gsm8k" -> gsm8k, MATH-style sources ->
math-verify, "reasoning_gym/<dataset>" -> that dataset's scorer, "toy/<task>" -> the toy task);
any other ``reward.name`` forces one scorer; a custom function (``reward.custom_path``) takes
precedence under ``auto`` and ``custom``, like verl's ``custom_reward_function``.

``warmup`` and ``score_batch_in_worker`` run inside the worker processes of
:class:`~streamrl.rollout_fleet.rewards.pool.RewardScorer`; results come back normalized to
``(score, {metric: value})`` of plain floats.
"""

from __future__ import annotations

import ctypes
import math
import numbers
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux; elsewhere a no-op):
    reward processes must not outlive their replica, however it ends (kill -9 included)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


GSM8K_SOURCES = frozenset({"openai/gsm8k", "gsm8k"})
MATH_SOURCES = frozenset({
    "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500",
    "math_dapo", "math", "MATH",
})
MATH_PREFIXES = ("aime", "numina_", "math_")
NAMES = ("auto", "toy", "gsm8k", "math_verify", "reasoning_gym", "custom")


@dataclass(frozen=True)
class ScorerSpec:
    """What a worker needs to score: small and picklable (crosses into the worker once per call)."""

    name: str = "auto"
    custom_path: str | None = None
    custom_name: str = "compute_score"
    sources: tuple[str, ...] = ()
    """The data sources the task's prompts carry, when known: the warm-up imports only their
    scorers (none of the heavy libraries for the toy task). Empty: every built-in scorer's."""

    @property
    def uses_custom(self) -> bool:
        return self.custom_path is not None and self.name in ("auto", "custom")


def scorer_for(name: str, data_source: str) -> str:
    """The scorer ``reward.name`` + ``data_source`` select (custom functions excluded)."""
    if name not in NAMES:
        raise ValueError(f"reward.name={name!r}: must be one of {NAMES}")
    if name != "auto":
        return name
    if data_source in GSM8K_SOURCES:
        return "gsm8k"
    if data_source in MATH_SOURCES or data_source.startswith(MATH_PREFIXES):
        return "math_verify"
    if data_source.startswith("reasoning_gym/"):
        return "reasoning_gym"
    if data_source.startswith("toy/"):
        return "toy"
    raise ValueError(f"reward.name=auto has no scorer for data_source={data_source!r}: set "
                     "reward.name or custom_reward_function.path")


def compute_score(
    spec: ScorerSpec,
    data_source: str,
    solution_str: str,
    ground_truth: str | None,
    extra_info: dict[str, Any],
) -> Any:
    """Raw result of the selected scorer (a number or a dict with "score")."""
    if spec.uses_custom:
        from streamrl.rollout_fleet.rewards.custom import load_custom_function

        assert spec.custom_path is not None
        fn = load_custom_function(spec.custom_path, spec.custom_name)
        return fn(data_source, solution_str, ground_truth, extra_info)
    if spec.name == "custom":
        raise ValueError("reward.name=custom needs reward.custom_path")
    scorer = scorer_for(spec.name, data_source)
    if scorer == "reasoning_gym":
        from streamrl.rollout_fleet.rewards import rgym

        return rgym.compute_score(data_source, solution_str, ground_truth, extra_info)
    if ground_truth is None:
        raise ValueError(f"{scorer} scorer: data_source={data_source!r} has no ground truth")
    if scorer == "gsm8k":
        from streamrl.rollout_fleet.rewards import gsm8k

        return gsm8k.compute_score(solution_str, ground_truth)
    if scorer == "math_verify":
        from streamrl.rollout_fleet.rewards import math_answer

        return math_answer.compute_score(solution_str, ground_truth)
    from streamrl.data import toy

    task = extra_info.get("task") or data_source.removeprefix(toy.DATA_SOURCE_PREFIX)
    return toy.toy_reward(task, solution_str, ground_truth, extra_info.get("max_new_tokens"))


def normalize(result: Any) -> tuple[float, dict[str, float]]:
    """A number, or a dict with "score" (other numeric keys become metrics), as plain floats."""
    if isinstance(result, dict):
        if "score" not in result:
            raise KeyError(f"reward function returned a dict without 'score': keys {list(result)}")
        extras = {str(k): float(v) for k, v in result.items()
                  if k != "score" and isinstance(v, numbers.Real)}
        return normalize(result["score"])[0], extras
    if isinstance(result, numbers.Real):  # bool, int, float, numpy scalars
        return float(result), {}
    if hasattr(result, "item"):  # 0-d tensors / arrays
        return normalize(result.item())
    raise TypeError(f"reward function returned {type(result).__name__}, not a number or dict")


def warmup(spec: ScorerSpec) -> int:
    """Import what ``spec`` will need (so first calls are not charged for imports); our pid."""
    if spec.uses_custom:
        from streamrl.rollout_fleet.rewards.custom import load_custom_function

        assert spec.custom_path is not None
        load_custom_function(spec.custom_path, spec.custom_name)
    names = _scorers_used(spec)
    if names & {"auto", "math_verify"}:
        import math_verify  # noqa: F401
    if names & {"auto", "reasoning_gym"}:
        import reasoning_gym  # noqa: F401
    return os.getpid()


def _scorers_used(spec: ScorerSpec) -> set[str]:
    """The built-in scorers ``spec`` will call; {"auto"} where that is not known."""
    if spec.uses_custom:
        return set()
    if spec.name != "auto" or not spec.sources:
        return {spec.name}
    try:
        return {scorer_for(spec.name, source) for source in spec.sources}
    except ValueError:  # a source no scorer takes: its calls say so
        return {"auto"}


def score_in_worker(
    spec: ScorerSpec,
    data_source: str,
    solution_str: str,
    ground_truth: str | None,
    extra_info: dict[str, Any],
) -> tuple[float, dict[str, float]]:
    score, extras = normalize(compute_score(spec, data_source, solution_str, ground_truth,
                                            extra_info))
    return score, {k: v for k, v in extras.items() if math.isfinite(v)}


Item = tuple[str, str, str | None, dict[str, Any]]  # data_source, solution, truth, extra_info


def score_batch_in_worker(
    spec: ScorerSpec, items: list[Item],
) -> list[tuple[float, dict[str, float]] | str]:
    """``score_in_worker`` of each (data_source, solution_str, ground_truth, extra_info): its
    result, or for one that raised, the error as one line (the others still count)."""
    out: list[tuple[float, dict[str, float]] | str] = []
    for item in items:
        try:
            out.append(score_in_worker(spec, *item))
        except Exception as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out
