"""reasoning-gym scoring: each dataset grades answers with its own ``score_answer``.

The scorers grade an answer, not a chain of thought (``gsm_symbolic``'s takes the first number
of what it is given, ``basic_arithmetic``'s wants the exact string, others give partial credit
for containing the answer), so the answer is cut out of the response first, in this order:

1. the last ``<answer>...</answer>``, as written (reasoning-gym's own format and extractor);
2. the text after the last ``####`` (the format streamrl's reasoning-gym prompts ask for);
3. the content of the last ``\\boxed{...}`` (balanced braces);
4. nothing marked: a numeric task gets the number after the last "answer is" / "answer:",
   else the last number in the response; another task gets what follows "answer is" /
   "answer:" on the last line, else the whole response.

A task is numeric when its answer (``entry["answer"]``, else the ground truth) is one number
("-61", "4.86", "1,234"). For numeric tasks steps 2-3 take the number the marked text starts
with (a ``####`` or ``\\boxed`` without one, such as a heading "#### Step 2", is skipped) and
write it the way the answer is written: without thousands commas or a ``.0`` the answer lacks.
Otherwise the marked text is only tidied: markdown emphasis, code ticks, ``$...$``,
``\\text{...}`` and a trailing ``.``/``!`` are stripped unless the answer has them too.

The dataset entry comes from ``extra_info["entry"]`` (streamrl.data.reasoning_gym keeps it
there); without one a minimal entry ``{"answer": ground_truth}`` is graded, which suits datasets
comparing to the answer only.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from streamrl.rollout_fleet.rewards.gsm8k import (
    NUMBER,
    last_boxed,
    last_hash_number,
    leading_number,
)

DATA_SOURCE_PREFIX = "reasoning_gym/"
_NUMERIC = re.compile(rf"\s*(?:{NUMBER})\s*")
_ANY_NUMBER = re.compile(NUMBER)
_PHRASE = re.compile(r"\banswer\b(?:\s+is)?\s*[:=]?", re.IGNORECASE)
_WRAPPERS = (("**", "**"), ("__", "__"), ("`", "`"), ("$", "$"), ("\\text{", "}"),
             ("\\textbf{", "}"), ("\\mathrm{", "}"))


def is_numeric(answer: str) -> bool:
    return _NUMERIC.fullmatch(answer) is not None


def extract_answer(solution_str: str, truth: str = "") -> str:
    """The answer to grade against ``truth`` (the dataset's answer), by the order above."""
    from reasoning_gym.utils import extract_answer as extract_tagged

    tagged = extract_tagged(solution_str)
    if tagged is not None:
        return tagged
    if is_numeric(truth):
        number = _marked_number(solution_str)
        return _written_like(number, truth) if number is not None else solution_str.strip()
    if "####" in solution_str:
        return _tidy(solution_str.rsplit("####", 1)[1], truth)
    boxed = last_boxed(solution_str)
    if boxed is not None:
        return _tidy(boxed, truth)
    last_line = solution_str.strip().rsplit("\n", 1)[-1]
    phrases = list(_PHRASE.finditer(last_line))
    if phrases and (after := _tidy(last_line[phrases[-1].end():], truth)):
        return after
    return _tidy(solution_str, truth)


def _marked_number(text: str) -> str | None:
    number = last_hash_number(text)
    if number is None and (boxed := last_boxed(text)) is not None:
        number = leading_number(boxed)
    if number is None:
        for phrase in reversed(list(_PHRASE.finditer(text))):
            if (number := leading_number(text[phrase.end():])) is not None:
                break
    if number is None and (numbers := _ANY_NUMBER.findall(text)):
        number = numbers[-1]
    return number


def _written_like(number: str, truth: str) -> str:
    """``number`` in ``truth``'s notation: its sign, thousands commas and ``.0`` only if
    ``truth`` has them (the value is unchanged; the dataset's scorer still compares)."""
    truth = truth.strip()
    if not truth.startswith("+"):
        number = number.removeprefix("+")
    if "," not in truth:
        number = number.replace(",", "")
    if "." not in truth and re.fullmatch(r"[-+]?[\d,]+\.0+", number):
        number = number.split(".")[0]
    return number


def _tidy(answer: str, truth: str) -> str:
    """``answer`` without surrounding markup and trailing ``.``/``!`` ``truth`` lacks."""
    truth = truth.strip()
    while True:
        before = answer = answer.strip()
        if answer[-1:] in (".", "!") and not truth.endswith(answer[-1]):
            answer = answer[:-1]
        for left, right in _WRAPPERS:
            inner = answer[len(left):-len(right)]
            if (len(answer) > len(left) + len(right) and answer.startswith(left)
                    and answer.endswith(right) and not truth.startswith(left)
                    and (right != "}" or "}" not in inner)):
                answer = inner
        if answer == before:
            return answer


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
    truth = entry.get("answer")
    if not isinstance(truth, str):
        truth = ground_truth or ""
    return float(_scorer(dataset)(extract_answer(solution_str, truth), entry))
