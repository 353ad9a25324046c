"""Multi-turn agent rollouts: environments, tools, token-in/token-out episodes (DESIGN.md §5).

The package's face. ``make_agent(rollout, tokenizer)`` builds the ``Agent`` a replica runs
episodes with, from ``rollout.agent`` (a built-in name from ``plugins.AGENT_ENVS`` or an import
path ``package.module:Class`` / ``path/to/file.py:Class``), ``rollout.tools``
(``module:function`` / ``file.py:function``) and the budgets ``rollout.max_turns``,
``rollout.max_episode_tokens``, ``rollout.max_new_tokens`` (per turn), ``rollout.tool_timeout_s``.

Rooms, dependencies pointing down:
    loop.py        run_episode: the episode runner (its docstring has the loop)
    render.py      first prompt + chat-template deltas        env.py      Environment seam
    tools.py       callables -> schemas, run with a timeout   parsers.py  tool-call parsers
    envs/          built-in environments                      validation.py  greedy episodes
The replica (``rollout_fleet/replica.py``) owns requests, aborts and resumption; this package
never talks to an engine or the buffer.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from streamrl.config import RolloutConfig
from streamrl.errors import ConfigError
from streamrl.plugins import agent_env_spec, import_file, import_module
from streamrl.rollout_fleet.agent.env import AssistantTurn, Environment, Message, StepResult
from streamrl.rollout_fleet.agent.loop import Agent, Episode, Sampler, run_episode
from streamrl.rollout_fleet.agent.parsers import (
    PARSERS,
    HermesParser,
    ParsedTurn,
    ToolCall,
    ToolCallParser,
)
from streamrl.rollout_fleet.agent.render import ChatRenderer
from streamrl.rollout_fleet.agent.tools import Tool, ToolBox, as_tool
from streamrl.rollout_fleet.agent.validation import validate_episodes

__all__ = [
    "PARSERS", "Agent", "AssistantTurn", "ChatRenderer", "Environment", "Episode",
    "HermesParser", "Message", "ParsedTurn", "Sampler", "StepResult", "Tool", "ToolBox",
    "ToolCall", "ToolCallParser", "as_tool", "load_object", "make_agent", "run_episode",
    "validate_episodes",
]

TOOL_THREADS = 16
"""Threads for sync tools of one replica (a hung tool holds one until it returns)."""


def load_object(spec: str, key: str) -> Any:
    """``package.module:attr`` (imported) or ``path/to/file.py:attr`` (loaded by path); a spec
    that does not load is a ConfigError naming ``key``."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ConfigError(f"{key}={spec!r}: expected 'package.module:name' or 'file.py:name'")
    if target.endswith(".py"):
        module = import_file(target, f"{key}={spec!r}")
    else:
        module = import_module(target, f"{key}={spec!r}")
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ConfigError(f"{key}={spec!r}: {target} defines no {attr!r}")
    return obj


def make_agent(rollout: RolloutConfig, tokenizer: Any) -> Agent:
    """The Agent ``rollout.agent`` names (fails clearly on a bad name, class or tool)."""
    if not rollout.agent:
        raise ValueError("make_agent: rollout.agent is not set")
    env_cls = load_object(agent_env_spec(rollout.agent), "rollout.agent")
    if not (isinstance(env_cls, type) and issubclass(env_cls, Environment)):
        raise TypeError(f"rollout.agent={rollout.agent!r}: {env_cls!r} is not a subclass of "
                        "streamrl.rollout_fleet.agent.Environment")
    tools = [as_tool(load_object(spec, "rollout.tools")) for spec in rollout.tools]
    return Agent(
        new_env=env_cls, renderer=ChatRenderer(tokenizer), tokenizer=tokenizer, tools=tools,
        executor=ThreadPoolExecutor(TOOL_THREADS, thread_name_prefix="streamrl-tool"),
        max_turns=rollout.max_turns, max_episode_tokens=rollout.max_episode_tokens,
        max_turn_tokens=rollout.max_new_tokens, tool_timeout_s=rollout.tool_timeout_s,
        max_model_len=rollout.max_model_len,
    )
