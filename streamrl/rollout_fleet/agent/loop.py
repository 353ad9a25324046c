"""The episode runner: one agent episode as ONE growing token sequence (DESIGN.md §5).

The loop, for one episode (a group runs n of them concurrently)::

    env = agent.new_env(); tools = ToolBox(env.tools + rollout.tools)
    ids = render(env.reset(prompt), tools=schemas)      # the first prompt, generation prompt on
    response = []                                       # sampled + observation tokens
    for k in range(max_turns):
        c = sample(ids + response, min(max_new_tokens, budget left))   # aborts resume inside
        response += c.token_ids        (loss_mask 1, the engine's log-probs and versions)
        turn = parse(decode(c.token_ids)); run turn's tool calls -> tool messages (errors too)
        obs, reward, done, info = env.step(turn)        # episode reward = sum of step rewards
        if done or not obs: stop
        if k + 1 == max_turns or budget spent: truncated (the env saw turn.last and scored it)
        delta = render_delta(obs)                       # chat-template delta, never re-encoded
        if delta does not fit the budget: truncated, reward += env.truncate(turn)
        response += delta              (loss_mask 0, log-prob 0.0, version -1)

So turn k+1's prompt is exactly turn k's prompt + its sampled ids + the observation ids. The
budget ``max_episode_tokens`` counts sampled and observation tokens and is carried across
turns; within a turn, a request interrupted by an ``abort`` weight update is resumed by the
sampler (the replica's request machinery) with the turn's remaining tokens.

Finish reasons: ``stop`` (the environment ended it), ``max_turns`` and ``length`` (truncated:
``Episode.truncated``). Errors in tool calls are observations and counts, never exceptions;
an environment that raises fails the episode (the replica fails and counts its group).

Parts: ``Agent`` (what a replica needs to run episodes: env factory, renderer, shared tools,
budgets, the tool thread pool), ``Sampler`` (the replica's request function), ``Episode`` (the
result, turned into a Trajectory by the replica), ``run_episode``.
Dependencies: env.py, parsers.py, render.py, tools.py, engine.py (Completion), types.py.
"""

from __future__ import annotations

import inspect
import json
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Protocol

from streamrl.rollout_fleet.agent.env import AssistantTurn, Environment, Message, StepResult
from streamrl.rollout_fleet.agent.parsers import get_parser
from streamrl.rollout_fleet.agent.render import ChatRenderer
from streamrl.rollout_fleet.agent.tools import Tool, ToolBox
from streamrl.rollout_fleet.engine import Completion
from streamrl.types import OBSERVATION_VERSION


class Sampler(Protocol):
    async def __call__(self, prompt_ids: list[int], max_tokens: int, request_id: str
                       ) -> Completion:
        """One completion of ``prompt_ids`` (resumed across aborts) of at most max_tokens."""


@dataclass
class Agent:
    new_env: Callable[[], Environment]
    renderer: ChatRenderer
    tokenizer: Any
    tools: Sequence[Tool]
    """Tools every episode gets (``rollout.tools``), besides its environment's own."""
    executor: Executor
    """Runs sync tools off the event loop."""
    max_turns: int
    max_episode_tokens: int
    max_turn_tokens: int
    """Cap of one turn's sampled tokens (``rollout.max_new_tokens``)."""
    tool_timeout_s: float
    max_model_len: int


@dataclass
class Episode:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reward: float = 0.0
    finish_reason: str = "stop"
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    turn_starts: list[int] = field(default_factory=list)
    """Offset in response_ids where each assistant turn's sampled ids begin."""
    info: dict[str, Any] = field(default_factory=dict)
    """The environment's info dicts merged (later steps win), JSON types only."""
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("gen_s", "render_s", "parse_s", "tool_s", "env_s"), 0.0))

    @property
    def truncated(self) -> bool:
        return self.finish_reason in ("length", "max_turns")

    def add(self, ids: list[int], logprobs: list[float], versions: list[int], policy: bool
            ) -> None:
        self.response_ids += ids
        self.loss_mask += [int(policy)] * len(ids)
        self.logprobs += logprobs
        self.versions += versions

    def summary(self) -> dict[str, Any]:
        return {"turns": self.turns, "tool_calls": self.tool_calls,
                "tool_errors": self.tool_errors, "truncated": self.truncated,
                "turn_starts": list(self.turn_starts)}


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _step_result(value: Any) -> StepResult:
    try:
        result = StepResult(*value)
    except TypeError as exc:
        raise TypeError(f"environment step() must return (observation, reward, done, info), "
                        f"got {value!r}") from exc
    if result.observation is not None and not isinstance(result.observation, list):
        raise TypeError(f"environment step(): observation must be a list of messages or None, "
                        f"got {type(result.observation).__name__}")
    return result


def _plain(info: dict[str, Any]) -> dict[str, Any]:
    """JSON types only, so the trajectory stays msgpack-encodable whatever the env returns."""
    return json.loads(json.dumps(info, default=str))


async def run_episode(agent: Agent, prompt: Any, sample: Sampler, episode_id: str) -> Episode:
    """Run one episode of ``agent``'s environment on ``prompt``; see the module docstring."""
    env = agent.new_env()
    tools = ToolBox([*getattr(env, "tools", ()), *agent.tools], agent.executor)
    parser = get_parser(getattr(env, "parser", "hermes"))
    clock = time.perf_counter
    first: list[Message] = list(await _maybe_await(env.reset(prompt)))
    start = clock()
    episode = Episode(prompt_ids=agent.renderer.prompt(first, tools.schemas))
    episode.seconds["render_s"] += clock() - start
    longest = len(episode.prompt_ids) + agent.max_episode_tokens
    if longest > agent.max_model_len:
        raise ValueError(f"episode {episode_id}: first prompt ({len(episode.prompt_ids)} tokens) "
                         f"+ rollout.max_episode_tokens={agent.max_episode_tokens} exceeds "
                         f"rollout.max_model_len={agent.max_model_len}")
    for k in range(agent.max_turns):
        left = agent.max_episode_tokens - len(episode.response_ids)
        start = clock()
        c = await sample(episode.prompt_ids + episode.response_ids,
                         min(agent.max_turn_tokens, left), f"{episode_id}-t{k}")
        episode.seconds["gen_s"] += clock() - start
        episode.turn_starts.append(len(episode.response_ids))
        episode.add(c.token_ids, c.logprobs, c.versions, policy=True)
        episode.turns += 1
        last = k + 1 == agent.max_turns or len(episode.response_ids) >= agent.max_episode_tokens

        start = clock()
        text = agent.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        parsed = parser.parse(text)
        episode.seconds["parse_s"] += clock() - start
        turn = AssistantTurn(index=k, text=text, content=parsed.content,
                             token_ids=list(c.token_ids), finish_reason=c.finish_reason,
                             last=last, tool_calls=parsed.calls)
        start = clock()
        for call in parsed.calls:
            result = await tools.run(call, agent.tool_timeout_s)
            turn.tool_messages.append(result.message)
            turn.tool_errors += result.error is not None
        turn.tool_messages += [{"role": "tool", "content": f"Error: {e}"} for e in parsed.errors]
        turn.tool_errors += len(parsed.errors)
        episode.tool_calls += len(parsed.calls) + len(parsed.errors)
        episode.tool_errors += turn.tool_errors
        episode.seconds["tool_s"] += clock() - start

        start = clock()
        step = _step_result(await _maybe_await(env.step(turn)))
        episode.seconds["env_s"] += clock() - start
        reward = float(step.reward)
        episode.reward += reward if math.isfinite(reward) else math.nan
        episode.info.update(_plain(step.info or {}))
        if step.done or not step.observation:
            episode.finish_reason = "stop"
            break
        if last:
            episode.finish_reason = "max_turns" if k + 1 == agent.max_turns else "length"
            break
        start = clock()
        delta = agent.renderer.observation(step.observation, c.token_ids)
        episode.seconds["render_s"] += clock() - start
        # At least one sampled token must still fit after the observation.
        if len(episode.response_ids) + len(delta) >= agent.max_episode_tokens:
            episode.finish_reason = "length"
            episode.reward += float(await _maybe_await(env.truncate(turn)))
            break
        episode.add(delta, [0.0] * len(delta), [OBSERVATION_VERSION] * len(delta), policy=False)
    return episode
