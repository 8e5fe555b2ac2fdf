"""The chat page at / in a real browser: Chromium from the distribution's packages (`make test` installs it with
apt when it can), driven by Playwright's Python API against live servers on smollm2-135m, one per speculation
method (off, n-gram, a draft model, EAGLE). Each answer is checked against the server: its text, which of it
the page marks as accepted drafts, and the answer's tau and k. Skipped, saying why, only when no Chromium could
be installed or started here."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from live_server import LiveServer, live_server

from turbospec.config import EngineConfig
from turbospec.engine import LLMEngine
from turbospec.models.loader import LoadedModel
from turbospec.tuning import build_engine

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
MODEL = "smollm2-135m"
REPEATING = "Repeat after me: the cat sat on the mat. the cat sat on the mat. the cat sat on the mat."
# k fixed: every step drafts, and no step-time profile is needed. The draft model is the target itself
# (no smaller model shares its vocabulary here); EAGLE uses the committed heads/smollm2-135m-eagle.safetensors.
K = 3
METHODS: dict[str, dict[str, Any] | None] = {
    "off": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": K},
    "draft": {"method": "draft", "model": MODEL, "num_speculative_tokens": K},
    "eagle": {"method": "eagle", "num_speculative_tokens": K},
}
SUMMARY = re.compile(r"(\d+) tokens in (\d+) steps: tau ([\d.]+), mean k ([\d.]+), (\d+) of (\d+) drafts accepted")
RUNS_JS = """(i) => Array.from(document.querySelectorAll('.msg.assistant')[i].querySelectorAll('.drafted, .target'))
                     .map((s) => [s.className, s.textContent])"""


@dataclass
class Served:
    tab: Any  # a Playwright page
    live: LiveServer


@dataclass
class Answer:
    runs: list[tuple[str, str]]  # (class, text) of each marked span, in order: "drafted" or "target"
    meta: str  # the summary line under the answer
    proposed: int  # drafts the server verified for it, and accepted (its speculation statistics)
    accepted: int

    @property
    def text(self) -> str:
        return "".join(text for _, text in self.runs)

    def spans(self, cls: str) -> list[str]:
        return [text for c, text in self.runs if c == cls]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if CHROMIUM is None:
        pytest.skip("no Chromium here: `make test` installs the distribution's chromium with apt-get, which failed")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')")
    with sync_api.sync_playwright() as pw:
        try:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        except Exception as exc:  # noqa: BLE001 -- a browser that cannot start here is the skip's reason
            pytest.skip(f"{CHROMIUM} did not start under Playwright: {exc}")
        yield browser
        browser.close()


def _engine(method: str, loaded: LoadedModel | None = None) -> LLMEngine:
    # No prefix caching: the checks ask the server again for the page's question, and a cached prompt runs its
    # last rows on another path, whose bf16 sums can flip a near tie (seen on an AMX Xeon: "Hello!" / "Hello there")
    config = EngineConfig(MODEL, max_model_len=1024, num_threads=1, speculative_config=METHODS[method],
                          enable_prefix_caching=False)
    return build_engine(config, loaded, progress=False)


def _open(browser: Any, live: LiveServer) -> Any:
    tab = browser.new_page()
    tab.goto(live.url + "/")
    _wait_connected(tab)
    tab.fill("#temperature", "0")
    tab.fill("#max_tokens", "24")
    return tab


def _wait_connected(tab: Any) -> None:
    tab.wait_for_function("document.getElementById('model').textContent.includes('smollm2')", timeout=30_000)


@contextmanager
def _served(browser: Any, method: str, loaded: LoadedModel | None = None) -> Iterator[Served]:
    with live_server(_engine(method, loaded), MODEL) as live:
        tab = _open(browser, live)
        yield Served(tab, live)
        tab.close()


@pytest.fixture(scope="module")
def ngram(browser: Any) -> Iterator[Served]:
    with _served(browser, "ngram") as served:
        yield served


def _answer(served: Served, text: str) -> Answer:
    """Send `text` from the page and wait for the whole answer."""
    tab, stats = served.tab, served.live.engine.speculation.stats
    before = tab.locator(".msg.assistant").count()
    proposed, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
    tab.fill("#input", text)
    tab.press("#input", "Enter")
    tab.wait_for_function(f"document.querySelectorAll('.msg.assistant').length > {before} && "
                          f"document.querySelectorAll('.msg.assistant')[{before}].querySelector('.meta') !== null",
                          timeout=120_000)
    return Answer([tuple(r) for r in tab.evaluate(RUNS_JS, before)],
                  tab.locator(".msg.assistant").nth(before).locator(".meta").inner_text(),
                  stats.num_draft_tokens - proposed, stats.num_accepted_tokens - accepted)


def _check_against_server(served: Served, answer: Answer, question: str) -> tuple[int, int]:
    """The page's answer is the server's (the same request, unstreamed), and its summary counts what the server
    did for it: tokens, drafts proposed and accepted, tau = tokens / steps, k = proposed / steps. Returns the
    answer's tokens and steps.

    Each step emits its accepted drafts and then the target's token, but the last one may stop (EOS,
    max_tokens) among its drafts: the server counted those as accepted, the answer holds none after the stop."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": question}], "temperature": 0, "max_tokens": 24}
    want = httpx.post(served.live.url + "/v1/chat/completions", json=body, timeout=120).json()
    assert answer.text == want["choices"][0]["message"]["content"] and answer.text
    found = SUMMARY.fullmatch(answer.meta)
    assert found, answer.meta
    tokens, steps, tau, k, accepted, proposed = found.groups()
    tokens, steps = int(tokens), int(steps)
    assert tokens == want["usage"]["completion_tokens"]
    accepted, proposed = int(accepted), int(proposed)
    assert proposed == answer.proposed and 0 <= answer.accepted - accepted <= K
    assert tokens - steps - accepted in (0, -1)  # -1: the last step stopped among its drafts
    assert (tau, k) == (f"{tokens / steps:.2f}", f"{proposed / steps:.2f}")
    return tokens, steps


def test_the_page_marks_each_token_as_an_accepted_draft_or_the_targets(ngram: Served) -> None:
    """A verification step emits its accepted drafts, then one token of the target's: so the page shows one
    target span per step (the last step may end inside its drafts, at max_tokens), and drafted spans between."""
    answer = _answer(ngram, REPEATING)
    tokens, steps = _check_against_server(ngram, answer, REPEATING)
    assert answer.accepted > 0 and answer.spans("drafted")  # the prompt repeats itself: n-gram drafts are right
    assert steps - 1 <= len(answer.spans("target")) <= steps < tokens
    assert all(answer.spans("target")) and all(answer.spans("drafted"))


def test_a_setting_changes_the_next_answer(ngram: Served) -> None:
    ngram.tab.uncheck("#speculation")  # the next request asks for no speculation
    answer = _answer(ngram, REPEATING)
    assert answer.proposed == 0 and not answer.spans("drafted")
    assert " tau 1.00, mean k 0.00, 0 of 0 drafts accepted" in answer.meta
    ngram.tab.check("#speculation")


def test_a_refused_request_shows_the_servers_error(ngram: Served) -> None:
    tab = ngram.tab
    tab.fill("#input", "word " * 2000)  # far beyond the 1024-token context
    tab.press("#input", "Enter")
    tab.wait_for_function("document.getElementById('error').textContent.length > 0", timeout=30_000)
    assert "context is 1024 tokens" in tab.inner_text("#error")
    tab.wait_for_function("document.getElementById('stats').textContent.includes('tau')", timeout=30_000)


@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_the_page_shows_a_draft_models_and_eagles_accepted_drafts(browser: Any, ngram: Served, method: str) -> None:
    with _served(browser, method, ngram.live.engine.loaded) as served:
        answer = _answer(served, REPEATING)
        _check_against_server(served, answer, REPEATING)
    assert answer.accepted > 0 and answer.spans("drafted") and answer.spans("target")


def test_without_speculation_and_through_a_lost_connection(browser: Any, ngram: Served) -> None:
    """A server without speculation: every token is the target's. Then the server goes away: the page says so
    and keeps retrying, a message sent meanwhile is given back, and once the server is back the page answers."""
    engine = _engine("off", ngram.live.engine.loaded)
    with live_server(engine, MODEL) as live:
        served = Served(_open(browser, live), live)
        answer = _answer(served, "Say hello.")
        tokens, steps = _check_against_server(served, answer, "Say hello.")
        assert tokens == steps and not answer.spans("drafted") and answer.meta.endswith("0 of 0 drafts accepted")
    tab = served.tab
    tab.wait_for_function("document.getElementById('error').textContent.includes('connection to the server was lost')",
                          timeout=30_000)
    assert "cannot be reached" in tab.inner_text("#model")
    tab.fill("#input", "Say hello again.")
    tab.press("#input", "Enter")
    tab.wait_for_function("document.getElementById('input').value === 'Say hello again.'", timeout=30_000)
    assert tab.locator(".msg.user").count() == 1  # the unsent message is not in the conversation
    with live_server(engine, MODEL, port=int(live.url.rsplit(":", 1)[1])) as again:
        served = Served(tab, again)
        tab.wait_for_function("document.getElementById('error').textContent === ''", timeout=30_000)
        _wait_connected(tab)
        assert _answer(served, "Say hello again.").text
    tab.close()
