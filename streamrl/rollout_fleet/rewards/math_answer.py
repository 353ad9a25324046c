"""Math answers graded by math-verify (``math_verify.parse`` / ``verify``), like verl's
``math_verify`` scorer: the ground truth is wrapped in ``\\boxed{}`` so plain strings such as
``1/2`` parse as LaTeX; the response is parsed with math-verify's default extractors (LaTeX and
plain expressions, last answer wins). Equivalent forms (``0.5``, ``\\frac{1}{2}``) score 1.

math-verify guards its own parsing with a SIGALRM timeout, which needs the main thread: the
reward pool runs scorers in its worker processes' main threads.
"""

from __future__ import annotations


def compute_score(solution_str: str, ground_truth: str) -> float:
    from math_verify import parse, verify

    gold = parse("\\boxed{" + ground_truth + "}")
    if not gold:
        raise ValueError(f"math_verify: cannot parse ground truth {ground_truth!r}")
    answer = parse(solution_str)
    if not answer:
        return 0.0
    return 1.0 if verify(gold, answer) else 0.0
