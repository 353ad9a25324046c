"""The service behind the HTTP routes: one call = plan (episode store) -> sample (router) ->
record (episode store) -> OpenAI answer.

``Service.chat`` / ``Service.completion`` take decoded requests, the episode id the client
named (``X-Episode-Id`` header or ``user`` field; none: the call is served but not recorded,
counted as ``unrecorded``) and the group it declared (``X-Group-Id``: episodes of one group
share one admission slot). Recorded calls sample with the rollout's temperature / top-p / top-k
(the trainer scores log-probs under them), so a request asking for other values is refused with
a message naming the field. ``Service.close`` closes an episode, ``Service.tick`` expires idle
episodes and late groups, ``Service.metrics_text`` is /metrics in Prometheus text.

All episode-store calls run on the event loop thread (the store is not thread-safe). Depends on
episodes, protocol, router, the agent parser and renderer, engine.py and config.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from streamrl.config import Config
from streamrl.rollout_fleet.agent.parsers import get_parser
from streamrl.rollout_fleet.engine import Completion, SamplingParams, arriving
from streamrl.serve import protocol
from streamrl.serve.episodes import AtCapacity, Call, EpisodeStore
from streamrl.serve.protocol import ChatRequest, CompletionRequest, RequestError
from streamrl.serve.router import Router
from streamrl.types import new_uid

log = logging.getLogger(__name__)


@dataclass
class Answer:
    """A sampled call, decoded: what both the plain and the streamed answers are built from."""

    completion: Completion
    text: str
    prompt_ids: list[int]


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("streamrl_serve_requests", "HTTP calls served, by route",
                                ["route"], registry=r)
        self.errors = Counter("streamrl_serve_errors", "Calls refused or failed, by status",
                              ["status"], registry=r)
        self.prompt_tokens = Counter("streamrl_serve_prompt_tokens", "Prompt tokens",
                                     registry=r)
        self.completion_tokens = Counter("streamrl_serve_completion_tokens",
                                         "Sampled tokens", registry=r)
        self.unrecorded = Counter("streamrl_serve_unrecorded_calls",
                                  "Calls that named no episode", registry=r)
        self.at_capacity = Counter("streamrl_serve_rejected_at_bound",
                                   "Episodes refused with 429 at the staleness bound",
                                   registry=r)
        self.episodes = Gauge("streamrl_serve_episodes", "Episodes by state", ["state"],
                              registry=r)
        self.segments = Gauge("streamrl_serve_segments_rewritten",
                              "Calls that rewrote an episode's history", registry=r)
        self.groups = Gauge("streamrl_serve_groups_put", "Groups put in the buffer",
                            registry=r)
        self.version = Gauge("streamrl_serve_weight_version", "Newest weight version served",
                             registry=r)
        self.learner_version = Gauge("streamrl_serve_learner_version",
                                     "The buffer's learner version", registry=r)
        self.staleness = Gauge("streamrl_serve_staleness",
                               "Weight versions the served policy lags the learner", registry=r)


class Service:
    def __init__(self, cfg: Config, router: Router, store: EpisodeStore, tokenizer: Any,
                 model_name: str) -> None:
        self.cfg = cfg
        self.router = router
        self.store = store
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.renderer = store.renderer
        self.parser = get_parser("hermes")
        self.metrics = _Metrics()
        self.version = 0
        self.accepting = True

    # -- requests -----------------------------------------------------------------------------

    def _params(self, request: ChatRequest | CompletionRequest, call: Call | None,
                asked: int | None, prompt_len: int) -> SamplingParams:
        """The call's sampling parameters; a refused request gives its planned call back."""
        try:
            return self._sampling(request, call is not None, self._max_tokens(asked, prompt_len))
        except RequestError:
            if call is not None:
                self.store.abandon(call)
            raise

    def _sampling(self, request: ChatRequest | CompletionRequest, recorded: bool,
                  max_tokens: int) -> SamplingParams:
        r = self.cfg.rollout
        asked = {"temperature": request.temperature, "top_p": request.top_p,
                 "top_k": request.top_k}
        rollout = {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k}
        if recorded:
            for key, value in asked.items():
                if value is not None and value != rollout[key]:
                    raise RequestError(
                        f"{key}: {value} differs from rollout.{key}={rollout[key]}, under which "
                        "the trainer scores recorded episodes; drop it, or call without an "
                        "episode id (not recorded)")
            values = rollout
        else:
            values = {k: v if v is not None else rollout[k] for k, v in asked.items()}
        return SamplingParams(n=1, temperature=float(values["temperature"]),
                              top_p=float(values["top_p"]), top_k=int(values["top_k"]),
                              max_tokens=max_tokens, stop=protocol.stop_list(request.stop),
                              stop_token_ids=tuple(r.stop_token_ids))

    def _max_tokens(self, asked: int | None, prompt_len: int) -> int:
        limit = self.cfg.serve.max_tokens
        if asked is not None and not 1 <= asked <= limit:
            raise RequestError(f"max_tokens: {asked} must be in [1, serve.max_tokens={limit}]")
        room = self.cfg.rollout.max_model_len - prompt_len
        if room < 1:
            raise RequestError(f"messages: the prompt is {prompt_len} tokens, rollout."
                               f"max_model_len={self.cfg.rollout.max_model_len} leaves no room")
        return min(asked or limit, room)

    async def _begin(self, episode_id: str, group_id: str | None,
                     begin: Callable[[bool], Call]) -> Call:
        """Plan a recorded call. The admission slot a new episode needs is taken first, without
        blocking the event loop (``atry_admit``: the buffer call is a round trip; refused:
        AtCapacity), and given back if the call is refused before its episode opens."""
        slot = self.store.wants_slot(episode_id, group_id)
        if slot and not await self.store.buffer.atry_admit():
            self.store.counters.admission_refused += 1
            raise AtCapacity(episode_id)
        try:
            return begin(slot)
        except BaseException:
            if slot and episode_id not in self.store.episodes:
                self.store.buffer.cancel_admission()
            raise

    async def _sample(self, episode_id: str | None, call: Call | None, prompt_ids: list[int],
                      params: SamplingParams, on_tokens: Any = None) -> Answer:
        key = episode_id or new_uid()
        try:
            completion = await self.router.sample(key, prompt_ids, params, new_uid(), on_tokens)
        except BaseException:
            if call is not None:
                self.store.abandon(call)
            raise
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        self.metrics.completion_tokens.inc(len(completion.token_ids))
        text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        return Answer(completion, text, prompt_ids)

    def _assistant(self, text: str, tools: bool) -> tuple[dict[str, Any], bool]:
        """The assistant message for ``text`` (tool calls parsed when the request has tools)."""
        if not tools:
            return {"role": "assistant", "content": text}, False
        parsed = self.parser.parse(text)
        if parsed.errors or not parsed.calls:  # ill-formed calls stay visible as text
            return {"role": "assistant", "content": text}, False
        calls = [{"id": f"call_{new_uid()[:24]}", "type": "function",
                  "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                 for c in parsed.calls]
        return {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}, True

    def _extra(self, request: Any, answer: Answer, episode_id: str | None) -> dict[str, Any]:
        response: dict[str, Any] = {}
        choice: dict[str, Any] = {}
        if episode_id is not None:
            response["episode_id"] = episode_id
        if request.return_token_ids:
            response["prompt_token_ids"] = answer.prompt_ids
            choice["token_ids"] = list(answer.completion.token_ids)
            choice["versions"] = list(answer.completion.versions)
        return {"response": response, "choice": choice}

    def _pieces(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([i]) for i in ids]

    async def chat(self, request: ChatRequest, episode_id: str | None,
                   group_id: str | None = None
                   ) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
        """A chat completion (a dict), or with ``stream`` an iterator of chunks."""
        self.metrics.requests.labels("chat").inc()
        messages, tools = request.messages, request.tools or None
        asked = request.max_completion_tokens or request.max_tokens
        if episode_id is None:
            self.metrics.unrecorded.inc()
            call = None
            prompt_ids = self.renderer.prompt(list(messages), tools)
        else:
            call = await self._begin(episode_id, group_id, lambda slot: self.store.begin_chat(
                episode_id, messages, tools, group_id, slot))
            prompt_ids = call.prompt_ids
        params = self._params(request, call, asked, len(prompt_ids))
        request_id = protocol.new_id("chatcmpl")
        if request.stream:
            return self._chat_stream(request, episode_id, call, prompt_ids, params, request_id)
        answer = await self._sample(episode_id, call, prompt_ids, params)
        message, called = self._assistant(answer.text, bool(tools))
        if call is not None:
            self.store.commit(call, answer.completion, message)
        c = answer.completion
        logprobs = (protocol.chat_logprobs(self._pieces(c.token_ids), c.logprobs)
                    if request.logprobs else None)
        return protocol.chat_response(
            request_id=request_id, model=self.model_name, message=message,
            finish_reason=_finish(c.finish_reason, called), prompt_tokens=len(prompt_ids),
            completion_tokens=len(c.token_ids), logprobs=logprobs,
            extra=self._extra(request, answer, episode_id))

    async def _chat_stream(self, request: ChatRequest, episode_id: str | None,
                           call: Call | None, prompt_ids: list[int], params: SamplingParams,
                           request_id: str) -> AsyncIterator[dict[str, Any]]:
        tools = bool(request.tools)
        chunk = _Chunker(self.tokenizer)
        queue: asyncio.Queue[list[int]] = asyncio.Queue()
        task = asyncio.ensure_future(
            self._sample(episode_id, call, prompt_ids, params, queue.put_nowait))
        try:
            yield protocol.chat_chunk(request_id=request_id, model=self.model_name,
                                      delta={"role": "assistant", "content": ""})
            # With tools the text is held back: a call is only known once the turn is whole.
            async for ids in arriving(task, queue):
                text = chunk.add(ids)
                if text and not tools:
                    yield protocol.chat_chunk(request_id=request_id, model=self.model_name,
                                              delta={"content": text})
            answer = task.result()
            message, called = self._assistant(answer.text, tools)
            if call is not None:
                self.store.commit(call, answer.completion, message)
            delta: dict[str, Any] = {}
            if tools:
                delta = {k: v for k, v in message.items() if k != "role" and v is not None}
                for i, tool_call in enumerate(delta.get("tool_calls", [])):
                    tool_call["index"] = i
            else:
                rest = answer.text[len(chunk.sent):]
                delta = {"content": rest} if rest else {}
            c = answer.completion
            logprobs = (protocol.chat_logprobs(self._pieces(c.token_ids), c.logprobs)
                        if request.logprobs else None)
            yield protocol.chat_chunk(
                request_id=request_id, model=self.model_name, delta=delta,
                finish_reason=_finish(c.finish_reason, called), logprobs=logprobs,
                extra=self._extra(request, answer, episode_id))
        finally:
            if not task.done():
                task.cancel()

    async def completion(self, request: CompletionRequest, episode_id: str | None,
                         group_id: str | None = None
                         ) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
        self.metrics.requests.labels("completions").inc()
        if isinstance(request.prompt, str):
            prompt_ids = list(self.tokenizer(request.prompt, add_special_tokens=False)[
                "input_ids"])
        else:
            prompt_ids = list(request.prompt)
            vocab = len(self.tokenizer)
            bad = next((i for i in prompt_ids if not 0 <= i < vocab), None)
            if bad is not None:
                raise RequestError(f"prompt: token id {bad} is outside the vocabulary [0, "
                                   f"{vocab})")
        if not prompt_ids:
            raise RequestError("prompt: is empty")
        call = None
        if episode_id is None:
            self.metrics.unrecorded.inc()
        else:
            call = await self._begin(episode_id, group_id, lambda slot: self.store.begin_tokens(
                episode_id, prompt_ids, group_id, slot))
        params = self._params(request, call, request.max_tokens, len(prompt_ids))
        request_id = protocol.new_id("cmpl")
        if request.stream:
            return self._completion_stream(request, episode_id, call, prompt_ids, params,
                                           request_id)
        answer = await self._sample(episode_id, call, prompt_ids, params)
        if call is not None:
            self.store.commit(call, answer.completion, None)
        c = answer.completion
        logprobs = (protocol.completion_logprobs(self._pieces(c.token_ids), c.logprobs)
                    if request.logprobs is not None else None)
        return protocol.completion_response(
            request_id=request_id, model=self.model_name, text=answer.text,
            finish_reason=_finish(c.finish_reason, False), prompt_tokens=len(prompt_ids),
            completion_tokens=len(c.token_ids), logprobs=logprobs,
            extra=self._extra(request, answer, episode_id))

    async def _completion_stream(self, request: CompletionRequest, episode_id: str | None,
                                 call: Call | None, prompt_ids: list[int],
                                 params: SamplingParams, request_id: str
                                 ) -> AsyncIterator[dict[str, Any]]:
        chunk = _Chunker(self.tokenizer)
        queue: asyncio.Queue[list[int]] = asyncio.Queue()
        task = asyncio.ensure_future(
            self._sample(episode_id, call, prompt_ids, params, queue.put_nowait))
        try:
            async for ids in arriving(task, queue):
                text = chunk.add(ids)
                if text:
                    yield protocol.completion_chunk(request_id=request_id, model=self.model_name,
                                                    text=text, finish_reason=None)
            answer = task.result()
            if call is not None:
                self.store.commit(call, answer.completion, None)
            yield protocol.completion_chunk(
                request_id=request_id, model=self.model_name,
                text=answer.text[len(chunk.sent):],
                finish_reason=_finish(answer.completion.finish_reason, False),
                extra=self._extra(request, answer, episode_id))
        finally:
            if not task.done():
                task.cancel()

    # -- episodes, health, metrics ------------------------------------------------------------

    def close(self, episode_id: str, reward: protocol.RewardRequest) -> dict[str, Any]:
        self.metrics.requests.labels("reward").inc()
        return self.store.close(episode_id, reward.reward, reward.group_id, reward.group_size,
                                reward.turn_rewards)

    async def refresh(self) -> None:
        """Periodic upkeep: expire episodes and late groups, read the served version."""
        self.store.expire()
        self.version = await self.router.version()

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "streamrl", "root": self.cfg.model.path,
            "max_model_len": self.cfg.rollout.max_model_len, "weight_version": self.version,
        }]}

    def metrics_text(self, learner_version: int | None) -> bytes:
        m, c = self.metrics, self.store.counters
        m.episodes.labels("open").set(self.store.open_episodes)
        m.episodes.labels("opened").set(c.episodes_opened)
        m.episodes.labels("closed").set(c.episodes_closed)
        m.episodes.labels("expired").set(c.episodes_expired)
        m.episodes.labels("dropped").set(c.episodes_dropped)
        m.segments.set(c.segments_rewritten)
        m.groups.set(c.groups_put)
        m.version.set(self.version)
        if learner_version is not None:
            m.learner_version.set(learner_version)
            m.staleness.set(max(0, learner_version - self.version))
        return generate_latest(m.registry)


def _finish(reason: str, called: bool) -> str:
    if called:
        return "tool_calls"
    return "length" if reason in ("length", "abort") else "stop"


class _Chunker:
    """Incremental detokenization: text not sent yet, holding back an incomplete character."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = ""

    def add(self, ids: list[int]) -> str:
        self.ids += ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        new = text[len(self.sent):]
        self.sent = text
        return new
