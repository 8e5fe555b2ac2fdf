"""What every request passes before a route sees it: the API key, the Host header of a loopback server, and the
body's size and read time. One ASGI middleware, so that a refused request costs the server nothing: no body is
parsed, nothing is tokenised."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
BODY_READ_TIMEOUT_S = 30.0  # a client that announces a body and does not send it loses its connection's hold
MIN_BODY_LIMIT = 1 << 20
BYTES_PER_TOKEN_LIMIT = 64  # far above any tokenizer's text per token, JSON escapes included
DRAIN_FACTOR = 64  # how far past the limit a refused body is still read (then the connection is answered)
OPEN_PATHS = ("/health", "/")  # answered without the API key (liveness probes; the page, which holds no data)


def host_names_for(bind_host: str) -> frozenset[str] | None:
    """The Host header names a server bound to `bind_host` answers: a loopback server only loopback names (a web
    page on another site could otherwise read it through DNS rebinding); one bound wider, any name (None)."""
    return frozenset(LOOPBACK_HOSTS) if bind_host in LOOPBACK_HOSTS else None


def body_limit(max_model_len: int) -> int:
    """The largest request body worth reading: a prompt that fits the context cannot need more bytes."""
    return max(MIN_BODY_LIMIT, BYTES_PER_TOKEN_LIMIT * max_model_len)


def host_name(header: str) -> str:
    """'127.0.0.1:8000' -> '127.0.0.1', '[::1]:8000' -> '::1', 'localhost' -> 'localhost'."""
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


@dataclass(frozen=True)
class GuardConfig:
    api_key: str | None = None  # None: no authentication
    metrics_public: bool = False  # /metrics without the key
    host_names: frozenset[str] | None = None  # None: any Host
    max_body_bytes: int = MIN_BODY_LIMIT
    read_timeout_s: float = BODY_READ_TIMEOUT_S


class RequestGuard:
    def __init__(self, app: ASGIApp, config: GuardConfig) -> None:
        self.app = app
        self.config = config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        refusal = self._refusal(scope["path"], headers)
        if refusal is not None:
            await _respond(send, *refusal)
            return
        body = await self._read_body(receive, send)
        if body is None:
            return
        replayed = False

        async def replay() -> Message:  # the body once, then the client's own events (disconnects)
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _refusal(self, path: str, headers: dict[str, str]) -> tuple[int, str, str, str | None] | None:
        c = self.config
        if c.host_names is not None:
            name = host_name(headers.get("host", "")).lower()
            if name not in c.host_names:
                return (400, f"the Host header {name!r} does not name this server: a server bound to a loopback "
                             f"address answers only {', '.join(sorted(c.host_names))} (start it with --host 0.0.0.0 "
                             "to serve other names)", "invalid_request_error", None)
        if c.api_key is not None and path not in OPEN_PATHS and not (path == "/metrics" and c.metrics_public):
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), c.api_key.encode()):
                return (401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the key "
                             "the server was started with (--api-key or TURBOSPEC_API_KEY)", "invalid_request_error",
                        "invalid_api_key")
        return None

    async def _read_body(self, receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None after answering for it: too large, or not sent in time. A body over the limit
        is read on and dropped (up to DRAIN_FACTOR times the limit) before the 413, so that a client still
        uploading it receives the answer rather than a reset connection."""
        chunks: list[bytes] = []
        size = 0
        too_large = False
        deadline = time.monotonic() + self.config.read_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                await _respond(send, 408, f"the request body did not arrive within {self.config.read_timeout_s:g} s "
                                          "(is its Content-Length larger than the body?)", "invalid_request_error")
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            too_large = too_large or size > self.config.max_body_bytes
            if too_large:
                chunks.clear()
                if not message.get("more_body", False) or size > DRAIN_FACTOR * self.config.max_body_bytes:
                    await _respond(send, *_too_large(size, self.config.max_body_bytes))
                    return None
                continue
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _too_large(size: int, limit: int) -> tuple[int, str, str, str | None]:
    return (413, f"the request body has {size} bytes or more, more than this server reads ({limit} bytes): no "
                 "prompt that fits its context needs that many", "invalid_request_error", None)


async def _respond(send: Send, status: int, message: str, type_: str, code: str | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
