"""The HTTP face of ``streamrl serve`` (FastAPI; uvicorn runs it).

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming with
``"stream": true``: server-sent events ending in ``data: [DONE]``), ``GET /v1/models``,
``POST /v1/episodes/{id}/reward``, ``GET /healthz`` (no token needed), ``GET /metrics``
(Prometheus text).

Status codes: 400 for a malformed body, a wrong field or ``max_tokens`` over the limit (one line
naming the field); 401 without the bearer token when one is configured; 403 / 415, when no
token is configured, for a request a web page could have sent (a Host or Origin that is not
loopback, a POST that is not ``application/json``); 404 for an unknown episode; 409 for a call
on an episode whose previous call is still running; 413 for a body over
``serve.max_body_bytes`` (read no further than the limit); 429 with ``Retry-After`` when
opening an episode would pass the staleness bound (and ``retry-after-ms``, the exact wait,
which the openai client reads first), 429 when a client holds
``serve.max_episodes_per_client`` open episodes; 503 while shutting down, or when the buffer
refuses a put (the episode is kept: retry the close). Bodies are JSON decoded by msgspec into
typed structs: nothing is ever unpickled.

A sampling call whose client goes away before its answer is cancelled (the engine aborts the
request; the episode is left as it was). ``Idempotency-Key`` on a sampling call: a retry with
the same key gets the first answer instead of a second turn.

Depends on service.py, protocol.py and episodes.py (errors).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from streamrl.serve import protocol
from streamrl.serve.episodes import AtCapacity, BufferUnavailable, EpisodeError
from streamrl.serve.protocol import ChatRequest, CompletionRequest, RequestError, RewardRequest
from streamrl.serve.service import Caller, Service

log = logging.getLogger(__name__)

EPISODE_HEADER = "x-episode-id"
GROUP_HEADER = "x-group-id"
KEY_HEADER = "idempotency-key"
MAX_KEY_CHARS = 255
OPEN_ROUTES = frozenset({"/healthz"})
Sampled = TypeVar("Sampled", ChatRequest, CompletionRequest)
T = TypeVar("T")


class _ClientGone(Exception):
    """The client disconnected before its answer: nothing to send."""


def _error(status: int, message: str, kind: str, headers: dict[str, str] | None = None
           ) -> JSONResponse:
    return JSONResponse(protocol.error_body(message, kind, status), status_code=status,
                        headers=headers)


def _retry_after(seconds: float) -> dict[str, str]:
    """HTTP's Retry-After takes whole seconds (rounded up here, never sooner than asked);
    ``retry-after-ms`` carries a finer wait to the clients that read it (openai's, first)."""
    return {"Retry-After": str(math.ceil(seconds)), "retry-after-ms": str(round(seconds * 1000))}


def create_app(service: Service, *, api_key: str | None, max_body_bytes: int,
               retry_after_s: float, learner_version: Callable[[], Awaitable[int | None]]
               ) -> FastAPI:
    app = FastAPI(title="streamrl serve", docs_url=None, redoc_url=None, openapi_url=None)
    expected = f"Bearer {api_key}".encode() if api_key else None

    app.add_middleware(_Guard, service=service, expected=expected,
                       max_body_bytes=max_body_bytes)

    async def body_of(request: Request) -> bytes:
        """The body, read no further than the limit (a chunked body declares no length)."""
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise RequestError(f"body: over serve.max_body_bytes={max_body_bytes} bytes",
                                   status=413)
            chunks.append(chunk)
        return b"".join(chunks)

    def caller_of(request: Request, user: str | None) -> Caller:
        key = request.headers.get(KEY_HEADER) or None
        if key is not None and len(key) > MAX_KEY_CHARS:
            raise RequestError(f"Idempotency-Key: {len(key)} characters, over {MAX_KEY_CHARS}")
        return Caller(episode_id=request.headers.get(EPISODE_HEADER) or user or None,
                      group_id=request.headers.get(GROUP_HEADER),
                      client=request.client.host if request.client else "", key=key)

    async def answer(run: Callable[[], Awaitable[Any]]) -> Response:
        try:
            result = await run()
        except (RequestError, EpisodeError) as exc:
            service.metrics.errors.labels(str(exc.status)).inc()
            kind = "rate_limit_error" if exc.status == 429 else "invalid_request_error"
            return _error(exc.status, str(exc), kind)
        except AtCapacity:
            service.metrics.errors.labels("429").inc()
            service.metrics.at_capacity.inc()
            return _error(429, "at the staleness bound: no episode may open until the trainer "
                          "consumes more; retry later", "rate_limit_error",
                          _retry_after(retry_after_s))
        except BufferUnavailable as exc:
            service.metrics.errors.labels("503").inc()
            return _error(503, str(exc), "unavailable", _retry_after(retry_after_s))
        except (_ClientGone, ClientDisconnect):
            service.metrics.client_gone.inc()
            return Response(status_code=499)  # nobody reads it
        except Exception as exc:  # a replica failed: say so, keep serving
            log.exception("call failed")
            service.metrics.errors.labels("500").inc()
            return _error(500, f"{type(exc).__name__}: {exc}", "server_error")
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(_sse(result), media_type="text/event-stream")

    async def sample(request: Request, kind: type[Sampled],
                     call: Callable[[Sampled, Caller], Awaitable[Any]]) -> Response:
        async def run() -> Any:
            body = protocol.decode_request(await body_of(request), kind)
            return await _unless_gone(request, call(body, caller_of(request, body.user)))
        return await answer(run)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await sample(request, ChatRequest, service.chat)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await sample(request, CompletionRequest, service.completion)

    @app.post("/v1/episodes/{episode_id}/reward")
    async def reward(episode_id: str, request: Request) -> Response:
        async def run() -> Any:
            body = protocol.decode_request(await body_of(request), RewardRequest)
            return await service.close(episode_id, body)
        return await answer(run)

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse(service.models())

    @app.get("/healthz")
    async def healthz() -> Response:
        return JSONResponse({"status": "ok" if service.accepting else "shutting_down",
                             "weight_version": service.version})

    @app.get("/metrics")
    async def metrics() -> Response:
        text = service.metrics_text(await learner_version())
        return Response(text, media_type="text/plain; version=0.0.4")

    return app


async def _unless_gone(request: Request, work: Awaitable[T]) -> T:
    """``work``, cancelled if the client disconnects first (its sampling is aborted). A
    streamed answer is watched by Starlette from its first byte on."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the server is stopping this handler
        task.cancel()
        raise
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        await asyncio.wait({task})  # its clean-up (the episode left as it was) runs first
        raise _ClientGone
    return task.result()


async def _disconnected(request: Request) -> None:
    # The body is read: the next message the server sends is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Guard:
    """Checked before a route runs: the bearer token when one is configured, else that the
    request cannot have come from a web page (a browser on this machine can reach a loopback
    port: cross-site POSTs, DNS rebinding); shutdown; the declared body size. A plain ASGI
    middleware: Starlette's ``@app.middleware("http")`` wraps every call in an extra task and
    re-streams its body, a measurable share of a small call's cost."""

    def __init__(self, app: Any, *, service: Service, expected: bytes | None,
                 max_body_bytes: int) -> None:
        self.app = app
        self.service = service
        self.expected = expected
        self.max_body_bytes = max_body_bytes
        self.host = service.cfg.serve.host.lower()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            refused = self._refusal(scope)
            if refused is not None:
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: dict[str, Any]) -> Response | None:
        headers = dict(scope["headers"])
        if self.expected is not None:
            token = headers.get(b"authorization", b"")
            if scope["path"] not in OPEN_ROUTES and not hmac.compare_digest(token,
                                                                            self.expected):
                return _error(401, "missing or wrong bearer token (Authorization: Bearer ...)",
                              "authentication_error")
        else:
            refused = self._browser_refusal(scope, headers)
            if refused is not None:
                return refused
        if scope["method"] == "POST":
            if not self.service.accepting:
                return _error(503, "the service is shutting down", "unavailable")
            declared = headers.get(b"content-length", b"")
            if declared.isdigit() and int(declared) > self.max_body_bytes:
                return _error(413, f"body: {int(declared)} bytes is over serve.max_body_bytes="
                              f"{self.max_body_bytes}", "invalid_request_error")
        return None

    def _browser_refusal(self, scope: dict[str, Any], headers: dict[bytes, bytes]
                         ) -> Response | None:
        """Without a token: only loopback Host and Origin, only JSON POSTs (a page's form or
        ``fetch`` without a preflight can send text/plain or form bodies)."""
        host = headers.get(b"host", b"").decode("latin-1")
        if host and not self._local(_hostname(host)):
            return _error(403, f"Host: {host!r} is not a loopback name; without serve.api_key "
                          "the service answers only loopback hosts (DNS rebinding guard)",
                          "permission_error")
        origin = headers.get(b"origin")
        if origin is not None and not self._local(urlsplit(origin.decode("latin-1")).hostname
                                                  or ""):
            return _error(403, f"Origin: {origin.decode('latin-1')!r} is not loopback; without "
                          "serve.api_key the service refuses calls from web pages",
                          "permission_error")
        if scope["method"] == "POST":
            kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if kind != b"application/json":
                return _error(415, f"Content-Type: {kind.decode('latin-1')!r} is not "
                              "application/json", "invalid_request_error")
        return None

    def _local(self, name: str) -> bool:
        name = name.lower()
        if name in ("localhost", self.host):
            return True
        try:
            return ipaddress.ip_address(name).is_loopback
        except ValueError:
            return False


def _hostname(host: str) -> str:
    """The name in a Host header (``name``, ``name:port``, ``[v6]:port``)."""
    if host.startswith("["):
        return host[1:host.find("]")]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


async def _sse(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n".encode()
    except Exception as exc:  # headers are sent: report in-band, as OpenAI servers do
        log.exception("stream failed")
        yield f"data: {json.dumps(protocol.error_body(str(exc), 'server_error', 500))}\n\n".encode()
    yield b"data: [DONE]\n\n"
