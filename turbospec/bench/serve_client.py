"""One streamed request of ``turbospec bench serve``, sent and timed: the request body, an incremental
server-sent-events parser, and the per-request record (TTFT, inter-token gaps, end-to-end latency, token
counts). Works with any OpenAI-compatible chat or completions endpoint; never raises for a failed request.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from ..data.prompts import BenchPrompt
    from .serve_config import BenchConfig

ENDPOINT_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
# Fields of a chat delta that carry generated text: reasoning models stream their thinking in one of the
# first two (vLLM renamed reasoning_content to reasoning), and those tokens are output tokens too.
CHAT_TEXT_FIELDS = ("reasoning_content", "reasoning", "content")


class SSEParser:
    """Incremental server-sent-events parser: feed raw bytes as they arrive, get the data payloads of the
    events they complete. Handles \\n, \\r\\n and \\r line ends, a line or a UTF-8 character split across
    chunks, comment lines (': keep-alive'), other fields (event:, id:) and multi-line data."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._buffer = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += self._decoder.decode(chunk)
        lines = re.split(r"\r\n|\r|\n", self._buffer)
        # The last piece is an unfinished line; a trailing \r may be the first half of \r\n, so keep it too.
        if self._buffer.endswith("\r"):
            lines[-2:] = [lines[-2] + "\r"]
        self._buffer = lines.pop()
        return [event for line in lines if (event := self._line(line)) is not None]

    def close(self) -> list[str]:
        """Payloads still pending when the stream ends (a last event without its blank line)."""
        tail = (self._buffer + self._decoder.decode(b"", final=True)).rstrip("\r")
        self._buffer = ""
        return [e for e in (self._line(tail) if tail else None, self._line("")) if e is not None]

    def _line(self, line: str) -> str | None:
        if not line:  # a blank line dispatches the event
            if not self._data:
                return None
            payload, self._data = "\n".join(self._data), []
            return payload
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value.removeprefix(" "))  # one optional space after the colon
        return None  # comments (empty name) and other fields carry no data


@dataclass
class RequestRecord:
    """One request's outcome. Times in ms; ttft is None when no text arrived, tpot when under 2 tokens."""

    index: int
    prompt_id: str
    success: bool = False
    error: str | None = None
    scheduled_s: float = 0.0  # arrival time from the start of the rate's run
    sent_s: float = 0.0  # when it was sent (later than scheduled when --max-concurrency held it back)
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None  # None when the server sent no usage
    output_tokens: int = 0
    output_tokens_from: str = "chunks"  # 'usage' (the server's count) or 'chunks' (text chunks counted)
    output_chars: int = 0
    connection_lost: bool = False  # could not connect, or the stream broke off: the server may be gone


@dataclass
class StreamTracker:
    """Timing and token counts of one streamed response, fed event by event."""

    endpoint: str
    start: float
    first_text: float | None = None
    last_text: float | None = None
    itl: list[float] = field(default_factory=list)
    text_chunks: int = 0
    chars: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None

    def on_event(self, payload: str, now: float) -> None:
        data = json.loads(payload)
        if not isinstance(data, dict):
            # ValueError like a JSON syntax error: send_request records both as a malformed stream
            raise ValueError(f"stream event is not a JSON object: {payload[:200]}")  # noqa: TRY004
        if data.get("error"):  # vLLM and others report a failure mid-stream as an error event
            self.error = f"error event: {json.dumps(data['error'])[:1000]}"
            return
        if isinstance(usage := data.get("usage"), dict):
            self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
            self.completion_tokens = usage.get("completion_tokens", self.completion_tokens)
        text = chunk_text(data, self.endpoint)
        if not text:  # role-only, finish-reason and usage chunks are not tokens
            return
        if self.first_text is None:
            self.first_text = now
        else:  # one gap per text chunk, however many tokens it carries (speculation emits several)
            self.itl.append(now - self.last_text)
        self.last_text = now
        self.text_chunks += 1
        self.chars += len(text)

    def fill(self, record: RequestRecord, end: float) -> None:
        """Write the outcome into `record`; `end` is when the stream finished."""
        record.success = self.error is None
        record.error = self.error
        record.e2el_ms = (end - self.start) * 1e3
        record.ttft_ms = None if self.first_text is None else (self.first_text - self.start) * 1e3
        record.itl_ms = [g * 1e3 for g in self.itl]
        record.prompt_tokens = self.prompt_tokens
        if self.completion_tokens is not None:
            record.output_tokens, record.output_tokens_from = int(self.completion_tokens), "usage"
        else:
            record.output_tokens, record.output_tokens_from = self.text_chunks, "chunks"
        record.output_chars = self.chars
        if record.ttft_ms is not None and record.output_tokens > 1:
            record.tpot_ms = (record.e2el_ms - record.ttft_ms) / (record.output_tokens - 1)


def chunk_text(data: dict[str, Any], endpoint: str) -> str:
    """The generated text one stream chunk carries (first choice; the benchmark asks for one)."""
    choices = data.get("choices")
    if not choices or not isinstance(choices[0], dict):
        return ""
    choice = choices[0]
    if endpoint == "completions":
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return "".join(delta.get(key) or "" for key in CHAT_TEXT_FIELDS)


def request_body(config: BenchConfig, model: str, prompt: BenchPrompt) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": config.max_tokens, "temperature": config.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = prompt.text
    if config.ignore_eos:
        body["ignore_eos"] = True
    return body | config.extra_body


async def send_request(client: httpx.AsyncClient, config: BenchConfig, model: str, prompt: BenchPrompt,
                       index: int = 0, origin: float | None = None) -> RequestRecord:
    """Send one streamed request and time it. Never raises for a failed request: the record says why.
    origin: perf_counter() of the run's start, for the record's sent_s."""
    record = RequestRecord(index=index, prompt_id=prompt.id)
    start = time.perf_counter()
    record.sent_s = 0.0 if origin is None else start - origin
    tracker = StreamTracker(config.endpoint, start)
    url = config.base_url + ENDPOINT_PATHS[config.endpoint]
    try:
        async with asyncio.timeout(config.timeout):
            async with client.stream("POST", url, json=request_body(config, model, prompt)) as response:
                if response.status_code != 200:
                    body = (await response.aread()).decode("utf-8", "replace")
                    tracker.error = f"HTTP {response.status_code}: {body.strip()[:1000]}"
                else:
                    await _read_events(response, tracker)
    except TimeoutError:
        tracker.error = f"timed out after {config.timeout:g} s (--timeout)"
    except (httpx.HTTPError, ValueError) as exc:  # connection failures, malformed stream data
        tracker.error = f"{type(exc).__name__}: {exc}"
        # a timeout is the server being slow, not gone; connect and read failures may mean it died
        record.connection_lost = isinstance(exc, httpx.TransportError) and not isinstance(exc, httpx.TimeoutException)
    tracker.fill(record, time.perf_counter())
    return record


async def _read_events(response: httpx.Response, tracker: StreamTracker) -> None:
    """Feed the response's events to `tracker` until [DONE], an error event or the end of the stream."""
    parser = SSEParser()
    async for chunk in response.aiter_bytes():
        now = time.perf_counter()
        for payload in parser.feed(chunk):
            if payload.strip() == "[DONE]":
                return
            tracker.on_event(payload, now)
            if tracker.error is not None:
                return
    now = time.perf_counter()
    for payload in parser.close():
        if payload.strip() != "[DONE]":
            tracker.on_event(payload, now)
