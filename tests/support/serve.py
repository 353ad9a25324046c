"""The serve stack in-process for tests: engine, replica, episode store, service and uvicorn on
one event loop in a background thread (vLLM's AsyncLLM binds to the loop that built it), so a
test talks to it over real HTTP with the official openai client. Given ``loop`` (not running:
a module's ``loop`` fixture), the stack runs on that loop instead of a new one, so a test can
serve the engine its module built there (a real model's engine takes ~20 s to build); that
engine stays open for its owner."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from streamrl.buffer.base import ReplayBuffer
from streamrl.config import Config
from streamrl.net import free_port
from streamrl.rollout_fleet.agent.render import ChatRenderer
from streamrl.rollout_fleet.engine import RolloutEngine
from streamrl.rollout_fleet.replica import Replica
from streamrl.serve.app import create_app
from streamrl.serve.episodes import EpisodeStore
from streamrl.serve.router import LocalBackend, Router
from streamrl.serve.service import Service


class ServeHarness:
    def __init__(self, cfg: Config, buffer: ReplayBuffer, tokenizer: Any,
                 make_engine: Callable[[], RolloutEngine], api_key: str | None = None,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.cfg = cfg
        self.buffer = buffer
        self.tokenizer = tokenizer
        self.make_engine = make_engine
        self.api_key = api_key
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.service: Service | None = None
        self.engine: RolloutEngine | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._borrowed = loop
        self._server: Any = None
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ServeHarness:
        self._thread.start()
        deadline = time.monotonic() + 180
        while True:
            if self._failed is not None:
                raise RuntimeError("serve harness failed to start") from self._failed
            try:
                if httpx.get(f"{self.base_url}/healthz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"serve harness: no /healthz on {self.base_url} in 180 s")
            time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(timeout=60)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (a coroutine factory) on the service's loop and return its result."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(fn(), self.loop).result(timeout=120)

    def _run(self) -> None:
        try:
            if self._borrowed is not None:
                self._borrowed.run_until_complete(self._main())
            else:
                asyncio.run(self._main())
        except BaseException as exc:  # surfaced by __enter__
            self._failed = exc

    async def _main(self) -> None:
        import uvicorn

        self.loop = asyncio.get_running_loop()
        self.engine = self.make_engine()
        replica = Replica(self.engine, self.buffer, prompts=None, scorer=None,
                          tokenizer=self.tokenizer, rollout=self.cfg.rollout)
        self.replica = replica
        store = EpisodeStore(self.buffer, ChatRenderer(self.tokenizer),
                             ttl_s=self.cfg.serve.episode_ttl_s,
                             group_timeout_s=self.cfg.serve.group_timeout_s)
        self.service = Service(self.cfg, Router([LocalBackend(replica)]), store,
                               self.tokenizer, "tiny")

        async def learner_version() -> int:
            return self.buffer.stats().learner_version

        app = create_app(self.service, api_key=self.api_key,
                         max_body_bytes=self.cfg.serve.max_body_bytes,
                         retry_after_s=self.cfg.serve.retry_after_s,
                         learner_version=learner_version)
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                     log_level="warning"))
        try:
            await self._server.serve()
        finally:
            if self._borrowed is None:
                await self.engine.close()
