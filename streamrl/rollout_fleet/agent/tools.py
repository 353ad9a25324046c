"""Tools: plain Python callables, described to the model by a JSON schema, run with a timeout.

Parts:
- ``Tool``: a callable and its schema. ``as_tool(fn)`` derives the schema from the type hints
  and the Google-style docstring (``Args:`` names every parameter) with transformers'
  ``get_json_schema``, the same schema ``apply_chat_template(tools=[fn])`` renders.
- ``ToolBox``: the tools of one episode by name; ``run(call)`` returns a ``ToolResult`` whose
  message is the ``tool`` observation. Every way a call can go wrong (unknown tool, arguments
  that do not bind, the tool raises, runs past ``timeout_s``, or returns something that is not
  a string and not JSON-serializable) is a result with ``error`` set and an ``Error: ...``
  message: the model sees what went wrong, the run goes on.

Sync tools run on the agent's thread pool (never on the event loop); a sync tool that hangs
past its timeout is abandoned, but its thread runs on until the function returns (Python cannot
kill a thread). Write long-running tools as ``async def`` and they are cancelled instead.
Depends on parsers.py only.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from streamrl.rollout_fleet.agent.parsers import ToolCall


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]
    """``{"type": "function", "function": {"name", "description", "parameters"}}``"""


_SCHEMAS: dict[Callable[..., Any], dict[str, Any]] = {}


def _schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The schema of ``fn``, cached by its function (bound methods of every instance of an
    environment share one entry: 'self' is not a parameter of the bound method)."""
    key = getattr(fn, "__func__", fn)
    cached = _SCHEMAS.get(key)
    if cached is not None:
        return cached
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(fn)
    except Exception as exc:  # transformers raises its own docstring/type-hint error types
        raise ValueError(f"tool {getattr(fn, '__qualname__', fn)!r}: cannot derive its JSON "
                         f"schema ({exc}); give every parameter a type hint and an 'Args:' "
                         "line in the docstring") from exc
    schema["function"].pop("return", None)  # not part of the chat-template tool format
    _SCHEMAS[key] = schema
    return schema


def as_tool(fn: Callable[..., Any] | Tool) -> Tool:
    """A Tool from a plain function, bound method or async function."""
    if isinstance(fn, Tool):
        return fn
    schema = _schema(fn)
    return Tool(name=schema["function"]["name"], fn=fn, schema=schema)


@dataclass(frozen=True)
class ToolResult:
    message: dict[str, Any]
    """The ``{"role": "tool", "name": ..., "content": ...}`` observation message."""
    error: str | None = None


def error_message(text: str, name: str | None = None) -> dict[str, Any]:
    """A tool observation reporting ``text`` as an error."""
    message = {"role": "tool", "content": f"Error: {text}"}
    if name:
        message["name"] = name
    return message


class ToolBox:
    """The tools one episode may call, by name."""

    def __init__(self, tools: Iterable[Callable[..., Any] | Tool], executor: Executor) -> None:
        self.tools: dict[str, Tool] = {}
        for tool in map(as_tool, tools):
            if tool.name in self.tools:
                raise ValueError(f"two tools are named {tool.name!r}")
            self.tools[tool.name] = tool
        self.executor = executor

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    async def run(self, call: ToolCall, timeout_s: float) -> ToolResult:
        tool = self.tools.get(call.name)
        if tool is None:
            return _failed(call.name, f"unknown tool {call.name!r}; available: "
                                      f"{sorted(self.tools)}")
        try:
            inspect.signature(tool.fn).bind(**call.arguments)
        except TypeError as exc:
            return _failed(call.name, f"bad arguments for {call.name}: {exc}")
        try:
            result = await asyncio.wait_for(self._invoke(tool, call.arguments), timeout_s)
        except asyncio.TimeoutError:
            return _failed(call.name, f"{call.name} timed out after {timeout_s:g}s")
        except Exception as exc:  # a tool's own bug is the model's observation, not our crash
            return _failed(call.name, f"{call.name} raised {type(exc).__name__}: {exc}")
        if isinstance(result, str):
            content = result
        else:
            try:
                content = json.dumps(result, allow_nan=False)
            except (TypeError, ValueError) as exc:
                return _failed(call.name, f"{call.name} returned a {type(result).__name__}, "
                                          f"which is not JSON-serializable ({exc})")
        return ToolResult(message={"role": "tool", "name": call.name, "content": content})

    def _invoke(self, tool: Tool, arguments: dict[str, Any]) -> Any:
        if inspect.iscoroutinefunction(tool.fn):
            return tool.fn(**arguments)
        return asyncio.get_running_loop().run_in_executor(
            self.executor, functools.partial(tool.fn, **arguments))


def _failed(name: str, why: str) -> ToolResult:
    return ToolResult(message=error_message(why, name), error=why)
