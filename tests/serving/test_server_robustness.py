"""The server under hostile or unlucky conditions: fuzzed bodies, overload, failing requests, a failing engine
step, SIGTERM. A dummy-weight model (`dummy:tiny`, byte tokenizer) keeps each request cheap; what is tested
is the serving layer, which does not care whether the weights are trained."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from live_server import LiveServer, live_server, serve_process

from turbospec.cli import main
from turbospec.config import EngineConfig
from turbospec.engine import LLMEngine
from turbospec.server.guards import GuardConfig, host_names_for
from turbospec.tuning import build_engine

MODEL = "tiny"
ENGINE = {"num_threads": 1, "max_model_len": 64}


def tiny_engine() -> LLMEngine:
    return build_engine(EngineConfig("dummy:tiny", **ENGINE), progress=False)


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server(tiny_engine(), MODEL) as live:
        yield live


def greedy(server: LiveServer, prompt: str = "hello", **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=60)


# --- fuzzing against the OpenAPI schema ---------------------------------------------------------------------------

def _body_fields(schema: dict[str, Any], path: str) -> list[str]:
    ref = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return sorted(schema["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"])


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) |
    st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12,
)
# values a field of the right kind might plausibly hold, so that fuzzing also reaches the deeper checks
NEAR_MISS = st.sampled_from([0, 1, -1, 2, 8, 64, 10**6, 0.0, 0.5, 1.5, -0.1, "", "x", "hello", [], [1, 2], [""],
                             ["a", "b"], [[1, 2]], {}, {"include_usage": True}, {"type": "text"}, True, False, None,
                             [{"role": "user", "content": "hi"}], [{"role": "user"}], [{"role": "bot", "content": 1}]])
POST_PATHS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
VALID_BODIES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"model": MODEL, "prompt": "hello", "max_tokens": 4},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/tokenize": {"prompt": "hello"},
    "/detokenize": {"tokens": [104, 105]},
}


def test_fuzzed_requests_never_break_the_server(server: LiveServer) -> None:
    schema = httpx.get(server.url + "/openapi.json").json()
    fields = {path: _body_fields(schema, path) for path in POST_PATHS}
    reference = greedy(server).json()["choices"][0]["text"]
    statuses: dict[int, int] = {}
    client = httpx.Client(base_url=server.url, timeout=60)

    @st.composite
    def bodies(draw: st.DrawFn) -> tuple[str, bytes]:
        path = draw(st.sampled_from(POST_PATHS))
        if draw(st.integers(0, 9)) == 0:  # raw bytes: broken JSON, wrong encodings, empty bodies
            return path, draw(st.binary(max_size=64))
        keys = draw(st.lists(st.sampled_from(fields[path]) | st.text(max_size=8), max_size=6, unique=True))
        if draw(st.integers(0, 4)) == 0:  # a valid body with one fuzzed field on top: accepted requests surely occur
            body = {**VALID_BODIES[path], **{k: draw(NEAR_MISS | JSON_VALUES) for k in keys[:1]}}
        else:
            body = {k: draw(NEAR_MISS | JSON_VALUES) for k in keys}
        return path, json.dumps(body).encode()

    @settings(max_examples=2000, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(bodies())
    def one(case: tuple[str, bytes]) -> None:
        path, content = case
        r = client.post(path, content=content, headers={"Content-Type": "application/json"})
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code in (200, 400, 404), (path, content, r.status_code, r.text)
        if r.status_code != 200:
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
        elif r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.rstrip().endswith("data: [DONE]")

    one()
    client.close()
    assert statuses.get(400, 0) > 1000 and statuses.get(200, 0) > 0, statuses  # both paths were exercised
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert greedy(server).json()["choices"][0]["text"] == reference
    assert not server.engine.requests and server.engine.blocks.usage() == 0


# --- overload, failures ----------------------------------------------------------------------------------------------

def test_queue_limit_answers_503_then_recovers() -> None:
    engine = tiny_engine()
    gate = threading.Event()
    step = engine.step

    def gated_step():  # hold the engine so that the first two requests are surely still pending
        gate.wait(30)
        return step()

    engine.step = gated_step  # type: ignore[method-assign]
    with live_server(engine, MODEL, max_pending=2) as live:
        body = {"model": MODEL, "prompt": "a", "max_tokens": 8, "temperature": 0}

        async def run() -> tuple[list[httpx.Response], httpx.Response]:
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as c:
                held = [asyncio.create_task(c.post("/v1/completions", json=body)) for _ in range(2)]
                while len(engine.requests) < 2:
                    await asyncio.sleep(0.005)
                third = await c.post("/v1/completions", json=body)
                gate.set()
                return list(await asyncio.gather(*held)), third

        held, third = asyncio.run(run())
        assert third.status_code == 503 and third.headers["retry-after"] == "1"
        assert third.json()["error"]["code"] == "server_overloaded"
        assert [r.status_code for r in held] == [200, 200]
        assert greedy(live).status_code == 200


def _stream_ends_cleanly(text: str) -> bool:
    """A stream ends with [DONE] (after its chunks, or after an error event): never just stops."""
    events = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    return bool(events) and events[-1] == "[DONE]"


def test_a_burst_over_the_pending_limit_gets_503s_never_500s_or_cut_streams() -> None:
    """Ten requests at once (half streaming) against a limit of 2: a burst is admitted seat by seat, so each
    request either completes or gets 503 with Retry-After, and every 200 stream ends with [DONE]."""
    with live_server(tiny_engine(), MODEL, max_pending=2) as live:
        reference = greedy(live, "burst").json()["choices"][0]["text"]

        async def one(c: httpx.AsyncClient, stream: bool) -> httpx.Response:
            body = {"model": MODEL, "prompt": "burst", "max_tokens": 8, "temperature": 0, "stream": stream}
            return await c.post("/v1/completions", json=body)

        async def run() -> list[tuple[bool, httpx.Response]]:
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as c:
                kinds = [i % 2 == 0 for i in range(10)]
                return list(zip(kinds, await asyncio.gather(*(one(c, k) for k in kinds))))

        results = asyncio.run(run())
        assert {r.status_code for _, r in results} <= {200, 503}, [r.text for _, r in results]
        ok = [(stream, r) for stream, r in results if r.status_code == 200]
        assert ok, "the limit admits two requests at a time: some must complete"
        for stream, r in ok:
            if stream:
                assert _stream_ends_cleanly(r.text) and "error" not in r.text, r.text
            else:
                assert r.json()["choices"][0]["text"] == reference
        for _, r in results:
            if r.status_code == 503:
                assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "server_overloaded"
        assert not live.engine.requests and live.engine.blocks.usage() == 0  # nothing left behind
        assert greedy(live, "burst").json()["choices"][0]["text"] == reference


def test_two_hundred_at_once_on_a_small_kv_cache_complete_or_get_503() -> None:
    """200 concurrent requests, 64 admitted at a time, a KV cache of 16 blocks (requests preempt each other): each
    completes with the text it gets alone (batch-invariant, so batching cannot change a token) or is refused with
    503 and Retry-After, and the process's memory stays bounded."""
    import resource

    block_bytes = 2 * 2 * 16 * 32 * 4  # K and V, 2 layers, 16 slots, 2 KV heads x 16, float32
    config = EngineConfig("dummy:tiny", num_threads=1, max_model_len=64, dtype="float32",
                          deterministic="batch-invariant", kv_cache_memory_gib=16 * block_bytes / 2**30)
    with live_server(build_engine(config, progress=False), MODEL, max_pending=64) as live:
        prompts = [f"request {i % 7}" for i in range(200)]
        alone = {p: greedy(live, p).json()["choices"][0]["text"] for p in set(prompts)}
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

        async def run() -> list[httpx.Response]:
            limits = httpx.Limits(max_connections=200)
            async with httpx.AsyncClient(base_url=live.url, timeout=120, limits=limits) as c:
                return list(await asyncio.gather(*(c.post("/v1/completions", json={
                    "model": MODEL, "prompt": p, "max_tokens": 8, "temperature": 0}) for p in prompts)))

        answers = asyncio.run(run())
        grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
        done = [(p, r) for p, r in zip(prompts, answers) if r.status_code == 200]
        refused = [r for r in answers if r.status_code == 503]
        assert len(done) + len(refused) == 200, sorted({r.status_code for r in answers})
        assert done and all(r.json()["choices"][0]["text"] == alone[p] for p, r in done)
        assert all(r.headers["retry-after"] == "1" for r in refused)
        assert grown_mib < 512, f"peak resident memory grew {grown_mib:.0f} MiB"
        assert not live.engine.requests and live.engine.blocks.usage() == 0


def test_a_request_larger_than_the_limit_is_a_400_not_a_retry() -> None:
    with live_server(tiny_engine(), MODEL, max_pending=4) as live:
        many = httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": ["a"] * 5, "max_tokens": 2},
                          timeout=60)
        fanned = httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": ["a", "b"], "n": 3,
                                                                 "max_tokens": 2, "temperature": 1.0}, timeout=60)
        for r, asked in ((many, 5), (fanned, 6)):
            assert r.status_code == 400 and "retry-after" not in r.headers, r.text
            assert f"asks for {asked} completions" in r.json()["error"]["message"]
        assert greedy(live).status_code == 200


@pytest.mark.parametrize("prompt", ['"\\ud800 lone surrogate"', "[18446744073709551616]", "[[-5, 3]]",
                                    "[9223372036854775808]"])
def test_bad_prompts_are_told_in_the_clients_terms(server: LiveServer, prompt: str) -> None:
    """400 with what was wrong, never a 500 or a Python exception's name in the body."""
    body = '{"model": "%s", "max_tokens": 2, "prompt": %s}' % (MODEL, prompt)
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "prompt" in message and not any(word in message for word in ("Error", "Traceback", "Union["))


def test_a_loopback_server_answers_only_loopback_host_names() -> None:
    """A page on another site can point its own name at 127.0.0.1 (DNS rebinding) and read a local server's
    answers, unless the server refuses Host names that are not its own."""
    with live_server(tiny_engine(), MODEL, guard=GuardConfig(host_names=host_names_for("127.0.0.1"))) as live:
        port = live.url.rsplit(":", 1)[1]
        assert httpx.get(live.url + "/health").status_code == 200  # Host: 127.0.0.1:<port>
        for name in (f"localhost:{port}", "localhost", f"[::1]:{port}"):
            assert httpx.get(live.url + "/v1/models", headers={"Host": name}).status_code == 200, name
        evil = httpx.post(live.url + "/v1/completions", headers={"Host": f"attacker.example:{port}"},
                          json={"model": MODEL, "prompt": "a", "max_tokens": 2})
        assert evil.status_code == 400 and "Host header 'attacker.example'" in evil.json()["error"]["message"]
    assert host_names_for("0.0.0.0") is None  # a server opened up on purpose answers any name


def test_an_api_key_guards_every_route_but_health() -> None:
    from openai import AuthenticationError, OpenAI

    key = "sk-test-0123456789"
    for public in (False, True):
        with live_server(tiny_engine(), MODEL, guard=GuardConfig(api_key=key, metrics_public=public)) as live:
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize")):
                for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
                    r = httpx.request(method, live.url + path, headers=auth, json={"model": MODEL, "prompt": "a"})
                    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, auth)
                    assert r.headers["www-authenticate"] == "Bearer"
            assert httpx.get(live.url + "/health").status_code == 200 and httpx.get(live.url + "/").status_code == 200
            assert httpx.get(live.url + "/stats").status_code == 401  # the page's numbers need the key
            metrics = httpx.get(live.url + "/metrics")
            assert metrics.status_code == (200 if public else 401)
            client = OpenAI(base_url=live.v1, api_key=key)
            assert client.completions.create(model=MODEL, prompt="a", max_tokens=2).choices[0].text is not None
            with pytest.raises(AuthenticationError):
                OpenAI(base_url=live.v1, api_key="sk-wrong").models.list()


def test_a_huge_body_is_refused_unread_and_never_stalls_other_clients() -> None:
    """A 5 MB prompt (far beyond a 64-token context) is refused with 413 before it is read or tokenised, and
    /health keeps answering within 0.5 s meanwhile."""
    with live_server(tiny_engine(), MODEL) as live:
        huge = {"model": MODEL, "prompt": "word " * 1_000_000, "max_tokens": 2}
        latencies: list[float] = []

        async def run() -> httpx.Response:
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as c:
                task = asyncio.create_task(c.post("/v1/completions", json=huge))
                while not task.done():
                    start = time.perf_counter()
                    assert (await c.get("/health")).status_code == 200
                    latencies.append(time.perf_counter() - start)
                    await asyncio.sleep(0.02)
                return await task

        refused = asyncio.run(run())
        assert refused.status_code == 413 and "bytes" in refused.json()["error"]["message"]
        assert latencies and max(latencies) < 0.5, latencies
        assert greedy(live).status_code == 200


def test_a_body_shorter_than_its_content_length_times_out_with_408() -> None:
    import socket

    with live_server(tiny_engine(), MODEL, guard=GuardConfig(read_timeout_s=1.0)) as live:
        host, port = live.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"model\"")
            start = time.monotonic()
            answer = sock.recv(4096).decode()
        assert answer.startswith("HTTP/1.1 408") and "did not arrive" in answer
        assert time.monotonic() - start < 5
        assert greedy(live).status_code == 200

def test_one_failing_request_fails_alone(server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = server.engine
    reference = greedy(server, "fine").json()["choices"][0]["text"]
    original = engine.emitter.append

    def append_or_fail(req, tokens, now, *rest):  # the seed marks the request to break: a tokenizer bug's stand-in
        if req.params.seed == 666:
            raise RuntimeError("detokenizer exploded")
        return original(req, tokens, now, *rest)

    monkeypatch.setattr(engine.emitter, "append", append_or_fail)
    bad = {"model": MODEL, "prompt": "boom", "max_tokens": 8, "temperature": 1.0, "seed": 666}

    async def run() -> tuple[httpx.Response, httpx.Response, str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            good = c.post("/v1/completions", json={"model": MODEL, "prompt": "fine", "max_tokens": 8,
                                                   "temperature": 0})
            failing = c.post("/v1/completions", json=bad)
            streamed = c.post("/v1/completions", json={**bad, "stream": True})
            g, f, s = await asyncio.gather(good, failing, streamed)
            return g, f, s.text

    good, failing, streamed = asyncio.run(run())
    assert good.status_code == 200 and good.json()["choices"][0]["text"] == reference
    # the client learns that it failed, not the internals of why (the server's log has those)
    assert failing.status_code == 500 and "generation failed" in failing.json()["error"]["message"]
    assert "detokenizer exploded" not in failing.text and "RuntimeError" not in failing.text
    assert '"error"' in streamed and "generation failed" in streamed and streamed.rstrip().endswith("[DONE]")
    assert "detokenizer exploded" not in streamed
    assert not engine.requests and engine.blocks.usage() == 0


def test_a_failing_engine_step_fails_its_requests_and_serving_continues(server: LiveServer,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    runner = server.engine.runner
    original = runner.execute
    calls = {"n": 0}

    def fail_once(sched, *args):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated kernel failure")
        return original(sched, *args)

    monkeypatch.setattr(runner, "execute", fail_once)
    first = greedy(server)
    assert first.status_code == 500 and "generation failed" in first.json()["error"]["message"]
    assert "simulated kernel failure" not in first.text  # internals stay in the server's log
    assert greedy(server).status_code == 200
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


# --- the command line: flags, SIGTERM ----------------------------------------------------------------------------------

@pytest.mark.parametrize("flags", [["--port", "0"], ["--max-pending-requests", "0"], ["--max-model-len", "-3"],
                                   ["--speculative-config", "{oops"]])
def test_serve_refuses_bad_flags_with_exit_2(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", "dummy:tiny", *flags]) == 2
    assert "turbospec: error:" in capsys.readouterr().err


def test_sigterm_drains_in_flight_requests_and_exits_0() -> None:
    with serve_process("--max-model-len", "512", "--num-threads", "1") as (proc, url):
        received: list[str] = []

        def stream() -> None:
            body = {"model": "dummy:tiny", "prompt": "a", "max_tokens": 300, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                received.extend(r.iter_lines())

        reader = threading.Thread(target=stream)
        reader.start()
        while not received:
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        reader.join(timeout=30)
        assert [line for line in received if line][-1] == "data: [DONE]"  # finished, not cut
        assert '"finish_reason": "length"' in "".join(received)
    out = proc.stdout.read() if proc.stdout else ""
    assert "curl http://127.0.0.1" in out  # it printed how to call it


def test_batch_invariant_server_answers_a_request_bitwise_alike_under_any_load() -> None:
    engine = build_engine(EngineConfig("dummy:tiny", num_threads=1, max_model_len=128, deterministic="batch-invariant"),
                          progress=False)
    body = {"model": MODEL, "prompt": "needle", "max_tokens": 12, "temperature": 0, "logprobs": 3}
    with live_server(engine, MODEL) as live:
        alone = httpx.post(live.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]

        async def crowded(n: int) -> dict[str, Any]:
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as c:
                others = [c.post("/v1/completions", json={**body, "prompt": "x" * (7 * i + 1), "max_tokens": 5 + i})
                          for i in range(n)]
                results = await asyncio.gather(c.post("/v1/completions", json=body), *others)
                return results[0].json()["choices"][0]

        for n in (1, 5, 12):
            assert asyncio.run(crowded(n)) == alone  # text, token log-probs and alternatives, bit for bit


def test_a_request_can_ask_for_a_deterministic_mode(server: LiveServer, monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Any) -> None:
    """`"deterministic": "llm42"` on a default-mode server: the answer (text, log-probs, alternatives) is the
    same alone and among other requests. Modes the server cannot give are refused with 400 on that field."""
    body = {"model": MODEL, "prompt": "needle", "max_tokens": 12, "temperature": 0, "logprobs": 3,
            "deterministic": "llm42"}
    alone = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]

    async def crowded(n: int) -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            others = [c.post("/v1/completions", json={**body, "prompt": "y" * (3 * i + 1), "max_tokens": 5 + i,
                                                      "deterministic": None}) for i in range(n)]
            results = await asyncio.gather(c.post("/v1/completions", json=body), *others)
            return results[0].json()["choices"][0]

    for n in (1, 6):
        assert asyncio.run(crowded(n)) == alone
    monkeypatch.setenv("TURBOSPEC_HOME", str(tmp_path))  # no cached margin calibration for this model
    for value, words in (("batch-invariant", "engine-wide"), ("margin-gate", "calibrate-margin"),
                         ("exact", "llm42")):
        r = greedy(server, deterministic=value)
        assert r.status_code == 400, (value, r.text)
        error = r.json()["error"]
        assert error["param"] == "deterministic" and words in error["message"], error


def test_a_request_can_ask_for_a_lossy_acceptance_policy_and_the_answer_says_so() -> None:
    """`"acceptance": "typical"` on an n-gram server: the answer carries {"acceptance": {"policy", "lossless":
    false, "relaxed_tokens"}} (streams: on the last chunk); the default answer carries nothing; a policy the
    server cannot give is a 400 on that field. A server without speculation refuses every lossy policy."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    engine = build_engine(EngineConfig("dummy:tiny", **ENGINE, speculative_config=spec), progress=False)
    with live_server(engine, MODEL) as live:
        prompt = "abcabcabcabcabcabc"
        default = greedy(live, prompt).json()
        assert "acceptance" not in default
        lossy = greedy(live, prompt, acceptance="typical").json()
        meta = lossy["acceptance"]
        assert meta["policy"] == "typical" and meta["lossless"] is False and meta["relaxed_tokens"] >= 0
        with httpx.stream("POST", live.url + "/v1/chat/completions", timeout=60,
                          json={"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 6,
                                "temperature": 0, "stream": True, "acceptance": "typical"}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        finished = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
        assert len(finished) == 1 and finished[0]["acceptance"]["policy"] == "typical"
        assert all("acceptance" not in e for e in events if e not in finished)
        for value, words in (("adasd", "needs speculative method 'draft'"), ("sloppy", "exact")):
            r = greedy(live, prompt, acceptance=value)
            assert r.status_code == 400, (value, r.text)
            error = r.json()["error"]
            assert error["param"] == "acceptance" and words in error["message"], error
        r = greedy(live, prompt, acceptance="typical", deterministic="llm42")
        assert r.status_code == 400 and r.json()["error"]["param"] == "acceptance"


def test_a_server_without_speculation_refuses_lossy_policies(server: LiveServer) -> None:
    r = greedy(server, acceptance="typical")
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "acceptance" and "needs speculative decoding" in error["message"], error
    assert greedy(server, acceptance="exact").status_code == 200
