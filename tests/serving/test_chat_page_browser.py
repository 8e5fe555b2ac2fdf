"""The chat page at / in a real browser: Chromium from the distribution's packages (`make test` installs it with
apt when it can), driven by Playwright's Python API against a live server on smollm2-135m with n-gram speculation.
Skipped, saying why, only when no Chromium could be installed or started here."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
from live_server import LiveServer, live_server

from turbospec.config import EngineConfig
from turbospec.tuning import build_engine

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
REPEATING = "Repeat after me: the cat sat on the mat. the cat sat on the mat. the cat sat on the mat."


@pytest.fixture(scope="module")
def page() -> Iterator[tuple[object, LiveServer]]:
    if CHROMIUM is None:
        pytest.skip("no Chromium here: `make test` installs the distribution's chromium with apt-get, which failed")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')")
    engine = build_engine(EngineConfig("smollm2-135m", max_model_len=1024, num_threads=1,
                                       speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
                          progress=False)
    with live_server(engine, "smollm2-135m") as live, sync_api.sync_playwright() as pw:
        try:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        except Exception as exc:  # noqa: BLE001 -- a browser that cannot start here is the skip's reason
            pytest.skip(f"{CHROMIUM} did not start under Playwright: {exc}")
        tab = browser.new_page()
        tab.goto(live.url + "/")
        tab.wait_for_function("document.getElementById('model').textContent.includes('smollm2')", timeout=30_000)
        yield tab, live
        browser.close()


def _answer(tab: object, text: str) -> tuple[str, int, str]:
    """Send `text`; return the new answer's text, its highlighted (accepted-draft) spans and its summary line."""
    answers = tab.locator(".msg.assistant")
    before = answers.count()
    tab.fill("#input", text)
    tab.press("#input", "Enter")
    tab.wait_for_function(f"document.querySelectorAll('.msg.assistant').length > {before} && "
                          "document.querySelectorAll('.msg.assistant')[" + str(before) + "]"
                          ".querySelector('.meta') !== null", timeout=120_000)
    answer = answers.nth(before)
    return answer.inner_text(), answer.locator(".drafted").count(), answer.locator(".meta").inner_text()


def test_the_page_streams_answers_and_marks_accepted_drafts(page) -> None:
    tab, _ = page
    tab.fill("#temperature", "0")
    tab.fill("#max_tokens", "48")
    text, drafted, meta = _answer(tab, REPEATING)
    assert "cat" in text.lower() and "streamed steps" in meta
    assert drafted > 0 and "accepted draft tokens" in meta and not meta.startswith("0 ")


def test_a_setting_changes_the_next_answer(page) -> None:
    tab, _ = page
    tab.uncheck("#speculation")  # the next request asks for no speculation
    _, drafted, meta = _answer(tab, REPEATING)
    assert drafted == 0 and meta.endswith(" 0 accepted draft tokens")
    tab.check("#speculation")


def test_a_refused_request_shows_the_servers_error(page) -> None:
    tab, _ = page
    tab.fill("#input", "word " * 2000)  # far beyond the 1024-token context
    tab.press("#input", "Enter")
    tab.wait_for_function("document.getElementById('error').textContent.length > 0", timeout=30_000)
    assert "context is 1024 tokens" in tab.inner_text("#error")
    tab.wait_for_function("document.getElementById('stats').textContent.includes('tau')", timeout=30_000)
