"""The service over real HTTP with the official openai client: chat (plain, streamed, with
tools), completions, exact token records across calls, the reward route into the buffer, 429 at
the staleness bound, 401, 400 and 413. The engine is the tiny model on real vLLM, except where a
tool call must be produced (a random model never writes one): there a scripted engine answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator
from typing import Any

import httpx
import pytest
import torch

from streamrl.buffer.memory import MemoryBuffer
from streamrl.config import load_config
from streamrl.rollout_fleet.agent.render import ChatRenderer
from streamrl.rollout_fleet.engine import Completion, RolloutEngine, SamplingParams
from streamrl.types import OBSERVATION_VERSION
from tests.support.serve import ServeHarness

openai = pytest.importorskip("openai")
pytest.importorskip("vllm")

KEY = "test-token"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def config(tiny_model_dir, *extra: str):
    return load_config([f"model.path={tiny_model_dir}", "trainer.mode=fully_async",
                        "buffer.max_staleness=1", "task.train_batch_size=4",
                        "actor.ppo_mini_batch_size=4", "rollout.max_model_len=512",
                        "serve.max_tokens=24", "serve.max_body_bytes=20000", *extra])


@pytest.fixture(scope="module")
def served(tiny_model_dir, tokenizer) -> Iterator[ServeHarness]:
    """The tiny model on vLLM behind the service; bearer token required."""
    from streamrl.rollout_fleet import make_engine

    cfg = config(tiny_model_dir)
    buffer = MemoryBuffer(4, 1)  # (0 + 1 + 1) * 4 = 8 episodes may open at version 0
    with ServeHarness(cfg, buffer, tokenizer,
                      lambda: make_engine(cfg.rollout, str(tiny_model_dir)), KEY) as h:
        yield h


def client(h: ServeHarness, key: str = KEY) -> Any:
    return openai.OpenAI(base_url=f"{h.base_url}/v1", api_key=key, max_retries=0)


def reward(h: ServeHarness, episode: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{h.base_url}/v1/episodes/{episode}/reward", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30)


def take_all(h: ServeHarness) -> list[Any]:
    stats = h.buffer.stats()
    return h.buffer.take(stats.queued, stats.learner_version) if stats.queued else []


def test_chat_calls_of_an_episode_are_recorded_token_exactly(served, tokenizer):
    c = client(served)
    models = c.models.list().data
    assert [m.id for m in models] == ["tiny"]
    messages: list[Any] = [{"role": "user", "content": "what is 2 + 3"}]
    r1 = c.chat.completions.create(model="tiny", messages=messages, max_tokens=8, logprobs=True,
                                   extra_headers={"X-Episode-Id": "chat-1"},
                                   extra_body={"return_token_ids": True})
    choice = r1.choices[0]
    assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")
    ids1 = choice.model_extra["token_ids"]
    assert 1 <= len(ids1) <= 8 and r1.usage.completion_tokens == len(ids1)
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(
        [t.logprob for t in choice.logprobs.content])
    assert all(t.logprob <= 0 for t in choice.logprobs.content)
    assert choice.model_extra["versions"] == [0] * len(ids1)

    # The openai client's own message object goes back in, as agents do; the episode is named
    # by the `user` field this time.
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "user", "content": "and times 2"}]
    r2 = c.chat.completions.create(model="tiny", messages=messages, max_tokens=8, user="chat-1",
                                   extra_body={"return_token_ids": True})
    renderer = ChatRenderer(tokenizer)
    first = renderer.prompt(messages[:1])
    delta = renderer.observation(messages[2:], ids1)
    assert r2.model_extra["prompt_token_ids"] == first + ids1 + delta  # never re-encoded
    ids2 = r2.choices[0].model_extra["token_ids"]

    closed = reward(served, "chat-1", reward=0.75)
    assert closed.status_code == 200 and closed.json()["group_complete"]
    (group,) = take_all(served)
    (t,) = group.trajectories
    assert t.prompt_ids == first and t.response_ids == ids1 + delta + ids2
    assert t.loss_mask == [1] * len(ids1) + [0] * len(delta) + [1] * len(ids2)
    assert t.versions == [0] * len(ids1) + [OBSERVATION_VERSION] * len(delta) + [0] * len(ids2)
    assert t.logprobs[:len(ids1)] == pytest.approx([x.logprob for x in choice.logprobs.content])
    assert t.reward == 0.75


def test_streamed_chat_matches_its_record(served):
    c = client(served)
    stream = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "count"}], max_tokens=12,
        stream=True, extra_headers={"X-Episode-Id": "stream-1"},
        extra_body={"return_token_ids": True})
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-1])
    ids = chunks[-1].choices[0].model_extra["token_ids"]
    assert reward(served, "stream-1", reward=1.0).status_code == 200
    (group,) = take_all(served)
    assert group.trajectories[0].response_ids == ids
    assert text == served.tokenizer.decode(ids, skip_special_tokens=True)


def test_completions_route(served):
    c = client(served)
    r = c.completions.create(model="tiny", prompt="7=", max_tokens=6, logprobs=1,
                             extra_headers={"X-Episode-Id": "cmpl-1"})
    choice = r.choices[0]
    assert isinstance(choice.text, str) and len(choice.logprobs.token_logprobs) == (
        r.usage.completion_tokens)
    streamed = c.completions.create(model="tiny", prompt=[25, 31], max_tokens=6, stream=True)
    assert streamed.__iter__ and sum(1 for _ in streamed) >= 1  # unrecorded: no episode named
    assert reward(served, "cmpl-1", reward=0.0).status_code == 200
    take_all(served)


def test_refusals_name_the_problem(served):
    c = client(served)
    with pytest.raises(openai.AuthenticationError):
        client(served, key="wrong").models.list()
    assert httpx.get(f"{served.base_url}/healthz").status_code == 200  # no token needed
    assert httpx.get(f"{served.base_url}/metrics").status_code == 401
    with pytest.raises(openai.BadRequestError, match=r"max_tokens: 999 must be in \[1, "
                                                     r"serve\.max_tokens=24\]"):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                  max_tokens=999)
    with pytest.raises(openai.BadRequestError, match=r"temperature: 0\.3 differs"):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                  temperature=0.3, extra_headers={"X-Episode-Id": "t-1"})
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    bad = httpx.post(f"{served.base_url}/v1/chat/completions", content=b"{not json",
                     headers=auth)
    assert bad.status_code == 400 and "malformed JSON" in bad.json()["error"]["message"]
    wrong = httpx.post(f"{served.base_url}/v1/chat/completions", headers=auth,
                       json={"messages": [{"role": "user", "content": "x"}], "max_tokens": "8"})
    assert wrong.status_code == 400 and "$.max_tokens" in wrong.json()["error"]["message"]
    big = httpx.post(f"{served.base_url}/v1/chat/completions", headers=auth,
                     json={"messages": [{"role": "user", "content": "x" * 30000}]})
    assert big.status_code == 413 and "serve.max_body_bytes" in big.json()["error"]["message"]
    before = served.buffer.stats().started
    empty = httpx.post(f"{served.base_url}/v1/chat/completions", json={"messages": []},
                       headers={**auth, "X-Episode-Id": "empty-1"})
    assert empty.status_code == 400 and "messages" in empty.json()["error"]["message"]
    assert served.buffer.stats().started == before  # the refused call's slot was given back
    missing = reward(served, "never-opened", reward=1.0)
    assert missing.status_code == 404
    metrics = httpx.get(f"{served.base_url}/metrics", headers=auth).text
    assert 'streamrl_serve_errors_total{status="400"}' in metrics
    assert "streamrl_serve_weight_version" in metrics
    # The refused temperature call opened its episode; closing it frees the slot.
    assert reward(served, "t-1", reward=0.0).status_code == 200


def test_429_at_the_staleness_bound(served):
    c = client(served)
    stats = served.buffer.stats()
    free = 8 * (stats.learner_version + 1) - stats.started  # (V + eta + 1) * B slots in all
    opened = []
    for i in range(free):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                  max_tokens=2, extra_headers={"X-Episode-Id": f"b-{i}"})
        opened.append(f"b-{i}")
    with pytest.raises(openai.RateLimitError) as refused:
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                  max_tokens=2, extra_headers={"X-Episode-Id": "b-over"})
    # serve.retry_after_s (0.2 s): exact for the clients that read it (openai's), whole
    # seconds rounded up for HTTP's header.
    assert refused.value.response.headers["retry-after-ms"] == "200"
    assert refused.value.response.headers["Retry-After"] == "1"
    # An episode already open still continues at the bound.
    c.chat.completions.create(model="tiny", max_tokens=2, extra_headers={
        "X-Episode-Id": opened[0]}, messages=[{"role": "user", "content": "y"}])
    for episode in opened:
        assert reward(served, episode, reward=0.0, group_id="bound",
                      group_size=len(opened)).status_code == 200
    (group,) = take_all(served)
    assert len(group.trajectories) == len(opened) + 1  # b-0 was rewritten: two segments


# -- tools: a scripted engine writes the call ------------------------------------------------


class Scripted(RolloutEngine):
    """Answers the k-th request with ``script[k % len(script)]`` (+ eos), version 5."""

    def __init__(self, tokenizer: Any, script: list[str]) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.calls = 0

    @property
    def version(self) -> int:
        return 5

    async def generate(self, prompt_ids, params: SamplingParams, request_id):
        text = self.script[self.calls % len(self.script)]
        self.calls += 1
        ids = [*self.tokenizer(text, add_special_tokens=False)["input_ids"],
               self.tokenizer.eos_token_id][:params.max_tokens]
        await asyncio.sleep(0)
        return [Completion(ids, [-0.5] * len(ids), [5] * len(ids), "stop")]

    async def abort(self, request_id): ...

    async def pause(self): ...

    async def resume(self): ...

    async def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version): ...


TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_round_trip_and_continue_the_episode(tiny_model_dir, tokenizer, stream):
    cfg = config(tiny_model_dir, "serve.max_tokens=200")
    buffer = MemoryBuffer(4, 1)
    with ServeHarness(cfg, buffer, tokenizer,
                      lambda: Scripted(tokenizer, [CALL, "the answer is 5"])) as h:
        c = openai.OpenAI(base_url=f"{h.base_url}/v1", api_key="none", max_retries=0)
        messages: list[Any] = [{"role": "user", "content": "add 2 and 3"}]
        episode = {"X-Episode-Id": f"tools-{stream}"}
        first = c.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                          stream=stream, extra_headers=episode)
        if stream:
            chunks = list(first)
            (call,) = chunks[-1].choices[0].delta.tool_calls
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
            assistant = {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name,
                              "arguments": call.function.arguments}}]}
        else:
            (call,) = first.choices[0].message.tool_calls
            assert first.choices[0].finish_reason == "tool_calls"
            assistant = first.choices[0].message.model_dump(exclude_none=True)
        assert call.function.name == "add" and call.function.arguments == '{"a": 2, "b": 3}'
        messages += [assistant, {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        second = c.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                           extra_headers=episode)
        assert second.choices[0].message.content == "the answer is 5"
        assert h.service is not None and h.service.store.counters.segments_rewritten == 0
        assert httpx.post(f"{h.base_url}/v1/episodes/tools-{stream}/reward",
                          json={"reward": 1.0}).status_code == 200
        (group,) = buffer.take(1, 5)
        (t,) = group.trajectories
        renderer = ChatRenderer(tokenizer)
        assert t.prompt_ids == renderer.prompt(messages[:1], TOOLS)  # tool schemas rendered
        sampled = [*tokenizer(CALL, add_special_tokens=False)["input_ids"],
                   tokenizer.eos_token_id]
        delta = renderer.observation(messages[2:], sampled)
        assert t.response_ids[:len(sampled) + len(delta)] == sampled + delta
        assert tokenizer.decode(delta).endswith("<|im_start|>assistant\n")


@pytest.mark.redis
def test_a_closed_episode_lands_in_redis(tiny_model_dir, tokenizer, redis_url):
    import redis

    from streamrl.buffer import make_buffer
    from streamrl.types import Group, decode

    cfg = config(tiny_model_dir, "buffer=redis", f"buffer.redis_url={redis_url}",
                 "buffer.run=serve-close")
    buffer = make_buffer(cfg)
    buffer.purge()
    buffer = make_buffer(cfg)
    with ServeHarness(cfg, buffer, tokenizer, lambda: Scripted(tokenizer, ["hello"])) as h:
        c = openai.OpenAI(base_url=f"{h.base_url}/v1", api_key="none", max_retries=0)
        answer = c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}],
            extra_headers={"X-Episode-Id": "r-1", "X-Group-Id": "task-7"},
            extra_body={"return_token_ids": True})
        ids = answer.choices[0].model_extra["token_ids"]
        assert httpx.post(f"{h.base_url}/v1/episodes/r-1/reward",
                          json={"reward": 0.5, "group_size": 1}).status_code == 200
    r = redis.Redis.from_url(redis_url)
    ((_, fields),) = r.xrange("streamrl:serve-close:groups")
    group = decode(fields[b"data"], Group)
    (t,) = group.trajectories
    assert t.response_ids == ids and t.reward == 0.5 and t.extra["group"] == "task-7"
    stats = r.hgetall("streamrl:serve-close:stats")
    assert int(stats[b"produced"]) == 1 and int(stats[b"started"]) == 1
