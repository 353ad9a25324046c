"""reasoning-gym scoring: each dataset grades answers with its own ``score_answer``.

The answer is cut out of the response first: the last ``<answer>...</answer>`` (reasoning-gym's
own format), else the text after the last ``####`` (the format streamrl's reasoning-gym prompts
ask for), else the whole stripped response. The dataset entry comes from
``extra_info["entry"]`` (streamrl.data.reasoning_gym keeps it there); without one a minimal
entry ``{"answer": ground_truth}`` is graded, which suits datasets comparing to the answer only.
"""

from __future__ import annotations

import functools
from typing import Any

DATA_SOURCE_PREFIX = "reasoning_gym/"


def extract_answer(solution_str: str) -> str:
    from reasoning_gym.utils import extract_answer as extract_tagged

    tagged = extract_tagged(solution_str)
    if tagged is not None:
        return tagged
    if "####" in solution_str:
        return solution_str.rsplit("####", 1)[1].strip()
    return solution_str.strip()


@functools.cache
def _scorer(dataset: str) -> Any:
    from reasoning_gym import get_score_answer_fn

    return get_score_answer_fn(dataset)


def compute_score(
    data_source: str, solution_str: str, ground_truth: str | None, extra_info: dict[str, Any]
) -> float:
    dataset = data_source.removeprefix(DATA_SOURCE_PREFIX)
    entry = extra_info.get("entry")
    if not isinstance(entry, dict):
        if ground_truth is None:
            raise ValueError(f"reasoning_gym: {data_source!r} has no entry and no ground truth")
        entry = {"answer": ground_truth, "metadata": {}}
    if isinstance(entry.get("metadata"), dict) and "source_dataset" in entry["metadata"]:
        dataset = entry["metadata"]["source_dataset"]
    return float(_scorer(dataset)(extract_answer(solution_str), entry))
