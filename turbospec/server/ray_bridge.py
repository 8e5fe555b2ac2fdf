"""The pieces of the Ray Serve setup that need no Ray: a request carried from the ingress to a replica, the
in-process ASGI call that runs it through the replica's own FastAPI app (``build_app``, so the API has one code
path), the routing hint read from a request body, and the merge of every replica's Prometheus text."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from .prometheus_text import SAMPLE_LINE
from .ray_router import RouteHint, prefix_digest

log = logging.getLogger("turbospec.server")

CHARS_PER_TOKEN = 4  # the ingress does not tokenize: a prompt's tokens are guessed from its length
GUESSED_MAX_TOKENS = 256  # a request without max_tokens (the replica reports the real value)
FORWARDED_HEADERS = ("content-type", "accept", "user-agent")

# a message from a replica: ("start", status, headers) once, then ("body", bytes) chunks
Message = tuple[Any, ...]


@dataclass
class Forwarded:
    """An HTTP request as the ingress received it."""

    method: str
    path: str
    query: str = ""
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""


async def call_asgi(app: Any, req: Forwarded) -> AsyncIterator[Message]:
    """Run `req` through the ASGI `app` in this process and yield its response as messages. Leaving early (the
    caller was cancelled, the client went away) tells the app the client disconnected and cancels it, which aborts
    the request in the engine."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": req.method, "scheme": "http",
        "path": req.path, "raw_path": req.path.encode(), "query_string": req.query.encode(), "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in req.headers],
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0), "state": {},
    }
    out: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await out.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        except Exception:  # the app has already answered 500 (its exception handler); Starlette re-raises
            log.debug("the app raised after answering", exc_info=True)
        finally:
            out.put_nowait(None)

    task = asyncio.create_task(run())
    try:
        while (message := await out.get()) is not None:
            if message["type"] == "http.response.start":
                headers = [(k.decode(), v.decode()) for k, v in message.get("headers", [])]
                yield ("start", message["status"], headers)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield ("body", bytes(message["body"]))
                if not message.get("more_body", False):
                    break
    finally:
        gone.set()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def route_hint(req: Forwarded) -> RouteHint:
    """The cost (guessed prompt tokens + max_tokens, times n) and the prompt-prefix digest of a completion
    request; an empty hint for anything else or a body that is not what the replica will accept."""
    if req.method != "POST" or not req.path.endswith("completions"):
        return RouteHint()
    try:
        body = json.loads(req.body)
        text = _prompt_text(body)
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or GUESSED_MAX_TOKENS
        n = body.get("n") or 1
        return RouteHint(cost=int((len(text) // CHARS_PER_TOKEN + int(max_tokens)) * int(n)),
                         prefix=prefix_digest(text) if text else None)
    except (ValueError, TypeError, AttributeError):  # the replica answers it with a 400
        return RouteHint()


def _prompt_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        parts = []
        for m in body["messages"]:
            content = m.get("content")
            if isinstance(content, list):  # content parts: their text
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"{m.get('role')}: {content or ''}\n")
        return "".join(parts)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt else ""
    return prompt if isinstance(prompt, str) else " ".join(map(str, prompt))


# --- metrics ------------------------------------------------------------------------------------------------

def merge_metrics(texts: dict[str, str]) -> str:
    """Prometheus text from several replicas as one exposition: each family's HELP and TYPE once, then every
    replica's samples with a `replica` label added (the exposition format wants a family's samples together)."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    for replica, text in texts.items():
        current: tuple[list[str], list[str]] | None = None
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                name = line.split(" ", 3)[2]
                current = families.setdefault(name, ([], []))
                if line not in current[0]:
                    current[0].append(line)
            elif line and not line.startswith("#"):
                match = SAMPLE_LINE.match(line)
                if match is None:
                    continue
                if current is None:
                    current = families.setdefault(match.group(1), ([], []))
                labels = match.group(2)
                label = f'replica="{replica}"'
                labels = "{" + label + ("," + labels[1:] if labels and labels != "{}" else "}")
                current[1].append(f"{match.group(1)}{labels} {match.group(3)}")
    return "".join(line + "\n" for head, samples in families.values() for line in head + samples)
