"""GSM8K answer extraction and scoring, with verl's semantics (verl/utils/reward_score/gsm8k.py).

``strict``: the last ``#### <number>`` in the response (the format the prompt asks for);
``flexible``: the last number anywhere. Only the last 300 characters are searched (long
regexes over whole responses are slow, and the answer comes last). Commas and ``$`` are
dropped; the answer must equal the ground truth string exactly.
"""

from __future__ import annotations

import re

_SOLUTION_CLIP_CHARS = 300
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_FLEXIBLE = re.compile(r"(\-?[0-9\.\,]+)")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k extract_solution: method={method!r} must be strict|flexible")
    text = solution_str[-_SOLUTION_CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(text)
        return found[-1].replace(",", "").replace("$", "") if found else None
    for candidate in reversed(_FLEXIBLE.findall(text)):
        if candidate not in ("", "."):
            return candidate
    return None


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """``score`` for a correct answer, ``format_score`` for a wrong one, 0 if none was found."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    return score if answer == ground_truth.strip() else format_score
