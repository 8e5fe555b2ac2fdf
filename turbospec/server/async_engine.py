"""One engine, many clients: the synchronous LLMEngine runs in a background thread and the asyncio side talks
to it through a command queue (add, abort) and per-request output queues.

Only the engine thread touches the engine, so the engine needs no locks. Every step's outputs cross to the
event loop in one ``call_soon_threadsafe``. A request whose consumer goes away (a client disconnects, a
handler is cancelled) is aborted, which frees its KV blocks; a failure inside the engine fails the requests
it touched and the loop carries on with the rest.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from ..engine import LLMEngine
from ..outputs import RequestOutput
from ..parallel.comm import TensorParallelError
from ..sampling_params import SamplingParams

log = logging.getLogger("turbospec.server")

IDLE_WAIT_S = 0.5  # how long the idle engine thread sleeps between checks for new commands
# How long the event loop's thread may hold the GIL while the engine thread waits for it. The engine thread lets
# go of the GIL in every torch operator (hundreds a step) and must take it back after each; at Python's default
# of 5 ms the event loop's thread, busy streaming tokens, may keep it waiting that long after any of them. Served
# smollm2-135m at 3 req/s with 2 threads, adaptive speculation went from 1.20x no speculation's mean latency
# (benchmarks/results/goodput_sweep/goodput_served_zen4_a.md) to 0.95x (goodput_served_zen4_a_gil.md).
GIL_SWITCH_INTERVAL_S = 0.0002


class EngineOverloaded(Exception):
    """Too many requests are queued: the client should retry later (HTTP 503)."""


class EngineDead(Exception):
    """The engine thread has stopped (shutdown or a crash)."""


class RequestFailed(Exception):
    """The engine refused or failed this request; the message says why."""


class RequestTooLarge(ValueError):
    """One HTTP request asks for more engine requests than the server ever holds at once (HTTP 400: retrying
    cannot help)."""


class Reservation:
    """Seats held for one HTTP request's engine requests from admission until each starts. Without them a burst
    is admitted past the limit before any of its requests registers, and the later ones fail on their own."""

    def __init__(self, owner: AsyncEngine, seats: int) -> None:
        self.owner = owner
        self.seats = seats

    def take(self) -> None:
        """One engine request starts: its seat becomes its stream."""
        self.seats -= 1
        self.owner.reserved -= 1

    def release(self) -> None:
        """Give back the seats of requests that never started (the run ended early)."""
        self.owner.reserved -= self.seats
        self.seats = 0

    def __del__(self) -> None:  # a run dropped before its requests started (a client gone before streaming)
        self.release()


@dataclass
class _Stream:
    """The asyncio end of one engine request."""

    queue: asyncio.Queue[RequestOutput | Exception] = field(default_factory=asyncio.Queue)
    finished: bool = False


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    speculate: bool
    arrival_time: float
    deterministic: str | None = None
    acceptance: str | None = None


@dataclass
class _Abort:
    request_id: str


StepObserver = Callable[[LLMEngine, list[RequestOutput]], None]


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_pending: int, on_step: StepObserver | None = None) -> None:
        self.engine = engine
        self.max_pending = max_pending
        self.on_step = on_step  # called in the engine thread with each round's outputs (metrics)
        self._commands: queue.SimpleQueue[_Add | _Abort] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, _Stream] = {}  # read and written on the event loop only
        self.reserved = 0  # seats admitted but not started yet (Reservation), on the event loop only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # what killed the engine thread, if anything did
        # prompt + max_tokens of every request held now: the load a replica reports to a token-aware router
        self.outstanding_tokens = 0

    # --- lifecycle -----------------------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))  # for the whole process
        self._thread = threading.Thread(target=self._run, name="turbospec-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Abort whatever is still running, stop the thread and fail the remaining streams."""
        for rid in list(self._streams):
            self._commands.put(_Abort(rid))
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
        for stream in self._streams.values():
            stream.queue.put_nowait(EngineDead("the server is shutting down"))
        self._streams.clear()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    @property
    def num_pending(self) -> int:
        return len(self._streams)

    # --- the asyncio side ----------------------------------------------------------------------------------

    def check_capacity(self, num_requests: int) -> None:
        if not self.is_alive:
            raise EngineDead("the engine is not running")
        if num_requests > self.max_pending:
            raise RequestTooLarge(f"this request asks for {num_requests} completions (prompts x n), more than the "
                                  f"{self.max_pending} this server holds at once: split it into smaller requests")
        held = len(self._streams) + self.reserved
        if held + num_requests > self.max_pending:
            raise EngineOverloaded(f"the server already holds {held} requests (limit {self.max_pending}): "
                                   "retry later")

    def reserve(self, num_requests: int) -> Reservation:
        """Admit one HTTP request's engine requests at once, or refuse them all (check_capacity's errors)."""
        self.check_capacity(num_requests)
        self.reserved += num_requests
        return Reservation(self, num_requests)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       speculate: bool = True, arrival_time: float | None = None,
                       deterministic: str | None = None, acceptance: str | None = None,
                       reservation: Reservation | None = None) -> AsyncIterator[RequestOutput]:
        """Queue one request and yield its outputs until it finishes. Leaving the loop early (a disconnect,
        a cancelled handler) aborts the request in the engine. With a reservation the request takes a seat
        admitted before; without one it must find a free seat now."""
        if reservation is not None:
            reservation.take()
        else:
            self.check_capacity(1)
        stream = _Stream()
        self._streams[request_id] = stream
        cost = len(prompt_token_ids) + params.max_tokens
        self.outstanding_tokens += cost
        self._send(_Add(request_id, prompt_token_ids, params, speculate, arrival_time or time.monotonic(),
                        deterministic, acceptance))
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    stream.finished = True
                    raise item
                if item.finished:
                    stream.finished = True
                yield item
                if item.finished:
                    return
        finally:
            self.outstanding_tokens -= cost
            self._streams.pop(request_id, None)
            if not stream.finished:
                self._send(_Abort(request_id))

    def _send(self, command: _Add | _Abort) -> None:
        self._commands.put(command)
        self._wake.set()

    def _deliver(self, outputs: list[RequestOutput | tuple[str, Exception]]) -> None:
        """On the event loop: hand each output to its request's stream (gone streams were aborted)."""
        for out in outputs:
            rid, item = (out[0], out[1]) if isinstance(out, tuple) else (out.request_id, out)
            stream = self._streams.get(rid)
            if stream is not None:
                stream.queue.put_nowait(item)

    # --- the engine thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                items = self._apply_commands()
                busy = self.engine.has_unfinished_requests()
                if busy:
                    items += self._step()
                self._observe(items)
                self._post(items)
                if not busy:
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
            self._post(self._apply_commands())
        except BaseException as exc:  # recorded for /health, then the thread ends
            log.exception("the engine thread died")
            self.error = exc
            self._stop.set()
            if self._loop is not None and not self._loop.is_closed():  # nobody will answer the open streams
                self._loop.call_soon_threadsafe(self._fail_streams, f"the engine stopped: {exc}")

    def _fail_streams(self, message: str) -> None:
        for stream in self._streams.values():
            stream.queue.put_nowait(EngineDead(message))

    def _observe(self, items: list[RequestOutput | tuple[str, Exception]]) -> None:
        if self.on_step is None:
            return
        try:
            self.on_step(self.engine, [item for item in items if isinstance(item, RequestOutput)])
        except Exception:  # metrics must never stop serving
            log.exception("step observer failed")

    def _post(self, items: list[RequestOutput | tuple[str, Exception]]) -> None:
        if items and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._deliver, items)

    def _apply_commands(self) -> list[RequestOutput | tuple[str, Exception]]:
        results: list[RequestOutput | tuple[str, Exception]] = []
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return results
            if isinstance(cmd, _Abort):
                out = self.engine.abort_request(cmd.request_id)
                if out is not None:
                    results.append(out)
                continue
            try:
                self.engine.add_request(cmd.prompt_token_ids, cmd.params, request_id=cmd.request_id,
                                        prompt_token_ids=cmd.prompt_token_ids, speculate=cmd.speculate,
                                        arrival_time=cmd.arrival_time, deterministic=cmd.deterministic,
                                        acceptance=cmd.acceptance)
            except ValueError as exc:
                results.append((cmd.request_id, RequestFailed(str(exc))))

    def _step(self) -> list[RequestOutput | tuple[str, Exception]]:
        engine = self.engine
        try:
            outputs = engine.step()
        except Exception as exc:  # one bad step fails its requests, not the server
            log.exception("engine step failed; failing the running requests")
            fatal = isinstance(exc, TensorParallelError)  # no later step can run: fail everything and stop,
            # so /health turns unhealthy and a supervisor (Ray Serve, Kubernetes) replaces this server
            doomed = list(engine.requests) if fatal else [r.request_id for r in engine.scheduler.running]
            # our own error says what broke (a rank exited); another exception's text stays in the log
            message = (f"the engine stopped: {exc}" if fatal
                       else "the engine failed while running this request's step (the server's log has the details)")
            failed = [out for out in (engine.fail_request(rid, message) for rid in doomed) if out is not None]
            if fatal:
                self._post(failed)
                raise
            return failed  # finish_reason "error", with the message
        return list(outputs)
