"""The HTTP face under clients that misbehave: concurrent and retried calls on one episode,
clients that go away, a buffer that fails or stalls, oversized and chunked bodies, too many
episodes, tool calls that do not parse, and requests a web page could send to a loopback port.

Real parts: the app, the service, the episode store, the memory buffer and the tiny model's
tokenizer; the replica is a fake backend that answers a fixed text when its gate opens, so
every call runs in milliseconds, in the test's own event loop (httpx's ASGI transport, or a
hand-driven ASGI call where the test must control the client's side of the connection).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from streamrl.buffer.memory import MemoryBuffer
from streamrl.config import ConfigError, load_config
from streamrl.rollout_fleet.agent.render import ChatRenderer
from streamrl.rollout_fleet.engine import Completion, SamplingParams, TokenSink
from streamrl.serve.app import create_app
from streamrl.serve.episodes import EpisodeStore
from streamrl.serve.router import ActorBackend, Router
from streamrl.serve.service import Service
from streamrl.types import Group

ROOT = Path(__file__).resolve().parents[2]
KEY = "test-token"
JSON = {"Content-Type": "application/json"}
USER = [{"role": "user", "content": "what is 2 + 3"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


class Fake:
    """A replica: answers ``text`` once ``gate`` is open; counts calls and cancellations."""

    name = "fake"

    def __init__(self, tokenizer: Any, text: str = "five") -> None:
        self.ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        self.gate = asyncio.Event()
        self.gate.set()
        self.started = 0
        self.cancelled = 0

    async def sample(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                     on_tokens: TokenSink | None = None) -> Completion:
        self.started += 1
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if on_tokens is not None:
            on_tokens(list(self.ids))
        n = len(self.ids)
        return Completion(list(self.ids), [-0.5] * n, [0] * n, "stop")

    async def version(self) -> int:
        return 0


class Stack:
    """App + service + store over ``buffer``, and an httpx client that talks to it in-loop."""

    def __init__(self, tiny_model_dir: Any, tokenizer: Any, *extra: str,
                 buffer: MemoryBuffer | None = None, api_key: str | None = None,
                 text: str = "five") -> None:
        self.cfg = load_config([
            f"model.path={tiny_model_dir}", "trainer.mode=fully_async", "buffer.max_staleness=1",
            "task.train_batch_size=4", "actor.ppo_mini_batch_size=4",
            "rollout.max_model_len=512", "serve.max_tokens=24", "serve.max_body_bytes=20000",
            *extra])
        self.buffer = buffer or MemoryBuffer(4, 1)
        self.backend = Fake(tokenizer, text)
        self.store = EpisodeStore(self.buffer, ChatRenderer(tokenizer),
                                  ttl_s=self.cfg.serve.episode_ttl_s,
                                  group_timeout_s=self.cfg.serve.group_timeout_s,
                                  max_group_size=self.cfg.serve.max_group_size,
                                  max_episodes_per_client=self.cfg.serve.max_episodes_per_client)
        self.service = Service(self.cfg, Router([self.backend]), self.store, tokenizer, "tiny")

        async def learner_version() -> int:
            return 0

        self.app = create_app(self.service, api_key=api_key,
                              max_body_bytes=self.cfg.serve.max_body_bytes, retry_after_s=1,
                              learner_version=learner_version)

    def client(self, host: str = "127.0.0.1") -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app, client=(host, 9)),
                                 base_url="http://127.0.0.1:8000", timeout=10)


async def chat(c: httpx.AsyncClient, episode: str | None, **headers: str) -> httpx.Response:
    names = {"episode": "X-Episode-Id", "group": "X-Group-Id", "key": "Idempotency-Key"}
    sent = {names.get(k, k): v for k, v in headers.items()}
    if episode is not None:
        sent["X-Episode-Id"] = episode
    # Bounded: the in-process transport has no timeout, and a call that waits on a closed
    # gate must fail the test, not hang it.
    return await asyncio.wait_for(c.post(
        "/v1/chat/completions", headers=sent,
        json={"messages": USER, "max_tokens": 8, "return_token_ids": True}), 10)


async def until(check: Any, what: str, timeout_s: float = 5.0) -> None:
    async def poll() -> None:
        while not check():
            await asyncio.sleep(0.005)
    try:
        await asyncio.wait_for(poll(), timeout_s)
    except TimeoutError:
        raise AssertionError(f"no {what} within {timeout_s} s") from None


def message_of(response: httpx.Response) -> str:
    return response.json()["error"]["message"]


# -- one episode, many calls -------------------------------------------------------------------


def test_calls_on_a_busy_episode_get_409_and_a_retry_gets_the_first_answer(
        tiny_model_dir, tokenizer):
    s = Stack(tiny_model_dir, tokenizer)

    async def main() -> None:
        async with s.client() as c:
            s.backend.gate.clear()
            first = asyncio.ensure_future(chat(c, "e", key="k1"))
            await until(lambda: s.backend.started == 1, "first call sampling")
            # A concurrent call, and the same call retried while it runs: refused, not sampled.
            for key in ("k2", "k1"):
                busy = await chat(c, "e", key=key)
                assert busy.status_code == 409 and "still running" in message_of(busy)
            s.backend.gate.set()
            answered = (await first).json()
            retried = await chat(c, "e", key="k1")  # the client's answer got lost: retry
            assert retried.status_code == 200 and retried.json()["id"] == answered["id"]
            assert retried.json()["choices"] == answered["choices"]
            assert s.backend.started == 1  # one turn sampled, not two
            other = await c.post("/v1/chat/completions", headers={
                "X-Episode-Id": "e", "Idempotency-Key": "k1"}, json={"messages": USER})
            assert other.status_code == 400 and "Idempotency-Key: 'k1'" in message_of(other)
            assert (await c.post("/v1/episodes/e/reward", json={"reward": 1.0})).status_code == 200
        (group,) = s.buffer.take(1, 0)
        (t,) = group.trajectories
        assert t.extra["episode"]["turns"] == 1
        assert t.response_ids == answered["choices"][0]["token_ids"]

    asyncio.run(main())


def chat_scope(header: tuple[bytes, bytes]) -> dict:
    """The ASGI scope of a local JSON POST to /v1/chat/completions with one more header, for
    tests that drive the app's receive and send by hand."""
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
            "query_string": b"", "root_path": "", "client": ("127.0.0.1", 9),
            "server": ("127.0.0.1", 8000),
            "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
                        header]}


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_aborts_its_sampling(tiny_model_dir, tokenizer, stream):
    """Driven by hand: the client's side of the connection says when it disconnects."""
    s = Stack(tiny_model_dir, tokenizer)
    body = json.dumps({"messages": USER, "stream": stream}).encode()
    scope = chat_scope((b"x-episode-id", b"gone"))

    async def main() -> None:
        gone = asyncio.Event()
        sent = [body]

        async def receive() -> dict[str, Any]:
            if sent:
                return {"type": "http.request", "body": sent.pop(), "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            pass

        s.backend.gate.clear()
        call = asyncio.ensure_future(s.app(scope, receive, send))
        await until(lambda: s.backend.started == 1, "sampling")
        gone.set()
        await asyncio.wait_for(call, 5)
        assert s.backend.cancelled == 1  # the engine request was aborted
        s.backend.gate.set()
        async with s.client() as c:  # the episode is free: the next call is served
            assert (await chat(c, "gone")).status_code == 200

    asyncio.run(main())


def test_a_refused_close_changes_nothing(tiny_model_dir, tokenizer):
    s = Stack(tiny_model_dir, tokenizer)

    async def main() -> None:
        async with s.client() as c:
            for e in ("a", "b"):
                assert (await chat(c, e)).status_code == 200
            ok = await c.post("/v1/episodes/a/reward",
                              json={"reward": 1.0, "group_id": "g", "group_size": 2})
            assert ok.status_code == 200
            wrong = await c.post("/v1/episodes/b/reward",
                                 json={"reward": 0.0, "group_id": "g", "group_size": 3})
            assert wrong.status_code == 400 and "group_size: 3" in message_of(wrong)
            assert s.store.open_episodes == 1 and s.buffer.stats().queued == 0
            ok = await c.post("/v1/episodes/b/reward", json={"reward": 0.0, "group_id": "g"})
            assert ok.status_code == 200 and ok.json()["group_complete"]
        (group,) = s.buffer.take(1, 0)
        assert sorted(t.reward for t in group.trajectories) == [0.0, 1.0]
        assert s.buffer.stats().started == 1  # one group, one slot: the other went back

    asyncio.run(main())


# -- the buffer fails or stalls ----------------------------------------------------------------


class FlakyBuffer(MemoryBuffer):
    """Its first ``fails`` puts raise, as a Redis buffer does once its own retries ran out."""

    def __init__(self, fails: int) -> None:
        super().__init__(4, 1)
        self.fails = fails

    def put(self, group: Group, holder: str = "") -> None:
        if self.fails:
            self.fails -= 1
            raise ConnectionError("Redis at redis://127.0.0.1:1 is unreachable")
        super().put(group, holder)


class StalledBuffer(MemoryBuffer):
    """Its put hangs until released (a Redis blip), noting when it entered and returned."""

    def __init__(self) -> None:
        super().__init__(4, 1)
        self.entered = threading.Event()
        self.release = threading.Event()
        self.returned = False

    def put(self, group: Group, holder: str = "") -> None:
        self.entered.set()
        self.release.wait(3)
        self.returned = True
        super().put(group, holder)


def test_a_failed_put_answers_503_and_a_retried_close_lands(tiny_model_dir, tokenizer):
    s = Stack(tiny_model_dir, tokenizer, buffer=FlakyBuffer(fails=1))

    async def main() -> None:
        async with s.client() as c:
            ids = (await chat(c, "e")).json()["choices"][0]["token_ids"]
            failed = await c.post("/v1/episodes/e/reward", json={"reward": 0.5})
            assert failed.status_code == 503
            assert message_of(failed).startswith("buffer: putting group")
            assert "ConnectionError" in message_of(failed) and s.buffer.stats().queued == 0
            again = await c.post("/v1/episodes/e/reward", json={"reward": 0.5})
            assert again.status_code == 200
        (group,) = s.buffer.take(1, 0)
        (t,) = group.trajectories
        assert t.response_ids == ids and t.reward == 0.5
        assert s.buffer.stats().started == 1  # the group's slot, put once

    asyncio.run(main())


def test_the_example_agent_retries_a_close_the_buffer_refused(tiny_model_dir, tokenizer):
    """examples/openai_agent.py's close: a 503 is retried until the put lands; a 404 (a
    restarted service forgot the episode) is None; out of tries, one line saying why."""
    pytest.importorskip("openai")
    spec = importlib.util.spec_from_file_location("openai_agent", ROOT / "examples" /
                                                  "openai_agent.py")
    assert spec is not None and spec.loader is not None
    agent = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agent)
    s = Stack(tiny_model_dir, tokenizer, buffer=FlakyBuffer(fails=2))

    async def main() -> None:
        async with s.client() as c:
            await chat(c, "e")
            summary = await agent.close(c, "e", {"reward": 0.5})
            assert summary["group_complete"] and s.buffer.stats().queued == 1
            assert await agent.close(c, "never-opened", {"reward": 0.5}) is None
            await chat(c, "f")
            s.buffer.fails = 3
            with pytest.raises(agent.CloseFailed, match="episode f: reward not reported after 3 "
                               "tries \\(503: buffer: putting group"):
                await agent.close(c, "f", {"reward": 0.5}, tries=3)

    asyncio.run(main())


class DownBuffer(MemoryBuffer):
    """Its admissions fail (Redis unreachable past the client's retries) while ``down``."""

    def __init__(self) -> None:
        super().__init__(4, 1)
        self.down = True

    def try_admit(self, holder: str = "") -> bool:
        if self.down:
            raise ConnectionError("Redis at redis://127.0.0.1:1 is unreachable")
        return super().try_admit(holder)


def test_an_admission_the_buffer_fails_answers_503_and_opens_nothing(tiny_model_dir,
                                                                      tokenizer):
    s = Stack(tiny_model_dir, tokenizer, buffer=DownBuffer())
    buffer = s.buffer
    assert isinstance(buffer, DownBuffer)

    async def main() -> None:
        async with s.client() as c:
            refused = await chat(c, "e")
            assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
            assert message_of(refused).startswith("buffer: admitting a new episode failed "
                                                  "(ConnectionError")
            assert s.store.open_episodes == 0 and s.backend.started == 0
            buffer.down = False
            assert (await chat(c, "e")).status_code == 200
        assert buffer.stats().started == 1

    asyncio.run(main())


def test_a_stalled_put_does_not_stop_other_calls(tiny_model_dir, tokenizer):
    s = Stack(tiny_model_dir, tokenizer, buffer=StalledBuffer())
    buffer = s.buffer
    assert isinstance(buffer, StalledBuffer)

    async def main() -> None:
        async with s.client() as c:
            assert (await chat(c, "e")).status_code == 200
            closing = asyncio.ensure_future(c.post("/v1/episodes/e/reward", json={"reward": 1}))
            await until(buffer.entered.is_set, "put")
            assert (await chat(c, None)).status_code == 200  # served while the put hangs
            assert (await c.get("/healthz")).status_code == 200
            assert not buffer.returned
            buffer.release.set()
            assert (await closing).status_code == 200
        assert buffer.stats().queued == 1

    asyncio.run(main())


# -- limits ------------------------------------------------------------------------------------


def test_a_chunked_body_is_read_no_further_than_the_limit(tiny_model_dir, tokenizer):
    s = Stack(tiny_model_dir, tokenizer)  # serve.max_body_bytes=20000
    scope = chat_scope((b"transfer-encoding", b"chunked"))

    async def main() -> None:
        reads, status, body = 0, [], []

        async def receive() -> dict[str, Any]:
            nonlocal reads
            reads += 1  # 200 kB in messages of 1000 bytes
            await asyncio.sleep(0)
            return {"type": "http.request", "body": b" " * 1000, "more_body": reads < 200}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            else:
                body.append(message.get("body", b""))

        await asyncio.wait_for(s.app(scope, receive, send), 5)
        assert status == [413] and reads <= 21
        assert "serve.max_body_bytes=20000" in json.loads(b"".join(body))["error"]["message"]

    asyncio.run(main())
    declared = {"Content-Length": "30000"}

    async def declared_too_big() -> None:
        async with s.client() as c:
            r = await c.post("/v1/chat/completions", content=b"{" + b" " * 29999,
                             headers={**JSON, **declared})
            assert r.status_code == 413 and "30000 bytes" in message_of(r)

    asyncio.run(declared_too_big())


def test_open_episodes_are_limited_per_client_and_per_group(tiny_model_dir, tokenizer):
    s = Stack(tiny_model_dir, tokenizer, "serve.max_episodes_per_client=2",
              "serve.max_group_size=2")

    async def main() -> None:
        async with s.client() as c, s.client("10.0.0.7") as other:
            assert (await chat(c, "a", group="g")).status_code == 200
            assert (await chat(c, "b", group="g")).status_code == 200
            full = await chat(other, "x", group="g")  # a third episode sharing g's one slot
            assert full.status_code == 400
            assert message_of(full) == ("X-Group-Id: group 'g' already has 2 episodes "
                                        "(serve.max_group_size=2)")
            over = await chat(c, "c")
            assert over.status_code == 429 and "serve.max_episodes_per_client" in (
                message_of(over))
            assert (await chat(other, "x")).status_code == 200  # another client is not limited
            assert (await chat(c, "a")).status_code == 200  # open episodes go on
            await c.post("/v1/episodes/a/reward", json={"reward": 1.0})
            assert (await chat(c, "c")).status_code == 200
        assert s.buffer.stats().started == 3  # g (one slot for a and b), x, c

    asyncio.run(main())


# -- requests a web page could send ------------------------------------------------------------


def test_without_a_token_only_local_non_browser_requests_pass(tiny_model_dir, tokenizer):
    s = Stack(tiny_model_dir, tokenizer)
    keyed = Stack(tiny_model_dir, tokenizer, api_key=KEY)

    async def main() -> None:
        async with s.client() as c:
            rebound = await c.get("/v1/models", headers={"Host": "evil.example:8000"})
            assert rebound.status_code == 403 and message_of(rebound).startswith(
                "Host: 'evil.example:8000' is not a loopback name")
            page = await c.post("/v1/chat/completions", json={"messages": USER},
                                headers={"Origin": "https://evil.example"})
            assert page.status_code == 403 and "Origin: 'https://evil.example'" in (
                message_of(page))
            form = await c.post("/v1/chat/completions", content=json.dumps({"messages": USER}),
                                headers={"Content-Type": "text/plain"})
            assert form.status_code == 415 and message_of(form) == (
                "Content-Type: 'text/plain' is not application/json")
            for host in ("localhost:8000", "[::1]:8000", "127.0.0.1"):
                assert (await c.get("/v1/models", headers={"Host": host})).status_code == 200
            local = await c.post("/v1/chat/completions", json={"messages": USER},
                                 headers={"Origin": "http://localhost:3000"})
            assert local.status_code == 200
        async with keyed.client() as c:  # with a token, the token is the check
            auth = {"Authorization": f"Bearer {KEY}", "Host": "serve.example"}
            assert (await c.get("/v1/models", headers=auth)).status_code == 200

    asyncio.run(main())


# -- tool calls the model gets wrong; a replica actor's cancelled call -------------------------


def test_tool_calls_that_do_not_parse_are_counted_and_logged_once(tiny_model_dir, tokenizer,
                                                                  caplog):
    bad = "<tool_call>\n{not json}\n</tool_call>"
    s = Stack(tiny_model_dir, tokenizer, text=bad)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]

    async def main() -> None:
        async with s.client() as c:
            for _ in range(2):
                r = await c.post("/v1/chat/completions", json={"messages": USER, "tools": tools})
                choice = r.json()["choices"][0]
                assert choice["finish_reason"] == "stop" and "tool_calls" not in (
                    choice["message"])
            metrics = (await c.get("/metrics")).text
        assert "streamrl_serve_tool_call_parse_errors_total 2.0" in metrics

    with caplog.at_level(logging.WARNING, logger="streamrl.serve.service"):
        asyncio.run(main())
    warnings = [r for r in caplog.records if "does not parse" in r.getMessage()]
    assert len(warnings) == 1


def test_a_cancelled_call_cancels_the_replica_actors_task(monkeypatch):
    import ray

    cancelled: list[Any] = []
    monkeypatch.setattr(ray, "cancel", cancelled.append)

    class Ref:
        def __init__(self) -> None:
            self.future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        def __await__(self) -> Iterator[Any]:
            return self.future.__await__()

    refs: list[Ref] = []

    def remote(*args: Any) -> Ref:
        refs.append(Ref())
        return refs[-1]

    actor = SimpleNamespace(sample=SimpleNamespace(remote=remote))
    backend = ActorBackend(SimpleNamespace(name="r0", actor=actor))

    async def main() -> None:
        call = asyncio.ensure_future(backend.sample([1, 2], SamplingParams(), "req-1"))
        await until(lambda: bool(refs), "the actor call")
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

    asyncio.run(main())
    assert cancelled == refs


@pytest.mark.parametrize("key", ["max_episodes_per_client", "max_group_size"])
def test_limits_are_checked_at_start(key):
    with pytest.raises(ConfigError, match=rf"serve\.{key}=0: must be > 0"):
        load_config([f"serve.{key}=0"])


def test_following_the_trainer_logs_its_endpoint_without_the_bus_token(caplog):
    """The bus endpoint carries the trainer's token (tcp://host:port?token=T): the replicas get
    it whole, the log line masks it."""
    from streamrl.serve import _upkeep

    endpoint = "tcp://127.0.0.1:5555?token=s3cret"
    connected: list[str] = []

    async def connect(announced: str) -> None:
        connected.append(announced)

    async def refresh() -> None:
        pass

    service = SimpleNamespace(refresh=refresh)
    replica = SimpleNamespace(connect_bus=SimpleNamespace(remote=connect))
    rt = SimpleNamespace(buffer=SimpleNamespace(bus_endpoint=lambda: endpoint),
                         fleet=SimpleNamespace(replicas=[replica]))

    async def main() -> None:
        upkeep = asyncio.ensure_future(_upkeep(service, rt, watch_bus=True))
        await until(lambda: bool(connected), "the replica connected")
        upkeep.cancel()
        with pytest.raises(asyncio.CancelledError):
            await upkeep

    with caplog.at_level(logging.INFO, logger="streamrl.serve"):
        asyncio.run(main())
    assert connected == [endpoint]
    assert "connecting replicas to the trainer at tcp://127.0.0.1:5555" in caplog.text
    assert "s3cret" not in caplog.text
