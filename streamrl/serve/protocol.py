"""The OpenAI wire format ``streamrl serve`` speaks: typed requests, standard response objects.

Requests are decoded with msgspec into the structs below (unknown fields are ignored, as
OpenAI-compatible servers do); a wrong type or value raises ``RequestError`` naming the field,
which the app turns into a 400. Nothing is ever unpickled.

Extensions, all opt-in so strict clients never see them:
- ``return_token_ids: true`` on a request adds ``prompt_token_ids`` to the response and
  ``token_ids`` and ``versions`` (the policy version of each sampled token) to each choice;
- ``episode_id`` / ``group_id`` on a response say where the call was recorded.
``logprobs: true`` returns the standard OpenAI log-prob objects (the behaviour log-probs the
trainer uses). Depends on nothing else in streamrl.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

# Closing an episode is ours, not OpenAI's: POST /v1/episodes/{id}/reward.


class RequestError(ValueError):
    """A request the service refuses (400 unless said: 413 for a body over the limit); the
    message names the field."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class _Sampling(msgspec.Struct, kw_only=True):
    """What chat and completion requests share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    stream: bool = False
    stop: str | list[str] | None = None
    user: str | None = None
    return_token_ids: bool = False


class ChatRequest(_Sampling, kw_only=True):
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[int]
    logprobs: int | None = None
    echo: bool = False


class RewardRequest(msgspec.Struct, kw_only=True):
    reward: float
    group_id: str | None = None
    group_size: int | None = None
    turn_rewards: list[float] | None = None


def decode_request(body: bytes, kind: type[Any]) -> Any:
    """Decode a JSON body into ``kind``; any error becomes a one-line RequestError."""
    try:
        request = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise RequestError(f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise RequestError(f"malformed JSON: {exc}") from None
    _check(request)
    return request


def _check(request: Any) -> None:
    if getattr(request, "n", 1) != 1:
        raise RequestError(f"n: {request.n} is not supported (one choice per call; open one "
                           "episode per sample and close them with one group_id)")
    temperature = getattr(request, "temperature", None)
    if temperature is not None and not 0.0 <= temperature <= 2.0:
        raise RequestError(f"temperature: {temperature} must be in [0, 2]")
    top_p = getattr(request, "top_p", None)
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise RequestError(f"top_p: {top_p} must be in (0, 1]")
    if isinstance(request, ChatRequest):
        if not request.messages:
            raise RequestError("messages: must hold at least one message")
        if request.top_logprobs not in (None, 0):
            raise RequestError(f"top_logprobs: {request.top_logprobs} is not supported (0 only:"
                               " the sampled token's log-prob)")
        for i, message in enumerate(request.messages):
            role = message.get("role")
            if role not in ("system", "developer", "user", "assistant", "tool"):
                raise RequestError(f"messages[{i}].role: {role!r} is not a chat role")
    if isinstance(request, CompletionRequest):
        if request.logprobs not in (None, 0, 1):
            raise RequestError(f"logprobs: {request.logprobs} is not supported (0 or 1: the "
                               "sampled token's log-prob)")
        if request.echo:
            raise RequestError("echo: true is not supported")


def stop_list(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_logprobs(pieces: list[str], logprobs: list[float]) -> dict[str, Any]:
    return {"content": [{"token": p, "logprob": lp, "bytes": list(p.encode()),
                         "top_logprobs": []} for p, lp in zip(pieces, logprobs)]}


def completion_logprobs(pieces: list[str], logprobs: list[float]) -> dict[str, Any]:
    offsets, at = [], 0
    for p in pieces:
        offsets.append(at)
        at += len(p)
    return {"tokens": pieces, "token_logprobs": logprobs, "top_logprobs": None,
            "text_offset": offsets}


def chat_response(*, request_id: str, model: str, message: dict[str, Any], finish_reason: str,
                  prompt_tokens: int, completion_tokens: int,
                  logprobs: dict[str, Any] | None, extra: dict[str, Any]) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish_reason,
                              "logprobs": logprobs}
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{**choice, **extra.get("choice", {})}],
            "usage": usage(prompt_tokens, completion_tokens), **extra.get("response", {})}


def chat_chunk(*, request_id: str, model: str, delta: dict[str, Any],
               finish_reason: str | None = None, logprobs: dict[str, Any] | None = None,
               extra: dict[str, Any] | None = None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
    extra = extra or {}
    return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model, "choices": [{**choice, **extra.get("choice", {})}],
            **extra.get("response", {})}


def completion_response(*, request_id: str, model: str, text: str, finish_reason: str,
                        prompt_tokens: int, completion_tokens: int,
                        logprobs: dict[str, Any] | None, extra: dict[str, Any]
                        ) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}
    return {"id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": [{**choice, **extra.get("choice", {})}],
            "usage": usage(prompt_tokens, completion_tokens), **extra.get("response", {})}


def completion_chunk(*, request_id: str, model: str, text: str, finish_reason: str | None,
                     extra: dict[str, Any] | None = None) -> dict[str, Any]:
    extra = extra or {}
    choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
    return {"id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": [{**choice, **extra.get("choice", {})}],
            **extra.get("response", {})}


def error_body(message: str, kind: str, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
