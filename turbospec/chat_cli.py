"""`turbospec chat MODEL`: a conversation in the terminal, as `ollama run` gives one. The model is pulled if
missing; answers stream as they are decoded; slash commands reset the history, show the last answer's speed and
speculation, and change sampling settings. Ctrl-C stops the current answer (the conversation goes on), Ctrl-D
leaves."""

from __future__ import annotations

import importlib
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from .llm import LLM
from .sampling_params import SamplingParams

HELP = """commands:
  /reset               forget the conversation
  /stats               the last answer: tokens, tok/s, and speculation (mean k, tau, acceptance)
  /set NAME VALUE      a sampling setting: {settings}
  /help                this list
  Ctrl-C stops an answer, Ctrl-D leaves"""

# the settings /set changes, each with its parser and what the value may be
SETTINGS: dict[str, tuple[Callable[[str], Any], str]] = {
    "temperature": (float, "a number >= 0 (0: greedy)"),
    "top_p": (float, "a number in (0, 1]"),
    "top_k": (int, "an integer, -1 for off"),
    "min_p": (float, "a number in [0, 1]"),
    "max_tokens": (int, "an integer >= 1"),
    "seed": (lambda v: None if v == "none" else int(v), "an integer, or none"),
}


@dataclass
class AnswerStats:
    tokens: int = 0
    seconds: float = 0.0
    stopped: bool = False
    spec: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        if not self.tokens:
            return "no answer yet"
        speed = f"{self.tokens} tokens in {self.seconds:.2f} s, {self.tokens / max(self.seconds, 1e-9):.1f} tok/s"
        spec = self.spec
        if not spec.get("num_drafts"):
            return speed + "; no drafts verified" + (" (stopped)" if self.stopped else "")
        steps = spec["num_drafts"]
        tau = 1 + spec["num_accepted_tokens"] / steps
        acceptance = spec["num_accepted_tokens"] / max(spec["num_draft_tokens"], 1)
        return (f"{speed}; speculation {spec.get('policy')}: mean k {spec.get('mean_k', 0):.2f}, tau {tau:.2f} "
                f"tokens per verification, {acceptance:.0%} of drafts accepted" + (" (stopped)" if self.stopped else ""))


class TerminalChat:
    def __init__(self, llm: LLM, params: SamplingParams, out: TextIO = sys.stdout) -> None:
        tok = llm.get_tokenizer()
        if not getattr(tok, "has_chat_template", False):
            raise ValueError(f"{llm.config.model} has no chat template, so it cannot hold a conversation: use "
                             "`turbospec generate --model ... --prompt ...` for plain completion")
        self.llm = llm
        self.params = params
        self.out = out
        self.history: list[dict[str, str]] = []
        self.interrupted = False  # set by Ctrl-C (see _on_interrupt)
        self.last = AnswerStats()

    # --- commands ----------------------------------------------------------------------------------------

    def command(self, line: str) -> None:
        name, *rest = line[1:].split()
        if name == "reset":
            self.history.clear()
            self.say("(conversation forgotten)")
        elif name == "stats":
            self.say(self.last.line())
        elif name == "set":
            self.set(rest)
        elif name in ("help", "?"):
            self.say(HELP.format(settings=", ".join(SETTINGS)))
        else:
            self.say(f"unknown command /{name}: /reset, /stats, /set NAME VALUE or /help")

    def set(self, words: list[str]) -> None:
        if len(words) != 2 or words[0] not in SETTINGS:
            self.say("usage: /set NAME VALUE with NAME one of " + ", ".join(SETTINGS))
            return
        name, raw = words
        parse, allowed = SETTINGS[name]
        try:
            self.params = self.params.clone(**{name: parse(raw)})
        except ValueError as exc:
            self.say(f"/set {name}: {raw!r} is not {allowed} ({exc})")
            return
        self.say(f"{name} = {getattr(self.params, name)}")

    # --- answers -----------------------------------------------------------------------------------------

    def answer(self, text: str) -> None:
        """Stream the model's answer to `text`; Ctrl-C stops it (what was said stays in the history)."""
        self.history.append({"role": "user", "content": text})
        engine = self.llm.engine
        start, reply, tokens, stopped, rid = time.perf_counter(), "", 0, False, None
        try:
            ids = self.llm.get_tokenizer().apply_chat_template(self.history, add_generation_prompt=True)
            engine.reset_spec_stats()
            rid = engine.add_request(ids, self.params)
            self.interrupted = False
            while engine.has_unfinished_requests():
                if self.interrupted:  # a Ctrl-C whose KeyboardInterrupt was swallowed (see _on_interrupt)
                    raise KeyboardInterrupt
                for out in engine.step():
                    if out.request_id == rid:
                        reply += out.delta_text
                        tokens = len(out.outputs[0].token_ids)
                        self.out.write(out.delta_text)
                        self.out.flush()
        except KeyboardInterrupt:
            if rid is not None:
                engine.abort_request(rid)
            stopped = True
            self.out.write(" [stopped]")
        except ValueError as exc:  # e.g. the conversation no longer fits the context
            self.history.pop()
            self.say(f"error: {exc} (/reset starts a new conversation)")
            return
            self.out.write(" [stopped]")
        self.out.write("\n")
        self.history.append({"role": "assistant", "content": reply})
        self.last = AnswerStats(tokens, time.perf_counter() - start, stopped, engine.spec_stats_dict())

    def _on_interrupt(self, signum: int, frame: object) -> None:
        """Ctrl-C: raise KeyboardInterrupt as Python does, and remember it. The exception can be lost (raised inside
        a finaliser that runs during a step, where Python only prints it), so the answer loop also checks the flag."""
        self.interrupted = True
        raise KeyboardInterrupt

    def say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def run(self, read: Callable[[str], str] = input) -> int:
        if sys.stdin.isatty():
            importlib.import_module("readline")  # for its effect: line editing and history in input()
        signal.signal(signal.SIGINT, self._on_interrupt)
        self.say(f"turbospec chat with {self.llm.config.model} ({self._speculation()}); /help for commands, "
                 "Ctrl-D to leave")
        while True:
            try:
                line = read(">>> ").strip()
            except EOFError:
                self.say("")
                return 0
            except KeyboardInterrupt:  # at the prompt: a fresh line, as a shell does
                self.say("")
                continue
            if not line:
                continue
            if line.startswith("/"):
                self.command(line)
            else:
                self.answer(line)

    def _speculation(self) -> str:
        spec = self.llm.config.speculative_config
        return "no speculation" if spec is None else f"speculation: {spec.method}, k {self.llm.engine.speculation.mode}"
