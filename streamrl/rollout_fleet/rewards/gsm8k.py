"""GSM8K answer extraction and scoring: verl's two methods and streamrl's default, ``lenient``.

``strict`` and ``flexible`` are verl's (verl/utils/reward_score/gsm8k.py), kept as written for
verl users calling ``extract_solution``: strict takes the last ``#### <number>`` (``#### `` then
digits, ``.``, ``,`` or ``-``), flexible the last number anywhere, both in the last 300
characters only; strict drops commas and ``$``; ``compute_score`` then wants the answer to
equal the ground truth string exactly. So ``#### 42.`` is "42.", ``#### 42.0`` is "42.0" and
``#### $1,234`` finds nothing: a correct answer scores 0.

``lenient`` (``compute_score``'s default, which ``reward.name=auto`` uses; not in verl) reads
the answer the prompt asks for the way models write it. In order:

1. the number right after the last ``####`` that has one (``####`` followed by markdown,
   ``$``, ``\\$`` or "answer is" before the number is fine; a ``####`` with no number after it,
   such as a markdown heading "#### Step 2", is not an answer);
2. else the number the last ``\\boxed{...}`` (balanced braces) starts with;
3. else no answer: 0, as with strict (free text like "the answer is 42" is not graded; the
   ``flexible`` method grades the last number).

The number is compared as a number: thousands commas, ``$``, ``%``, a trailing ``.`` and
trailing zeros do not count, so ``#### 42.``, ``#### **$42**``, ``#### 42.0`` and ``\\boxed{42}``
all equal "42", and ``#### $1,234`` equals "1234". The whole response is searched (the scans
are linear, so verl's 300-character clip is not needed), so a ``#### 42`` followed by a long
explanation still counts, and a later stray number does not replace it.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_SOLUTION_CLIP_CHARS = 300
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_FLEXIBLE = re.compile(r"(\-?[0-9\.\,]+)")
METHODS = ("lenient", "strict", "flexible")

# A number as models write it: -3, +7, 1,234, 1234.50, .5 (not 1,2345: commas group by three;
# the - of 5-3 is not a sign).
NUMBER = r"(?:(?<![\w.)])[-+])?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
# What may stand between an answer marker and its number: spaces, markdown, $, \$, \(, {,
# \text{ / \textbf{ / \mathbf{ / \boxed{, "the final answer is:".
_LEAD = re.compile(
    r"(?:[\s*_`$({\[]|\\[$(\[]|\\(?:text|textbf|mathbf|mathrm|boxed)\{"
    r"|(?:the\s+)?(?:final\s+)?answer(?:\s+is)?\s*[:=]?)*"
    rf"({NUMBER})",
    re.IGNORECASE,
)
_WHOLE_NUMBER = re.compile(rf"\s*[$]?({NUMBER})\s*%?\s*")


def leading_number(text: str) -> str | None:
    """The number ``text`` starts with (after markdown/LaTeX decoration), as written."""
    match = _LEAD.match(text)
    return match.group(1) if match else None


def last_hash_number(text: str) -> str | None:
    """The number after the last ``####`` that is followed by one, as written."""
    for segment in reversed(text.split("####")[1:]):
        number = leading_number(segment)
        if number is not None:
            return number
    return None


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` whose braces balance (nested ones included)."""
    end = len(text)
    while (start := text.rfind("\\boxed", 0, end)) >= 0:
        end = start
        i = start + len("\\boxed")
        while i < len(text) and text[i] == " ":
            i += 1
        if i >= len(text) or text[i] != "{":
            continue
        depth = 0
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i + 1:j]
    return None


def canonical_number(text: str) -> str | None:
    """``text`` as a canonical number string if it is one number ("$1,234.50" -> "1234.5")."""
    match = _WHOLE_NUMBER.fullmatch(text)
    return _canonical(match.group(1)) if match else None


def _canonical(number: str) -> str | None:
    try:
        value = Decimal(number.replace(",", ""))
    except InvalidOperation:
        return None
    return "0" if value == 0 else format(value.normalize(), "f")


def _lenient(text: str) -> str | None:
    number = last_hash_number(text)
    if number is None:
        boxed = last_boxed(text)
        number = leading_number(boxed) if boxed is not None else None
    return _canonical(number) if number is not None else None


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The answer ``method`` reads: strict/flexible as verl returns it, lenient canonical."""
    if method not in METHODS:
        raise ValueError(f"gsm8k extract_solution: method={method!r} must be one of {METHODS}")
    if method == "lenient":
        return _lenient(solution_str)
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
    method: str = "lenient",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """``score`` for a correct answer, ``format_score`` for a wrong one, 0 if none was found.
    strict/flexible compare strings as verl does; lenient compares numbers."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    truth = ground_truth.strip()
    if method == "lenient":
        truth = canonical_number(truth) or truth
    return score if answer == truth else format_score
