"""A real turbospec HTTP server (uvicorn on a free localhost port) in a background thread, for tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import uvicorn

from turbospec.engine import LLMEngine
from turbospec.server.app import build_app
from turbospec.server.guards import GuardConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    engine: LLMEngine
    url: str  # http://127.0.0.1:PORT

    @property
    def v1(self) -> str:
        return self.url + "/v1"


@contextmanager
def live_server(engine: LLMEngine, model_name: str, max_pending: int = 256,
                guard: GuardConfig | None = None, port: int | None = None) -> Iterator[LiveServer]:
    """`port`: a given one (a server started again where a client expects it); by default a free one."""
    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, model_name, max_pending, guard), host="127.0.0.1",
                                           port=port, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield LiveServer(engine, f"http://127.0.0.1:{port}")
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextmanager
def serve_process(*flags: str, model: str = "dummy:tiny") -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`turbospec serve` as its own process on a free port, once /health answers: (the process, its URL).
    Killed on exit if still running; its output (stdout and stderr) stays readable from the process."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "turbospec.cli", "serve", "--model", model, "--port", str(port),
                             *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("the server did not start")
            time.sleep(0.1)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
