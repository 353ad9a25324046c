"""A custom reward (verl's signature) that differs between any two answers of unequal length:
every group then has advantages, so an update surely moves the policy (real-model tests)."""

from __future__ import annotations

from typing import Any


def compute_score(data_source: str, solution_str: str, ground_truth: str | None,
                  extra_info: dict[str, Any]) -> float:
    return len(solution_str) / 100.0
