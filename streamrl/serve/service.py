"""The service behind the HTTP routes: one call = plan (episode store) -> sample (router) ->
record (episode store) -> OpenAI answer.

``Service.chat`` / ``Service.completion`` take decoded requests and a ``Caller``: the episode
id the client named (``X-Episode-Id`` header or ``user`` field; none: the call is served but not
recorded, counted as ``unrecorded``), the group it declared (``X-Group-Id``: episodes of one
group share one admission slot), the client's address (per-client episode limit) and its
``Idempotency-Key`` (a retry gets the first answer). Recorded calls sample with the rollout's
temperature / top-p / top-k (the trainer scores log-probs under them), so a request asking for
other values is refused with a message naming the field. ``Service.close`` closes an episode,
``Service.refresh`` expires idle episodes and late groups and does the buffer I/O owed,
``Service.metrics_text`` is /metrics in Prometheus text.

One call, as it runs:
    plan      store.begin_* (the new episode's slot taken first with ``atry_admit``)
    sample    a task: router -> replica -> engine; cancelled when the client goes away (the
              engine aborts the request, the episode stays as it was)
    record    store.commit, keeping the answer under the call's Idempotency-Key
    answer    a JSON object, or SSE chunks read from the task

All episode-store calls run on the event loop thread (the store is not thread-safe); buffer
calls are awaited (``atry_admit``, ``aput``, ``acancel_admission``), never run on the loop.
Depends on episodes, protocol, router, the agent parser and renderer, engine.py and config.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from streamrl.config import Config
from streamrl.rollout_fleet.agent.parsers import get_parser
from streamrl.rollout_fleet.engine import Completion, SamplingParams, TokenSink, arriving
from streamrl.serve import protocol
from streamrl.serve.episodes import AtCapacity, BufferUnavailable, Call, EpisodeStore
from streamrl.serve.protocol import ChatRequest, CompletionRequest, RequestError
from streamrl.serve.router import Router
from streamrl.types import new_uid

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Caller:
    """Who makes a call: the episode and group it names (no episode: served, not recorded),
    the client (its remote address: the per-client episode limit) and its request key
    (``Idempotency-Key``: a retry gets the first answer)."""

    episode_id: str | None = None
    group_id: str | None = None
    client: str = ""
    key: str | None = None


@dataclass
class Answer:
    """A sampled call, decoded: what both the plain and the streamed answers are built from
    (and what a retried call with the same Idempotency-Key gets back)."""

    completion: Completion
    text: str
    prompt_ids: list[int]
    request_id: str
    message: dict[str, Any] | None = None
    """Chat calls: the assistant message returned (and recorded)."""
    called: bool = False
    """The message holds tool calls."""


@dataclass
class _Running:
    """A started call: its answer's id, the sampling task and the token ids it streams."""

    request_id: str
    task: asyncio.Future[Answer]
    queue: asyncio.Queue[list[int]]


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
        self.tool_call_errors = Counter("streamrl_serve_tool_call_parse_errors",
                                        "Turns whose tool call did not parse (answered as text)",
                                        registry=r)
        self.client_gone = Counter("streamrl_serve_client_gone",
                                   "Calls whose client went away before the answer (aborted)",
                                   registry=r)
        self.replayed = Gauge("streamrl_serve_calls_replayed",
                              "Retried calls answered from the episode (same Idempotency-Key)",
                              registry=r)
        self.put_failures = Gauge("streamrl_serve_put_failures",
                                  "Group puts the buffer refused (kept and retried)", registry=r)


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
        self._parse_error_logged = False
        self._giving_back: asyncio.Future[None] | None = None

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

    async def _start(self, request: ChatRequest | CompletionRequest, caller: Caller,
                     prefix: str, plan: Callable[[bool, tuple[str, str] | None], Call],
                     unrecorded_prompt: Callable[[], list[int]], asked: int | None,
                     tools: bool | None) -> _Running:
        """Plan a call and start sampling it (a task, so a stream nobody reads still records
        its turn). A retried call the episode already answered gets that answer back."""
        call = None
        if caller.episode_id is None:
            self.metrics.unrecorded.inc()
            prompt_ids = unrecorded_prompt()
        else:
            key = None
            if caller.key is not None:
                fingerprint = hashlib.sha256(msgspec.json.encode(request)).hexdigest()
                key = (caller.key, fingerprint)
                replayed = self.store.replay(caller.episode_id, key)
                if replayed is not None:
                    done: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
                    done.set_result(replayed)
                    return _Running(replayed.request_id, done, asyncio.Queue())
            call = await self._begin(caller, lambda slot: plan(slot, key))
            prompt_ids = call.prompt_ids
        params = self._params(request, call, asked, len(prompt_ids))
        request_id = protocol.new_id(prefix)
        queue: asyncio.Queue[list[int]] = asyncio.Queue()
        task = asyncio.ensure_future(self._run(
            call, caller.episode_id, prompt_ids, params, request_id,
            queue.put_nowait if request.stream else None, tools))
        if call is not None:
            # A callback, not an except clause: a task cancelled before its first step never
            # runs its body, and the episode would stay busy.
            task.add_done_callback(lambda t: self._abandon_failed(call, t))
        return _Running(request_id, task, queue)

    def _abandon_failed(self, call: Call, task: asyncio.Future[Answer]) -> None:
        """A call that failed or was cancelled (the client went away, the engine aborted it)
        leaves its episode as it was."""
        if task.cancelled() or task.exception() is not None:
            self.store.abandon(call)

    async def _begin(self, caller: Caller, begin: Callable[[bool], Call]) -> Call:
        """Plan a recorded call. The admission slot a new episode needs is taken first, without
        blocking the event loop (``atry_admit``: the buffer call is a round trip; refused:
        AtCapacity); the store then holds it, or owes it back when the call is refused."""
        episode_id = caller.episode_id
        assert episode_id is not None
        slot = self.store.wants_slot(episode_id, caller.group_id, caller.client)
        if slot and not await self._admit():
            self.store.counters.admission_refused += 1
            raise AtCapacity(episode_id)
        try:
            return begin(slot)
        finally:
            self._give_back_soon()

    async def _admit(self) -> bool:
        admit = asyncio.ensure_future(self.store.buffer.atry_admit())
        try:
            return await asyncio.shield(admit)
        except asyncio.CancelledError:  # the client went away: a slot claimed anyway goes back
            admit.add_done_callback(self._return_unused)
            raise
        except Exception as exc:  # the buffer is down past its own retries: 503, not 500
            raise BufferUnavailable(
                f"buffer: admitting a new episode failed ({type(exc).__name__}: {exc}); retry "
                "the call") from exc

    def _return_unused(self, admit: asyncio.Future[bool]) -> None:
        if not admit.cancelled() and admit.exception() is None and admit.result():
            self.store.owe(1)
            self._give_back_soon()

    def _give_back_soon(self) -> None:
        """Slots the store owes go back in the background (one task drains them all)."""
        if self.store.owes and (self._giving_back is None or self._giving_back.done()):
            self._giving_back = asyncio.ensure_future(self.store.give_back())

    async def _run(self, call: Call | None, episode_id: str | None, prompt_ids: list[int],
                   params: SamplingParams, request_id: str, on_tokens: TokenSink | None,
                   tools: bool | None) -> Answer:
        """Sample, decode and record one call. ``tools``: None for a completions call (no
        assistant message). Cancelled (the client went away), the engine aborts the request."""
        completion = await self.router.sample(episode_id or new_uid(), prompt_ids, params,
                                              new_uid(), on_tokens)
        text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        message, called = self._assistant(text, tools) if tools is not None else (None, False)
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        self.metrics.completion_tokens.inc(len(completion.token_ids))
        answer = Answer(completion, text, prompt_ids, request_id, message, called)
        if call is not None:
            self.store.commit(call, completion, message, answer)
        return answer

    def _assistant(self, text: str, tools: bool) -> tuple[dict[str, Any], bool]:
        """The assistant message for ``text`` (tool calls parsed when the request has tools)."""
        if not tools:
            return {"role": "assistant", "content": text}, False
        parsed = self.parser.parse(text)
        if parsed.errors:  # ill-formed calls stay visible as text; counted, logged once
            self.metrics.tool_call_errors.inc()
            if not self._parse_error_logged:
                self._parse_error_logged = True
                log.warning("serve: a tool call the model wrote does not parse (%s); answered "
                            "as text. Counted in streamrl_serve_tool_call_parse_errors, logged "
                            "once", parsed.errors[0])
        if parsed.errors or not parsed.calls:
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

    async def chat(self, request: ChatRequest, caller: Caller
                   ) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
        """A chat completion (a dict), or with ``stream`` an iterator of chunks."""
        self.metrics.requests.labels("chat").inc()
        messages, tools = request.messages, request.tools or None
        running = await self._start(
            request, caller, "chatcmpl",
            lambda slot, key: self.store.begin_chat(
                caller.episode_id or "", messages, tools, caller.group_id, slot, caller.client,
                key),
            lambda: self.renderer.prompt(list(messages), tools),
            request.max_completion_tokens or request.max_tokens, bool(tools))
        if request.stream:
            return self._chat_stream(request, caller.episode_id, running)
        answer = await running.task
        assert answer.message is not None
        c = answer.completion
        logprobs = (protocol.chat_logprobs(self._pieces(c.token_ids), c.logprobs)
                    if request.logprobs else None)
        return protocol.chat_response(
            request_id=answer.request_id, model=self.model_name, message=answer.message,
            finish_reason=_finish(c.finish_reason, answer.called),
            prompt_tokens=len(answer.prompt_ids), completion_tokens=len(c.token_ids),
            logprobs=logprobs, extra=self._extra(request, answer, caller.episode_id))

    async def _chat_stream(self, request: ChatRequest, episode_id: str | None,
                           running: _Running) -> AsyncIterator[dict[str, Any]]:
        tools = bool(request.tools)
        chunk = _Chunker(self.tokenizer)
        task, request_id = running.task, running.request_id
        try:
            yield protocol.chat_chunk(request_id=request_id, model=self.model_name,
                                      delta={"role": "assistant", "content": ""})
            # With tools the text is held back: a call is only known once the turn is whole.
            async for ids in arriving(task, running.queue):
                text = chunk.add(ids)
                if text and not tools:
                    yield protocol.chat_chunk(request_id=request_id, model=self.model_name,
                                              delta={"content": text})
            answer = task.result()
            assert answer.message is not None
            delta: dict[str, Any] = {}
            if tools:
                delta = {k: v for k, v in answer.message.items()
                         if k != "role" and v is not None}
                if "tool_calls" in delta:  # copies: the recorded message stays as returned
                    delta["tool_calls"] = [{**call, "index": i}
                                           for i, call in enumerate(delta["tool_calls"])]
            else:
                rest = answer.text[len(chunk.sent):]
                delta = {"content": rest} if rest else {}
            c = answer.completion
            logprobs = (protocol.chat_logprobs(self._pieces(c.token_ids), c.logprobs)
                        if request.logprobs else None)
            yield protocol.chat_chunk(
                request_id=request_id, model=self.model_name, delta=delta,
                finish_reason=_finish(c.finish_reason, answer.called), logprobs=logprobs,
                extra=self._extra(request, answer, episode_id))
        finally:
            if not task.done():
                task.cancel()

    async def completion(self, request: CompletionRequest, caller: Caller
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
        running = await self._start(
            request, caller, "cmpl",
            lambda slot, key: self.store.begin_tokens(
                caller.episode_id or "", prompt_ids, caller.group_id, slot, caller.client, key),
            lambda: prompt_ids, request.max_tokens, None)
        if request.stream:
            return self._completion_stream(request, caller.episode_id, running)
        answer = await running.task
        c = answer.completion
        logprobs = (protocol.completion_logprobs(self._pieces(c.token_ids), c.logprobs)
                    if request.logprobs is not None else None)
        return protocol.completion_response(
            request_id=answer.request_id, model=self.model_name, text=answer.text,
            finish_reason=_finish(c.finish_reason, False),
            prompt_tokens=len(answer.prompt_ids), completion_tokens=len(c.token_ids),
            logprobs=logprobs, extra=self._extra(request, answer, caller.episode_id))

    async def _completion_stream(self, request: CompletionRequest, episode_id: str | None,
                                 running: _Running) -> AsyncIterator[dict[str, Any]]:
        chunk = _Chunker(self.tokenizer)
        task, request_id = running.task, running.request_id
        try:
            async for ids in arriving(task, running.queue):
                text = chunk.add(ids)
                if text:
                    yield protocol.completion_chunk(request_id=request_id, model=self.model_name,
                                                    text=text, finish_reason=None)
            answer = task.result()
            yield protocol.completion_chunk(
                request_id=request_id, model=self.model_name,
                text=answer.text[len(chunk.sent):],
                finish_reason=_finish(answer.completion.finish_reason, False),
                extra=self._extra(request, answer, episode_id))
        finally:
            if not task.done():
                task.cancel()

    # -- episodes, health, metrics ------------------------------------------------------------

    async def close(self, episode_id: str, reward: protocol.RewardRequest) -> dict[str, Any]:
        """Close an episode and put its group if that completes it. A put the buffer refuses
        raises ``BufferUnavailable`` (503); the episode's data is kept and a repeated close
        tries the put again."""
        self.metrics.requests.labels("reward").inc()
        summary = self.store.close(episode_id, reward.reward, reward.group_id,
                                   reward.group_size, reward.turn_rewards)
        await self.store.settle(summary["group_id"])
        return summary

    async def refresh(self) -> None:
        """Periodic upkeep: expire episodes, put due groups, give owed slots back, read the
        served version."""
        self.store.expire()
        try:
            await self.store.settle()
        except BufferUnavailable as exc:  # kept; the next tick tries again
            log.warning("serve: %s", exc)
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
        m.replayed.set(c.calls_replayed)
        m.put_failures.set(c.put_failures)
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
