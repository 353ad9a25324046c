"""``streamrl serve``: the rollout fleet behind an OpenAI-compatible API that trains agents
(DESIGN.md §10).

Rooms, dependencies pointing down:
    __init__.py   run_serve: runtime + service + HTTP server, trainer thread, bus watcher
    app.py        FastAPI routes, auth, limits, status codes
    service.py    one call: plan -> sample -> record -> OpenAI answer; /metrics
    episodes.py   EpisodeStore: exact token records, segments, groups, admission, TTL
    router.py     which replica answers (sticky per episode) and the replica backends
    protocol.py   OpenAI request structs and response objects

One process serves: the driver runs the HTTP server (uvicorn) and the episode store; the
engines live in the runtime's replica actors (``build_runtime(serving=True)``: no prompt loops).

Training, by buffer:
- memory (the default): ``serve.train=true`` runs the learner in the same Ray runtime, on a
  thread of this process (the same ``Controller`` as ``streamrl train``); its weight bus
  reaches the replicas directly. The buffer lives in this process too: the service admits and
  puts, the controller takes. ``serve.train=false`` only serves and records.
- redis: ``streamrl serve serve.train=false buffer=redis buffer.run=R`` and ``streamrl train
  buffer=redis buffer.run=R rollout.num_replicas=0`` are two long-running processes. The trainer
  writes its weight-bus endpoint into ``streamrl:R:stats`` (field ``bus_endpoint``); the
  service polls it and connects (or, after a trainer restart, reconnects) its replicas to it.
  The trainer waits for episodes as long as the service is away (logging every
  ``buffer.take_timeout_s``); the service keeps serving without a trainer, answering 429 once
  the staleness bound is reached.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

from streamrl.config import Config
from streamrl.errors import ConfigError
from streamrl.logs import redact_url

log = logging.getLogger(__name__)

API_KEY_ENV = "STREAMRL_API_KEY"
REFRESH_S = 1.0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def api_key_of(cfg: Config) -> str | None:
    """The bearer token (``serve.api_key`` or $STREAMRL_API_KEY); refuses a non-loopback bind
    without one."""
    key = cfg.serve.api_key or os.environ.get(API_KEY_ENV) or None
    if key is None and not _is_loopback(cfg.serve.host):
        raise ConfigError(f"serve.host={cfg.serve.host!r}: binding anything but a loopback "
                          f"address needs a bearer token (serve.api_key or ${API_KEY_ENV})")
    return key


def run_serve(cfg: Config) -> int:
    """``streamrl serve``: serve until SIGINT/SIGTERM, then shut down gracefully."""
    import uvicorn

    from streamrl.controller import Controller
    from streamrl.rollout_fleet.agent.render import ChatRenderer
    from streamrl.runtime import build_runtime
    from streamrl.runtime.placement import freeze_startup_heap
    from streamrl.serve.app import create_app
    from streamrl.serve.episodes import EpisodeStore
    from streamrl.serve.router import ActorBackend, Router
    from streamrl.serve.service import Service

    api_key = api_key_of(cfg)
    _Server = _server_class()
    if cfg.rollout.num_replicas < 1:
        raise ConfigError("rollout.num_replicas=0: streamrl serve needs at least one replica")
    train = cfg.serve.train
    with build_runtime(cfg, learners=train, serving=True) as rt:
        router = Router([ActorBackend(m) for m in rt.fleet.members],
                        rolling=cfg.weight_bus.update_policy == "rolling",
                        swap_wait_s=cfg.weight_bus.timeout_s)
        store = EpisodeStore(rt.buffer, ChatRenderer(rt.tokenizer), ttl_s=cfg.serve.episode_ttl_s,
                             group_timeout_s=cfg.serve.group_timeout_s,
                             max_group_size=cfg.serve.max_group_size,
                             max_episodes_per_client=cfg.serve.max_episodes_per_client)
        name = cfg.serve.model_name or Path(rt.model_path).name
        service = Service(cfg, router, store, rt.tokenizer, name)

        async def learner_version() -> int | None:
            try:
                return (await asyncio.to_thread(rt.buffer.stats)).learner_version
            except Exception:  # a metrics scrape must not fail because Redis blinked
                return None

        app = create_app(service, api_key=api_key, max_body_bytes=cfg.serve.max_body_bytes,
                         retry_after_s=cfg.serve.retry_after_s, learner_version=learner_version)
        server = _Server(uvicorn.Config(
            app, host=cfg.serve.host, port=cfg.serve.port, log_level="warning",
            timeout_graceful_shutdown=int(cfg.serve.shutdown_timeout_s)))

        controller = Controller(cfg, rt, patient=True) if train else None
        trainer = threading.Thread(target=_train, args=(controller,), name="serve-trainer",
                                   daemon=True) if controller is not None else None

        async def main() -> None:
            upkeep = asyncio.ensure_future(_upkeep(service, rt, watch_bus=not train))
            if trainer is not None:
                trainer.start()
            log.info("streamrl serve: %s on http://%s:%d/v1 (%d replicas, training %s)",
                     name, cfg.serve.host, cfg.serve.port, len(rt.fleet.replicas),
                     "here" if train else "elsewhere" if cfg.buffer.backend == "redis" else "off")
            freeze_startup_heap()
            try:
                await server.serve()  # returns after SIGINT/SIGTERM and in-flight calls finish
            finally:
                service.accepting = False
                upkeep.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await upkeep
                store.flush()  # rewarded groups reach the buffer; open episodes give slots back
                log.info("streamrl serve: flushed; episode counters %s", store.counters)

        try:
            _run_loop(main())
        finally:
            if controller is not None and trainer is not None:
                controller.stop()
                trainer.join(timeout=cfg.serve.shutdown_timeout_s + cfg.buffer.take_timeout_s)
    return 0


def _run_loop(main: Coroutine[Any, Any, None]) -> None:
    """``asyncio.run(main)``, on uvloop when it is installed (vLLM brings it), as vLLM's own
    server and ``uvicorn.run`` run theirs: the loop runs every call's HTTP parsing, tasks and
    Ray replies, and benchmarks/serve.py compares the service with vLLM's server loop for
    loop."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


def _server_class() -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises SIGTERM/SIGINT after its own shutdown, which would end the process
        before the episodes are flushed and the trainer stopped; here the signal only starts
        the graceful shutdown, and ``streamrl serve`` exits 0 once it is done."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            handled = (signal.SIGINT, signal.SIGTERM)
            originals = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in originals.items():
                    signal.signal(sig, handler)

    return Server


def _train(controller: Any) -> None:
    try:
        controller.fit()
    except Exception:
        log.exception("streamrl serve: the trainer stopped; the service keeps serving")


async def _upkeep(service: Any, rt: Any, *, watch_bus: bool) -> None:
    """Every second: expire episodes and late groups, read the served version, and (serve
    without its own learner, Redis buffer) follow the trainer's announced bus endpoint."""
    endpoint = None
    lookup = getattr(rt.buffer, "bus_endpoint", None) if watch_bus else None
    while True:
        try:
            await service.refresh()
            if lookup is not None:
                announced = await asyncio.to_thread(lookup)
                if announced and announced != endpoint:
                    # The endpoint carries the bus token (?token=): the replicas need it, the
                    # log must not show it.
                    log.info("streamrl serve: connecting replicas to the trainer at %s",
                             redact_url(announced))
                    await asyncio.gather(*(r.connect_bus.remote(announced)
                                           for r in rt.fleet.replicas))
                    endpoint = announced
        except Exception:
            log.exception("streamrl serve: upkeep failed; retrying")
        await asyncio.sleep(REFRESH_S)
