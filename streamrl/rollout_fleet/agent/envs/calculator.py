"""``calculator``: GSM8K-style word problems with a calculator tool, for real models.

Prompts are chat prompts with a numeric ground truth (``task.source=reasoning_gym`` with
``gsm_symbolic`` / ``basic_arithmetic`` / ``chain_sum``, or verl-format GSM8K parquet files). The
model may call ``calculator(expression)`` any number of times; a turn without a tool call is its
final answer, read after ``####`` (GSM8K's convention). Reward: 1 when the answer is correct
*and* equals a result the calculator returned in this episode (using the tool's result is what
earns the reward), ``no_tool_credit`` (default 0) when it is correct without one, else 0.

``calculator`` evaluates arithmetic only (numbers, + - * / // % **, parentheses) by walking the
expression's syntax tree: no names, calls or attributes, so model-written input never runs code.
Every value stays below ``2**MAX_BITS`` in magnitude, and a power is refused before it is
computed when its result would not: a tool runs on a thread of the replica's process, and
Python holds the GIL while it builds a huge integer (``(((9**64)**64)**64)**64``: 13 s).
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from streamrl.rollout_fleet.agent.env import AssistantTurn, Environment, StepResult
from streamrl.rollout_fleet.rewards.gsm8k import extract_solution

SYSTEM = ("Solve the problem step by step. Use the calculator tool for every computation, then "
          'give the final answer after "####".')
MAX_EXPONENT = 64
MAX_BITS = 1000
"""Largest magnitude of any value, as a power of 2 (about 1e301): inside float range, so every
result that passes prints and compares as a number."""
MAX_EXPRESSION_CHARS = 200

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        # Operands below 2**MAX_BITS keep every other operator cheap: a product has at most
        # twice their bits, and is checked before it is used.
        return _bounded(_BINARY[type(node.op)](left, right))
    raise ValueError(f"unsupported syntax: {type(node).__name__}")


def _check_power(base: float, exponent: float) -> None:
    """Refuse ``base ** exponent`` before computing it when it would leave the bound."""
    if abs(exponent) > MAX_EXPONENT:
        raise ValueError(f"exponent {exponent} is too large (limit {MAX_EXPONENT})")
    # A negative exponent gives a float (computed in constant time, overflow raises).
    if exponent > 0 and abs(base) > 1 and exponent * math.log2(abs(base)) >= MAX_BITS:
        raise ValueError(f"the power is too large (limit 2**{MAX_BITS} in magnitude)")


def _bounded(value: float) -> float:
    if abs(value) >= 2**MAX_BITS:  # exact for ints and floats alike; NaN passes, checked last
        raise ValueError(f"the value is too large (limit 2**{MAX_BITS} in magnitude)")
    return value


def format_number(value: float) -> str:
    """Integers without a decimal point, other values with up to 6 decimals."""
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return f"{value:.6f}".rstrip("0").rstrip(".")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers combined with + - * / // % ** and parentheses, e.g. "(12 + 30) / 7".
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    value = _eval(ast.parse(expression.replace("^", "**"), mode="eval"))
    if not math.isfinite(value):
        raise ValueError("the result is not a finite number")
    return format_number(value)


def _number(text: str | None) -> float | None:
    try:
        return float(str(text).replace(",", "").replace("$", "").strip())
    except ValueError:
        return None


class CalculatorEnv(Environment):
    tools = (calculator,)
    no_tool_credit = 0.0

    def reset(self, prompt: Any) -> list[dict[str, Any]]:
        if not prompt.messages or _number(prompt.ground_truth) is None:
            raise ValueError(f"calculator: prompt {prompt.index} needs chat messages and a "
                             "numeric ground truth (task.source=reasoning_gym or parquet)")
        self.truth = float(_number(prompt.ground_truth))  # type: ignore[arg-type]
        self.results: list[float] = []
        return [{"role": "system", "content": SYSTEM}, *prompt.messages]

    def step(self, turn: AssistantTurn) -> StepResult:
        for call, message in zip(turn.tool_calls, turn.tool_messages):
            value = _number(message["content"])
            if call.name == "calculator" and value is not None:
                self.results.append(value)
        if turn.tool_calls or turn.tool_messages:
            return StepResult(turn.tool_messages, 0.0, False, {"calculator_calls":
                                                                 len(self.results)})
        answer = _number(extract_solution(turn.content, "lenient"))
        correct = answer is not None and math.isclose(answer, self.truth, abs_tol=1e-6)
        used = correct and any(math.isclose(answer, r, abs_tol=1e-6) for r in self.results)
        reward = 1.0 if used else self.no_tool_credit if correct else 0.0
        info = {"correct": float(correct), "used_tool_result": float(used),
                "calculator_calls": len(self.results)}
        return StepResult(None, reward, True, info)
