"""The environment seam: what a user writes to train an agent.

An environment is created once per episode (``Environment()``, no arguments) and holds that
episode's state. Two methods, each may be sync or ``async`` (sync ones run on the event loop,
so keep them quick, or make them async)::

    reset(prompt)      -> the first messages (chat dicts; may start with a system message)
    step(turn)         -> StepResult(observation, reward, done, info)  (a plain 4-tuple works)

``turn`` is the ``AssistantTurn`` the model just produced: its decoded ``text``, the parsed
``tool_calls`` and, already run by the episode runner, ``tool_messages`` (one ``tool`` message
per call, errors included). The observation is a list of messages (e.g. ``turn.tool_messages``
or a ``user`` reply) appended to the conversation; ``None`` or ``done`` ends the episode. The
episode's reward is the sum of the step rewards. ``turn.last`` tells the environment that the
runner will stop after this step whatever it answers (max turns or the token budget), so this is
its chance to score a truncated episode. If the runner has to stop after a step that asked to go
on (its observation does not fit the token budget), it calls ``truncate(turn)`` (optional, may be
async) and adds the reward it returns.

Class attributes: ``tools`` (callables offered to the model; bound methods may use the
episode's state), ``parser`` (a name in ``parsers.PARSERS`` or a ``ToolCallParser``).
``Environment.step``'s default serves tool-using agents: tool results are the observation, and
a turn without tool calls ends the episode with reward 0 (override it to score).

Depends on parsers.py only (and on the duck-typed prompt: ``streamrl.data.Prompt``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from streamrl.rollout_fleet.agent.parsers import ToolCall, ToolCallParser

Message = dict[str, Any]


class StepResult(NamedTuple):
    observation: list[Message] | None
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] | None = None


@dataclass
class AssistantTurn:
    index: int
    """0 for the first assistant turn of the episode."""
    text: str
    """The sampled tokens decoded (special tokens dropped)."""
    content: str
    """``text`` without its tool-call blocks."""
    token_ids: list[int]
    finish_reason: str
    """stop (the model ended its turn) | length (the turn's token cap)"""
    last: bool
    """The runner stops after this step (max turns reached or the token budget spent)."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_messages: list[Message] = field(default_factory=list)
    """Results of the calls, in order, then one error message per ill-formed call."""
    tool_errors: int = 0

    @property
    def message(self) -> Message:
        """This turn as a chat message (for environments that keep the conversation)."""
        msg: Message = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = [c.as_message_call() for c in self.tool_calls]
        return msg


class Environment:
    """Base class of agent environments; see the module docstring."""

    tools: Sequence[Callable[..., Any]] = ()
    """Tools offered to the model (a property may return bound methods using the state)."""
    parser: ClassVar[str | ToolCallParser] = "hermes"

    def reset(self, prompt: Any) -> Any:
        """The first messages for ``prompt`` (a ``streamrl.data.Prompt``)."""
        raise NotImplementedError(f"{type(self).__name__} must define reset(prompt)")

    def truncate(self, turn: AssistantTurn) -> Any:
        """Extra reward when the episode is cut after ``turn`` although it asked to go on."""
        return 0.0

    def step(self, turn: AssistantTurn) -> Any:
        if turn.tool_calls or turn.tool_messages:
            return StepResult(turn.tool_messages, 0.0, False)
        return StepResult(None, 0.0, True)
