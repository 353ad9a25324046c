"""A verl-style custom reward: `reward=custom reward.custom_path=examples/custom_reward.py`.

Signature (the same as verl's ``custom_reward_function``):
``(data_source, solution_str, ground_truth, extra_info) -> float | dict``. A dict must hold
``score``; its other keys are averaged into the reward metrics. It runs in the reward process
pool with ``reward.timeout_s``: an exception, a timeout or a non-finite score counts as 0.
"""

from __future__ import annotations

import re


def compute_score(data_source: str, solution_str: str, ground_truth: str | None,
                  extra_info: dict) -> dict:
    numbers = re.findall(r"-?\d+(?:\.\d+)?", solution_str)
    answer = numbers[-1] if numbers else None
    correct = ground_truth is not None and answer == ground_truth.strip()
    return {"score": 1.0 if correct else 0.0, "has_answer": float(answer is not None)}
