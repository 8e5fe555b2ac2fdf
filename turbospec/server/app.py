"""The OpenAI-compatible HTTP server: routes, error handlers and the engine's lifetime (``build_app``)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import LLMEngine
from .async_engine import AsyncEngine
from .errors import (APIError, api_error_handler, bad_request, http_error_handler, internal_error_handler,
                     json_error, validation_error_handler)
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .serving import OpenAIServing

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def host_names_for(bind_host: str) -> frozenset[str] | None:
    """The Host header names a server bound to `bind_host` answers: a loopback server only loopback names (a web
    page on another site could otherwise read it through DNS rebinding); one bound wider, any name (None)."""
    return frozenset(LOOPBACK_HOSTS) if bind_host in LOOPBACK_HOSTS else None


def _host_name(header: str) -> str:
    """'127.0.0.1:8000' -> '127.0.0.1', '[::1]:8000' -> '::1', 'localhost' -> 'localhost'."""
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def build_app(engine: LLMEngine, model_name: str, max_pending: int = 256,
              host_names: frozenset[str] | None = None) -> FastAPI:
    """An app serving `engine` as `model_name`. At most `max_pending` engine requests (choices) are held at
    once; beyond that new requests get 503 with Retry-After instead of queueing without bound. With
    `host_names`, a request whose Host header names another host is refused (400)."""
    metrics = ServerMetrics(model_name)
    async_engine = AsyncEngine(engine, max_pending, metrics.on_step)
    serving = OpenAIServing(async_engine, model_name)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        yield
        await async_engine.stop()  # on SIGTERM, after uvicorn's graceful wait: aborts what is left

    app = FastAPI(title="turbospec", version="0.1.0", lifespan=lifespan)
    app.state.async_engine = async_engine
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(Exception, internal_error_handler)

    if host_names is not None:
        @app.middleware("http")
        async def check_host(request: Request, call_next: Any) -> Response:
            name = _host_name(request.headers.get("host", "")).lower()
            if name not in host_names:
                return json_error(400, f"the Host header {name!r} does not name this server: a server bound to a "
                                       f"loopback address answers only {', '.join(sorted(host_names))} (start it "
                                       "with --host 0.0.0.0 to serve other names)", "invalid_request_error")
            return await call_next(request)

    @app.get("/health")
    async def health() -> JSONResponse:
        if async_engine.is_alive:
            return JSONResponse({"status": "ok"})
        reason = f"the engine stopped: {async_engine.error!r}" if async_engine.error else "the engine is not running"
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "turbospec", "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        serving.check_model(req.model)
        if req.messages is not None:
            ids = serving.chat_ids(req.messages, req.add_generation_prompt)
        else:
            assert req.prompt is not None
            ids = serving.encode(req.prompt, req.add_special_tokens)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        serving.check_model(req.model)
        vocab = engine.model_config.vocab_size
        bad = [t for t in req.tokens if t >= vocab]
        if bad:
            raise bad_request(f"tokens must be ids in [0, {vocab}), got {bad[:3]}", "tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens)}

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest, raw: Request) -> dict[str, Any] | StreamingResponse:
        run = serving.completion_run(req, time.monotonic())
        if req.stream:
            return StreamingResponse(serving.completion_stream(req, run), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        return await serving.completion(req, run, raw.is_disconnected)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> dict[str, Any] | StreamingResponse:
        run = serving.chat_run(req, time.monotonic())
        if req.stream:
            return StreamingResponse(serving.chat_stream(req, run), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        return await serving.chat(req, run, raw.is_disconnected)

    return app


class _DrainingServer(uvicorn.Server):
    """uvicorn re-raises SIGTERM / SIGINT once its graceful shutdown is over, so the process would die of the
    signal (exit -15). A server that drained its requests cleanly should exit 0, as process managers expect."""

    def handle_exit(self, sig: int, frame: object) -> None:
        super().handle_exit(sig, frame)  # type: ignore[arg-type]
        self._captured_signals.clear()


def run_server(app: FastAPI, host: str, port: int, log_level: str = "info", graceful_timeout: float = 10.0) -> None:
    """Serve until SIGTERM / SIGINT: stop accepting, let in-flight requests finish for up to
    `graceful_timeout` seconds, abort the rest, exit normally."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=graceful_timeout)
    _DrainingServer(config).run()
