"""Tool-call parsers: turn an assistant turn's text into tool calls, in the model's own format.

Parts: ``ToolCall`` (one well-formed call), ``ParsedTurn`` (what a parser returns: the text
without its call blocks, the calls, and one message per ill-formed block), ``ToolCallParser``
(the seam: one method), ``HermesParser`` (Hermes / Qwen2.5 / Qwen3:
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``) and ``PARSERS`` / ``get_parser``
(parsers by name; an environment picks one with its ``parser`` attribute).

A parser never raises on model output: an ill-formed block becomes an entry of
``ParsedTurn.errors``, which the episode runner turns into an error observation.
Depends on nothing else in streamrl.
"""

from __future__ import annotations

import abc
import json
import re
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def as_message_call(self) -> dict[str, Any]:
        """The OpenAI / chat-template shape of this call (``message["tool_calls"]`` entries)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedTurn:
    content: str
    """The turn's text with the tool-call blocks removed."""
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """One line per ill-formed call block."""


class ToolCallParser(abc.ABC):
    @abc.abstractmethod
    def parse(self, text: str) -> ParsedTurn:
        """Split a decoded assistant turn into content, calls and ill-formed-call errors."""


class HermesParser(ToolCallParser):
    """``<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>``, any number per turn.

    ``arguments`` may also be a JSON-encoded string of an object (some models write it so).
    An opening tag without a closing one (the turn ran out of tokens mid-call) is an error.
    """

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        calls: list[ToolCall] = []
        errors: list[str] = []
        for body in self._BLOCK.findall(text):
            call = _hermes_call(body.strip())
            if isinstance(call, ToolCall):
                calls.append(call)
            else:
                errors.append(call)
        rest = self._BLOCK.sub("", text)
        if self.OPEN in rest:
            errors.append(f"ill-formed tool call: {self.OPEN} without {self.CLOSE}")
            rest = rest.split(self.OPEN, 1)[0]
        return ParsedTurn(content=rest.strip(), calls=calls, errors=errors)


def _hermes_call(body: str) -> ToolCall | str:
    """The call in one block, or an error line saying what is wrong with it."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return f"ill-formed tool call: not JSON ({exc.msg} at char {exc.pos}): {body[:80]!r}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return f"ill-formed tool call: needs a JSON object with a string 'name': {body[:80]!r}"
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return f"ill-formed tool call to {obj['name']!r}: 'arguments' is not a JSON object"
    if not isinstance(args, dict):
        return f"ill-formed tool call to {obj['name']!r}: 'arguments' is not a JSON object"
    return ToolCall(name=obj["name"], arguments=args)


PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "qwen": HermesParser}


def get_parser(parser: str | ToolCallParser) -> ToolCallParser:
    """A parser instance from a name in ``PARSERS`` or an instance (returned as is)."""
    if isinstance(parser, ToolCallParser):
        return parser
    if parser not in PARSERS:
        raise ValueError(f"tool-call parser {parser!r}: must be one of {sorted(PARSERS)} or a "
                         "ToolCallParser instance")
    return PARSERS[parser]()
