"""`turbospec chat` through a pseudo-terminal, as a person types: a question and its streamed answer, /stats,
/set, Ctrl-C in the middle of an answer (the chat goes on), Ctrl-D (it ends, exit 0)."""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import time

import pytest

PROMPT = ">>> "


class Terminal:
    def __init__(self, args: list[str]) -> None:
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen([sys.executable, "-m", "turbospec.cli", "chat", *args], stdin=slave,
                                     stdout=slave, stderr=slave, close_fds=True)
        os.close(slave)
        self.seen = ""

    def read_until(self, marker: str, timeout: float) -> str:
        """Everything printed up to and including the next `marker` (fails after `timeout` seconds)."""
        deadline = time.monotonic() + timeout
        while marker not in self.seen:
            left = deadline - time.monotonic()
            assert left > 0, f"no {marker!r} within {timeout} s; the terminal shows:\n{self.seen[-2000:]}"
            ready, _, _ = select.select([self.master], [], [], min(left, 0.5))
            if ready:
                try:
                    self.seen += os.read(self.master, 4096).decode(errors="replace")
                except OSError:  # the child closed the terminal
                    assert marker in self.seen, self.seen[-2000:]
        head, _, self.seen = self.seen.partition(marker)
        return head

    def read_at_least(self, chars: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.seen) < chars:
            assert time.monotonic() < deadline, f"only {self.seen!r} within {timeout} s"
            if select.select([self.master], [], [], 0.2)[0]:
                self.seen += os.read(self.master, 4096).decode(errors="replace")

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())


@pytest.mark.slow
def test_a_terminal_chat_streams_answers_and_obeys_its_commands() -> None:
    term = Terminal(["smollm2-135m", "--temperature", "0", "--max-tokens", "24", "--ignore-eos",
                     "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    try:
        banner = term.read_until(PROMPT, 300)
        assert "turbospec chat with smollm2-135m" in banner and "ngram" in banner
        term.type("What is the capital of France?\n")
        answer = term.read_until(PROMPT, 120)
        assert len(answer.strip().splitlines()[-1]) > 3  # streamed text arrived
        term.type("/stats\n")
        assert "tok/s" in term.read_until(PROMPT, 30)
        term.type("/set temperature hot\n")
        assert "is not a number" in term.read_until(PROMPT, 30)
        term.type("/set colour red\n")
        assert "temperature, top_p" in term.read_until(PROMPT, 30)
        term.type("/set max_tokens 2000\n")
        assert "max_tokens = 2000" in term.read_until(PROMPT, 30)
        term.type("Count from 1 to 200, one number per line.\n")
        term.read_until("\n", 30)  # the terminal's echo of the line typed
        # the answer is streaming: more than the typed line, which a loaded machine may echo twice (the terminal's
        # echo before the program reads the line, then the line editor's)
        term.read_at_least(60, 120)
        os.kill(term.proc.pid, signal.SIGINT)  # Ctrl-C
        assert "[stopped]" in term.read_until(PROMPT, 60)
        term.type("/stats\n")
        assert "(stopped)" in term.read_until(PROMPT, 30)
        term.type("\x04")  # Ctrl-D
        assert term.proc.wait(timeout=30) == 0
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
        os.close(term.master)


@pytest.mark.slow
def test_a_model_without_a_chat_template_is_refused_with_exit_2() -> None:
    done = subprocess.run([sys.executable, "-m", "turbospec.cli", "chat", "gemma3-270m"], capture_output=True,
                          text=True, timeout=600)  # (a base model)
    assert done.returncode == 2 and "no chat template" in done.stderr


def test_the_grafana_dashboard_queries_only_metrics_the_server_exports() -> None:
    import json
    import re
    from pathlib import Path

    from turbospec.server.metrics import ServerMetrics

    dashboard = json.loads((Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {re.sub(r"_(total|bucket|sum|count)$", "", name) for e in exprs
            for name in re.findall(r"turbospec:[a-z0-9_]+", e)}
    declared = {family.name for family in ServerMetrics("m").registry.collect()}  # (counters without _total)
    assert len(exprs) >= 12 and len(used) >= 12 and used <= declared, sorted(used - declared)
