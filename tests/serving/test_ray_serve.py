"""turbospec on Ray Serve: two replicas of smollm2-135m behind one OpenAI-compatible endpoint, on a local Ray
cluster, driven by the official `openai` client; plus the router, hint and metrics-merge logic without Ray.

float32 keeps greedy decoding free of the bf16 near-ties that batching changes, so results through Ray can be
compared token for token with offline `LLM.generate`.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
import ray
from live_server import free_port
from ray import serve

from turbospec import LLM, SamplingParams
from turbospec.server.ray_bridge import Forwarded, merge_metrics, route_hint
from turbospec.server.ray_router import KEEP_DONE_S, PREFIX_CHARS, RouteHint, TokenAwareRouter, prefix_digest
from turbospec.server.ray_serve import APP_NAME, OpenAIIngress, RayServeOptions, _runtime_env, application

pytestmark = pytest.mark.timeout(400)  # a cluster that cannot start fails, never hangs CI

MODEL = "smollm2-135m"
ENGINE = {"dtype": "float32", "num_threads": 1, "max_model_len": 512, "max_num_seqs": 8}
REPLICA = "TurboSpecReplica"


# --- without Ray: routing, hints, metrics -----------------------------------------------------------------------

@dataclass(frozen=True)
class _ReplicaID:
    unique_id: str


def _replica(uid: str, outstanding: int = 0, as_of: float = 0.0) -> Any:
    return SimpleNamespace(replica_id=_ReplicaID(uid),
                           routing_stats={"outstanding_tokens": outstanding, "time": as_of})


def _router(mode: str, imbalance: int = 100) -> TokenAwareRouter:
    router = TokenAwareRouter.__new__(TokenAwareRouter)  # the routing logic only: no Ray Serve router state
    router.initialize_state(mode=mode, imbalance_tokens=imbalance)
    return router


def _request(hint: RouteHint, request_id: str | None = None) -> Any:
    return SimpleNamespace(kwargs={"hint": hint}, routing_context=SimpleNamespace(should_backoff=False),
                           metadata=SimpleNamespace(internal_request_id=request_id or str(time.monotonic_ns())))


def _choose(router: TokenAwareRouter, replicas: list[Any], hint: RouteHint) -> list[str]:
    ranks = asyncio.run(router.choose_replicas(replicas, _request(hint)))
    return [r.replica_id.unique_id for rank in ranks for r in rank]


def test_fewest_tokens_counts_its_own_requests_at_once_and_other_callers_from_the_reports() -> None:
    router = _router("fewest-tokens")
    t0 = time.time()
    a, b = _replica("a", 500, as_of=t0), _replica("b", 200, as_of=t0)
    assert _choose(router, [a, b], RouteHint(cost=10)) == ["b", "a"]  # b: 200 reported + 10 just sent
    for i in range(2):  # two more sent to b since its report: 210 + 2 * 300 > 500
        router.on_request_routed(_request(RouteHint(cost=300), f"r{i}"), b.replica_id, None)
    assert _choose(router, [a, b], RouteHint(cost=10)) == ["a", "b"]
    router.on_request_completed(b.replica_id, "r0")
    router.on_request_completed(b.replica_id, "r1")
    assert router.load(b) == 210 and router.load(a) == 510

    # a report that still counts this router's finished request is not load: its share at report time is taken off
    router = _router("fewest-tokens")
    router.on_request_routed(_request(RouteHint(cost=300), "x"), b.replica_id, None)
    b = _replica("b", 300, as_of=time.time())
    router.on_request_completed(b.replica_id, "x")
    assert router.load(b) == 0

    # Ray Serve reports where a request went after awaiting the replica's acceptance: a fast answer (a 400 under
    # load) may have completed by then, and must not come back as load (CI: a burst then all went to the other)
    router = _router("fewest-tokens")
    a, b = _replica("a"), _replica("b")
    quick = _request(RouteHint(cost=258), "quick")
    ranks = asyncio.run(router.choose_replicas([a, b], quick))
    first = ranks[0][0].replica_id
    router.on_request_completed(first, "quick")
    router.on_request_routed(quick, first, None)
    router.on_request_completed(b.replica_id, "untracked")  # completed before any routing callback
    router.on_request_routed(_request(RouteHint(cost=99), "untracked"), b.replica_id, None)
    assert router.load(a) == 0 and router.load(b) == 0
    # a retry keeps the request id: the first try's late completion (from a) does not finish the retry (on b)
    retry = _request(RouteHint(cost=40), "retry")
    router.on_request_routed(retry, a.replica_id, None)
    asyncio.run(router.choose_replicas([a, b], retry))  # the retry's guess, before the first try's completion
    router.on_request_completed(a.replica_id, "retry")
    router.on_request_routed(retry, b.replica_id, None)
    assert router.load(a) == 0 and router.load(b) == 40
    router.on_request_completed(b.replica_id, "retry")
    # a guess whose caller went away while Ray Serve still queued it gets no callback: it lapses
    asyncio.run(router.choose_replicas([a, b], _request(RouteHint(cost=70), "gone")))
    assert router.load(a) + router.load(b) == 70
    router._sent["gone"].sent -= KEEP_DONE_S + 1
    asyncio.run(router.choose_replicas([a, b], _request(RouteHint(cost=5), "next")))
    assert sorted([router.load(a), router.load(b)]) == [0, 5]

    # a burst with equal loads alternates: each choice counts before the next is made
    router = _router("fewest-tokens")
    a, b = _replica("a"), _replica("b")
    firsts = [_choose(router, [a, b], RouteHint(cost=50))[0] for _ in range(6)]
    assert sorted(firsts) == ["a"] * 3 + ["b"] * 3


def test_prefix_routing_keeps_a_prefix_on_one_replica_until_it_is_too_loaded() -> None:
    router = _router("prefix", imbalance=100)
    replicas = [_replica(uid) for uid in "abcd"]
    homes = {p: _choose(router, replicas, RouteHint(prefix=prefix_digest(f"system prompt {p}")))[0] for p in range(40)}
    assert len(set(homes.values())) > 1  # prefixes spread over replicas
    assert all(_choose(router, replicas, RouteHint(prefix=prefix_digest(f"system prompt {p}")))[0] == home
               for p, home in homes.items())  # and each stays home
    home = homes[0]
    loaded = [_replica(r.replica_id.unique_id, 1000 if r.replica_id.unique_id == home else 0) for r in replicas]
    assert _choose(router, loaded, RouteHint(prefix=prefix_digest("system prompt 0")))[0] != home
    # one replica gone: only its prefixes move
    survivors = [r for r in replicas if r.replica_id.unique_id != "a"]
    moved = [p for p, h in homes.items()
             if _choose(router, survivors, RouteHint(prefix=prefix_digest(f"system prompt {p}")))[0] != h]
    assert all(homes[p] == "a" for p in moved)


def test_a_targeted_request_goes_to_its_replica_only_and_pow2_picks_two() -> None:
    replicas = [_replica(uid) for uid in "abc"]
    assert _choose(_router("pow2"), replicas, RouteHint(target="c")) == ["c"]
    assert _choose(_router("pow2"), replicas, RouteHint(target="gone")) == []
    picked = _choose(_router("pow2"), replicas, RouteHint())
    assert len(picked) == 2 and len(set(picked)) == 2


def test_route_hint_reads_completion_and_chat_bodies() -> None:
    chat = Forwarded("POST", "/v1/chat/completions", body=b'{"messages": [{"role": "user", "content": "'
                     + b"x" * 400 + b'"}], "max_tokens": 10, "n": 2}')
    hint = route_hint(chat)
    assert hint.cost == (len("user: " + "x" * 400 + "\n") // 4 + 10) * 2
    assert hint.prefix == prefix_digest(("user: " + "x" * 400)[:PREFIX_CHARS])
    assert route_hint(Forwarded("POST", "/v1/completions", body=b'{"prompt": "hi"}')).cost == 256
    assert route_hint(Forwarded("POST", "/v1/completions", body=b"not json")) == RouteHint()
    assert route_hint(Forwarded("GET", "/v1/models")) == RouteHint()


def test_merge_metrics_labels_each_replica_and_keeps_families_together() -> None:
    text = ('# HELP t:requests Requests\n# TYPE t:requests counter\nt:requests{model_name="m"} {n}\n'
            '# HELP t:up Up\n# TYPE t:up gauge\nt:up 1.0\n')
    merged = merge_metrics({"r1": text.replace("{n}", "3.0"), "r2": text.replace("{n}", "5.0")})
    assert merged.splitlines() == [
        "# HELP t:requests Requests", "# TYPE t:requests counter",
        't:requests{replica="r1",model_name="m"} 3.0', 't:requests{replica="r2",model_name="m"} 5.0',
        "# HELP t:up Up", "# TYPE t:up gauge", 't:up{replica="r1"} 1.0', 't:up{replica="r2"} 1.0']


def test_options_from_serve_run_arguments() -> None:
    opts = RayServeOptions.from_args({"model": MODEL, "num_replicas": "2", "routing": "prefix", "dtype": "float32",
                                      "num_threads": "1", "min_replicas": "none", "max_model_len": "512"})
    assert (opts.num_replicas, opts.routing, opts.min_replicas) == (2, "prefix", None)
    assert opts.engine == {"dtype": "float32", "num_threads": 1, "max_model_len": 512}
    # without num_threads, the replicas share this machine's cores
    opts = RayServeOptions.from_args({"model": MODEL, "min_replicas": "1", "max_replicas": "64"})
    assert opts.engine == {"num_threads": 1} and opts.min_replicas == 1 and opts.max_replicas == 64
    for bad in ({"model": MODEL, "routing": "random"}, {"model": MODEL, "min_replicas": "1"},
                {"model": MODEL, "num_threads": "two"}, {"model": MODEL, "bogus": "1"}, {"num_replicas": "2"},
                {"model": MODEL, "dtype": "int3"}):
        with pytest.raises(ValueError):
            RayServeOptions.from_args(bad)


class _FakeStream:
    """A replica's streamed answer: its messages, then `error` (a dead actor) if given."""

    def __init__(self, messages: list[tuple[Any, ...]], error: Exception | None = None) -> None:
        self.messages, self.error, self.cancelled = list(messages), error, False

    def __aiter__(self) -> _FakeStream:
        return self

    async def __anext__(self) -> tuple[Any, ...]:
        if self.messages:
            return self.messages.pop(0)
        if self.error is not None:
            raise self.error
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


class _FakeHandle:
    def __init__(self, *streams: _FakeStream) -> None:
        self.streams = list(streams)

    def options(self, **_: Any) -> _FakeHandle:
        return self

    def remote(self, *args: Any, **kwargs: Any) -> _FakeStream:
        self.sent = (args, kwargs)
        return self.streams.pop(0)


def _ingress(handle: _FakeHandle, retries: int = 1) -> Any:
    ingress = OpenAIIngress.func_or_class.__new__(OpenAIIngress.func_or_class)
    ingress.replicas, ingress.retries, ingress.failovers, ingress.unavailable = handle, retries, 0, 0
    return ingress


def _body(response: Any) -> bytes:
    async def collect() -> bytes:
        return b"".join([chunk async for chunk in response.body_iterator])

    return asyncio.run(collect())


JSON = [("content-type", "application/json")]
SSE = [("content-type", "text/event-stream; charset=utf-8")]


def test_ingress_moves_a_request_whose_replica_died_and_answers_503_when_none_is_left() -> None:
    dead = ray.exceptions.ActorDiedError()
    req = Forwarded("POST", "/v1/completions", body=b"{}")
    ok = _FakeStream([("start", 200, JSON), ("body", b'{"choices": []}')])
    ingress = _ingress(_FakeHandle(_FakeStream([], dead), ok))
    response = asyncio.run(ingress.forward(req, RouteHint()))
    assert (response.status_code, response.body, ingress.failovers) == (200, b'{"choices": []}', 1)

    # died after its status line but before the body was complete: still nothing sent, still moved
    ingress = _ingress(_FakeHandle(_FakeStream([("start", 200, JSON)], dead), _FakeStream([], dead)))
    response = asyncio.run(ingress.forward(req, RouteHint()))
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    error = json.loads(response.body)["error"]
    assert error["code"] == "replica_unavailable" and "retry" in error["message"]


def test_ingress_forwards_the_app_path_under_a_route_prefix() -> None:
    from starlette.requests import Request

    handle = _FakeHandle(_FakeStream([("start", 200, JSON), ("body", b"{}")]))
    body = b'{"prompt": "hi", "max_tokens": 3}'

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/p/v1/completions", "root_path": "/p", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"authorization", b"Bearer x")]}
    response = asyncio.run(_ingress(handle).__call__(Request(scope, receive)))
    assert response.status_code == 200
    (req,), kwargs = handle.sent
    assert (req.path, req.body, req.headers) == ("/v1/completions", body, [("content-type", "application/json")])
    assert kwargs["hint"].cost == 3 and kwargs["hint"].prefix == prefix_digest("hi")


def test_ingress_ends_a_stream_cut_by_a_dead_replica_with_an_error_event() -> None:
    stream = _FakeStream([("start", 200, SSE), ("body", b"data: {}\n\n"), ("body", b"data: {}\n\n")],
                         ray.exceptions.ActorDiedError())
    response = asyncio.run(_ingress(_FakeHandle(stream)).forward(Forwarded("POST", "/v1/completions"), RouteHint()))
    assert response.status_code == 200
    events = [line[len("data: "):] for line in _body(response).decode().splitlines() if line]
    assert events[:2] == ["{}", "{}"] and events[-1] == "[DONE]"
    assert json.loads(events[2])["error"]["code"] == "replica_failed"
    assert stream.cancelled


# --- on a local Ray cluster -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    ray.init(address="local", num_cpus=4, include_dashboard=False, runtime_env=_runtime_env())
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        opts = RayServeOptions(MODEL, num_replicas=2, engine=ENGINE, health_check_period_s=1.0)
        serve.run(application(opts), name=APP_NAME, route_prefix="/")  # returns once every replica is up
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def client(endpoint: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=endpoint + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(endpoint: str) -> LLM:
    return LLM(MODEL, progress=False, **ENGINE)


def replica_counts(endpoint: str, name: str = "turbospec:request_success_total") -> dict[str, float]:
    """Per replica label, the sum of one metric's series in the merged scrape."""
    counts: dict[str, float] = {}
    for line in httpx.get(endpoint + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{"):
            replica = re.search(r'replica="([^"]+)"', line)
            assert replica is not None, line
            counts[replica.group(1)] = counts.get(replica.group(1), 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def replica_actors() -> dict[str, str]:
    """The live replica actors of the replica deployment: unique id -> actor name."""
    actors = ray.util.list_named_actors(all_namespaces=True)
    prefix = f"SERVE_REPLICA::{APP_NAME}#{REPLICA}#"
    return {a["name"][len(prefix):]: a["name"] for a in actors if a["name"].startswith(prefix)}


def running_replicas() -> dict[str, int]:
    return dict(serve.status().applications[APP_NAME].deployments[REPLICA].replica_states)


@pytest.mark.slow
def test_greedy_completions_and_chat_through_ray_match_offline(client: openai.OpenAI, offline: LLM,
                                                               endpoint: str) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(endpoint + "/health").json() == {"status": "ok"}
    prompt = "The three primary colors are"
    want = offline.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)[0].outputs[0]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert got.choices[0].text == want.text and got.usage.completion_tokens == len(want.token_ids)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True))
    assert streamed == want.text

    messages = [{"role": "user", "content": "Name a fruit."}]
    want_chat = offline.chat(messages, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)[0].outputs[0]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert chat.choices[0].message.content == want_chat.text
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want_chat.text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(want_chat.token_ids)


@pytest.mark.slow
def test_bad_input_gets_an_openai_400_through_ray(client: openai.OpenAI, endpoint: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_body={"bogus": 1})
    assert err.value.status_code == 400
    body = httpx.post(endpoint + "/v1/chat/completions", timeout=30,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": "0.5"})
    assert body.status_code == 400
    assert body.json()["error"]["param"] == "temperature" and body.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=4)


@pytest.mark.slow
def test_concurrent_requests_spread_over_both_replicas_and_metrics_show_both(client: openai.OpenAI,
                                                                              endpoint: str) -> None:
    before = replica_counts(endpoint)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: client.completions.create(
            model=MODEL, prompt=f"Count to {i}:", max_tokens=12, temperature=0), range(8)))
    assert all(r.choices[0].finish_reason in ("length", "stop") for r in results)
    after = replica_counts(endpoint)
    assert set(after) == set(replica_actors()) and len(after) == 2
    assert all(after[r] - before.get(r, 0.0) > 0 for r in after), (before, after)
    text = httpx.get(endpoint + "/metrics", timeout=30).text
    assert text.count("# TYPE turbospec:request_success_total counter") == 1
    assert "turbospec:ray_replicas 2" in text


@pytest.mark.slow
def test_a_client_that_leaves_a_stream_frees_its_request_on_the_replica(endpoint: str) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", endpoint + "/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert sum(replica_counts(endpoint, "turbospec:num_requests_running").values()) == 1
    deadline = time.monotonic() + 20  # closed after one chunk: the replica aborts it long before 400 tokens
    while sum(replica_counts(endpoint, "turbospec:num_requests_running").values()) > 0:
        assert time.monotonic() < deadline, "the abandoned stream still runs"
        time.sleep(0.2)
    aborted = httpx.get(endpoint + "/metrics", timeout=30).text
    assert 'finished_reason="abort"' in aborted


@pytest.mark.slow
def test_a_replica_killed_under_load_loses_no_request_silently_and_is_replaced(client: openai.OpenAI,
                                                                              endpoint: str) -> None:
    original = replica_actors()
    assert len(original) == 2
    max_tokens = 48

    def one(i: int) -> tuple[str, Any]:
        kwargs: dict[str, Any] = dict(model=MODEL, max_tokens=max_tokens, temperature=0,
                                      extra_body={"ignore_eos": True})
        try:
            if i % 2:  # a stream
                chunks = list(client.chat.completions.create(
                    messages=[{"role": "user", "content": f"Tell a story number {i}."}], stream=True,
                    stream_options={"include_usage": True}, **kwargs))
                return "ok", (chunks[-1].usage.completion_tokens, [c.choices[0].finish_reason for c in chunks
                                                                   if c.choices and c.choices[0].finish_reason])
            out = client.completions.create(prompt=f"Story number {i}:", **kwargs)
            return "ok", (out.usage.completion_tokens, [out.choices[0].finish_reason])
        except openai.APIStatusError as exc:
            return "status", exc
        except openai.APIError as exc:  # an error event in a stream
            return "stream-error", exc

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(8)]
        time.sleep(3.0)  # every request routed and generating
        victim = sorted(original)[0]
        ray.kill(ray.get_actor(original[victim], namespace="serve"), no_restart=True)
        results = [f.result(timeout=150) for f in futures]  # none hangs

    outcomes = [kind for kind, _ in results]
    print(f"killed {victim}: outcomes {outcomes}")
    for kind, value in results:
        if kind == "ok":  # completed in full: no truncated or garbled answer
            assert value == (max_tokens, ["length"]), value
        elif kind == "status":  # a retryable error with an OpenAI body
            assert value.status_code >= 500, value
            assert value.response.json()["error"]["message"]
            if value.status_code == 503:
                assert value.response.headers.get("retry-after") == "1"
        else:
            assert "retry" in str(value), value
    assert outcomes.count("ok") >= 4, results  # the surviving replica's, and the moved non-streams

    deadline = time.monotonic() + 120
    while not (running_replicas() == {"RUNNING": 2} and len(replica_actors()) == 2
               and victim not in replica_actors()):
        assert time.monotonic() < deadline, (running_replicas(), replica_actors())
        time.sleep(1.0)
    with ThreadPoolExecutor(4) as pool:
        after = list(pool.map(lambda i: client.completions.create(model=MODEL, prompt=f"After {i}", max_tokens=4),
                              range(4)))
    assert all(r.usage.completion_tokens == 4 for r in after)
    assert set(replica_counts(endpoint, "turbospec:num_requests_running")) == set(replica_actors())


@pytest.mark.parametrize("flags", [["--min-replicas", "1"], ["--num-replicas", "0"], ["--min-replicas", "3",
                                   "--max-replicas", "2"], ["--dtype", "int3"]])
def test_serve_ray_refuses_bad_flags_with_exit_2(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from turbospec.cli import main

    capsys.readouterr()  # a running Ray driver prints its workers' log lines here at any moment
    assert main(["serve", "--model", MODEL, "--ray", *flags]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("turbospec: error: ")]
    assert len(errors) == 1, errors
    with pytest.raises(SystemExit):
        main(["serve", "--model", MODEL, "--ray", "--routing", "random"])
