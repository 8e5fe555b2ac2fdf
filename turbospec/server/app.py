"""The OpenAI-compatible HTTP server: routes, error handlers and the engine's lifetime (``build_app``)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import LLMEngine
from .async_engine import AsyncEngine
from .errors import (APIError, api_error_handler, bad_request, http_error_handler, internal_error_handler,
                     validation_error_handler)
from .guards import GuardConfig, RequestGuard, body_limit
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .serving import OpenAIServing

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

def build_app(engine: LLMEngine, model_name: str, max_pending: int = 256, guard: GuardConfig | None = None) -> FastAPI:
    """An app serving `engine` as `model_name`. At most `max_pending` engine requests (choices) are held at
    once; beyond that new requests get 503 with Retry-After instead of queueing without bound. `guard` sets the
    API key, the Host names answered and the body limits (guards.py; by default: none, any, the context's)."""
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

    app.add_middleware(RequestGuard, config=guard or GuardConfig(max_body_bytes=body_limit(engine.max_model_len)))

    page = (Path(__file__).parent / "static" / "index.html").read_text()
    spec = engine.config.speculative_config

    @app.get("/", include_in_schema=False)
    async def index() -> HTMLResponse:
        """A chat page over this server's own API, marking the text of steps that accepted drafts."""
        return HTMLResponse(page)

    @app.get("/stats")
    async def stats() -> dict[str, object]:
        # (the mode may change at run time: set_speculation)
        return metrics.snapshot("off" if spec is None else f"{spec.method}, k {engine.speculation.mode}")

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
            ids = await asyncio.to_thread(serving.chat_ids, req.messages, req.add_generation_prompt)
        else:
            assert req.prompt is not None
            ids = await asyncio.to_thread(serving.encode, req.prompt, req.add_special_tokens)
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
        # tokenising untrusted text takes time: off the event loop, which keeps serving every other client
        run = serving.admit(await asyncio.to_thread(serving.completion_run, req, time.monotonic()))
        if req.stream:
            return StreamingResponse(serving.completion_stream(req, run), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        return await serving.completion(req, run, raw.is_disconnected)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> dict[str, Any] | StreamingResponse:
        run = serving.admit(await asyncio.to_thread(serving.chat_run, req, time.monotonic()))
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
