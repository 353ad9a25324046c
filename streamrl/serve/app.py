"""The HTTP face of ``streamrl serve`` (FastAPI; uvicorn runs it).

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming with
``"stream": true``: server-sent events ending in ``data: [DONE]``), ``GET /v1/models``,
``POST /v1/episodes/{id}/reward``, ``GET /healthz`` (no token needed), ``GET /metrics``
(Prometheus text).

Status codes: 400 for a malformed body, a wrong field, an oversized body or ``max_tokens`` over
the limit (one line naming the field); 401 without the bearer token when one is configured;
404 / 409 for an unknown or busy episode; 429 with ``Retry-After`` when opening an episode would
pass the staleness bound; 503 while shutting down. Bodies are JSON decoded by msgspec into
typed structs: nothing is ever unpickled.

Depends on service.py, protocol.py and episodes.py (errors).
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from streamrl.serve import protocol
from streamrl.serve.episodes import AtCapacity, EpisodeError
from streamrl.serve.protocol import ChatRequest, CompletionRequest, RequestError, RewardRequest
from streamrl.serve.service import Service

log = logging.getLogger(__name__)

EPISODE_HEADER = "x-episode-id"
GROUP_HEADER = "x-group-id"
OPEN_ROUTES = frozenset({"/healthz"})
Sampled = TypeVar("Sampled", ChatRequest, CompletionRequest)


def _error(status: int, message: str, kind: str, headers: dict[str, str] | None = None
           ) -> JSONResponse:
    return JSONResponse(protocol.error_body(message, kind, status), status_code=status,
                        headers=headers)


def create_app(service: Service, *, api_key: str | None, max_body_bytes: int,
               retry_after_s: int, learner_version: Callable[[], Awaitable[int | None]]
               ) -> FastAPI:
    app = FastAPI(title="streamrl serve", docs_url=None, redoc_url=None, openapi_url=None)
    expected = f"Bearer {api_key}".encode() if api_key else None

    app.add_middleware(_Guard, service=service, expected=expected,
                       max_body_bytes=max_body_bytes)

    async def body_of(request: Request) -> bytes:
        body = await request.body()
        if len(body) > max_body_bytes:  # chunked bodies declare no length
            raise RequestError(f"body: {len(body)} bytes is over serve.max_body_bytes="
                               f"{max_body_bytes}")
        return body

    def episode_of(request: Request, user: str | None) -> str | None:
        return request.headers.get(EPISODE_HEADER) or user or None

    async def answer(run: Callable[[], Awaitable[Any]]) -> Response:
        try:
            result = await run()
        except RequestError as exc:
            service.metrics.errors.labels("400").inc()
            return _error(400, str(exc), "invalid_request_error")
        except EpisodeError as exc:
            service.metrics.errors.labels(str(exc.status)).inc()
            return _error(exc.status, str(exc), "invalid_request_error")
        except AtCapacity:
            service.metrics.errors.labels("429").inc()
            service.metrics.at_capacity.inc()
            return _error(429, "at the staleness bound: no episode may open until the trainer "
                          "consumes more; retry later", "rate_limit_error",
                          {"Retry-After": str(retry_after_s)})
        except Exception as exc:  # a replica or the buffer failed: say so, keep serving
            log.exception("call failed")
            service.metrics.errors.labels("500").inc()
            return _error(500, f"{type(exc).__name__}: {exc}", "server_error")
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(_sse(result), media_type="text/event-stream")

    async def sample(request: Request, kind: type[Sampled],
                     call: Callable[[Sampled, str | None, str | None], Awaitable[Any]]
                     ) -> Response:
        async def run() -> Any:
            body = protocol.decode_request(await body_of(request), kind)
            return await call(body, episode_of(request, body.user),
                              request.headers.get(GROUP_HEADER))
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
            return service.close(episode_id, body)  # on the loop: the store is not thread-safe
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


class _Guard:
    """Bearer token, shutdown and declared body size, checked before a route runs. A plain ASGI
    middleware: Starlette's ``@app.middleware("http")`` wraps every call in an extra task and
    re-streams its body, a measurable share of a small call's cost."""

    def __init__(self, app: Any, *, service: Service, expected: bytes | None,
                 max_body_bytes: int) -> None:
        self.app = app
        self.service = service
        self.expected = expected
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            refused = self._refusal(scope)
            if refused is not None:
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: dict[str, Any]) -> Response | None:
        headers = dict(scope["headers"])
        token = headers.get(b"authorization", b"")
        if (self.expected is not None and scope["path"] not in OPEN_ROUTES
                and not hmac.compare_digest(token, self.expected)):
            return _error(401, "missing or wrong bearer token (Authorization: Bearer ...)",
                          "authentication_error")
        if scope["method"] == "POST":
            if not self.service.accepting:
                return _error(503, "the service is shutting down", "unavailable")
            declared = headers.get(b"content-length", b"")
            if declared.isdigit() and int(declared) > self.max_body_bytes:
                return _error(400, f"body: {int(declared)} bytes is over serve.max_body_bytes="
                              f"{self.max_body_bytes}", "invalid_request_error")
        return None


async def _sse(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n".encode()
    except Exception as exc:  # headers are sent: report in-band, as OpenAI servers do
        log.exception("stream failed")
        yield f"data: {json.dumps(protocol.error_body(str(exc), 'server_error', 500))}\n\n".encode()
    yield b"data: [DONE]\n\n"
