"""`turbospec bench serve` client: arrivals, statistics, goodput, flag parsing, SSE parsing, the Prometheus
parser, benchmark() end to end over an httpx mock transport, and benchmark() and the CLI against a real
turbospec server (a dummy-weight model)."""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import math
import re
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from live_server import LiveServer, live_server, serve_process

from turbospec.bench import serve_bench as sb
from turbospec.bench import serve_client as sc
from turbospec.bench import serve_report as sr
from turbospec.config import EngineConfig
from turbospec.data.prompts import BenchPrompt, load_random
from turbospec.tuning import build_engine
from turbospec.server import prometheus_text as pt

# --- arrivals ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_arrival_gaps_have_mean_one_over_rate_and_cv_one_over_sqrt_burstiness(burstiness):
    rate = 8.0
    offsets = sb.arrival_offsets(100_000, rate, burstiness, np.random.default_rng(0))
    assert offsets[0] == 0.0 and np.all(np.diff(offsets) >= 0)
    gaps = np.diff(offsets)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_arrivals_infinite_rate_all_at_once_and_seeded():
    assert sb.arrival_offsets(5, math.inf, 1.0, np.random.default_rng(0)).tolist() == [0.0] * 5
    a = sb.arrival_offsets(50, 2.0, 1.0, np.random.default_rng(3))
    b = sb.arrival_offsets(50, 4.0, 1.0, np.random.default_rng(3))
    assert len(a) == 50 and np.allclose(a, 2 * b)  # same seed: same pattern, scaled by the rate
    assert len(sb.arrival_offsets(1, 2.0, 1.0, np.random.default_rng(0))) == 1


# --- statistics and goodput --------------------------------------------------------------------------------


def test_summarize_matches_numpy():
    values = [12.0, 3.5, 99.0, 7.25, 7.25, 41.0, 0.5]
    got = sr.summarize(values)
    assert got["mean"] == pytest.approx(np.mean(values))
    assert got["median"] == pytest.approx(7.25)
    assert got["p90"] == pytest.approx(np.percentile(values, 90))
    assert got["p99"] == pytest.approx(np.percentile(values, 99))
    assert sr.summarize([]) == {"mean": None, "median": None, "p90": None, "p99": None}


def record(i, success=True, ttft=None, tpot=None, e2el=None, itl=(), prompt=10, out=5, error=None):
    return sc.RequestRecord(index=i, prompt_id=f"p{i}", success=success, error=error, ttft_ms=ttft, tpot_ms=tpot,
                            e2el_ms=e2el, itl_ms=list(itl), prompt_tokens=prompt, output_tokens=out)


def test_rate_summary_counts_throughput_and_flattens_itls():
    records = [record(0, ttft=100, tpot=10, e2el=140, itl=[10, 20]),
               record(1, ttft=300, tpot=30, e2el=420, itl=[30]),
               record(2, success=False, e2el=5, out=0, error="HTTP 500: boom")]
    s = sr.rate_summary(records, duration_s=2.0, slos={})
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(5.0)  # 10 tokens / 2 s; the failure's are not counted
    assert s["total_token_throughput"] == pytest.approx(15.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(200) and s["e2el_ms"]["p99"] == pytest.approx(
        np.percentile([140, 420], 99))
    assert s["itl_ms"]["mean"] == pytest.approx(20)  # over all gaps, not per request
    assert s["errors"] == {"HTTP 500: boom": 1}
    assert s["request_goodput"] is None


def test_goodput_counts_requests_meeting_every_slo():
    slos = {"ttft": 200.0, "tpot": 50.0}
    records = [record(0, ttft=150, tpot=40, e2el=1000),   # meets both
               record(1, ttft=200, tpot=50, e2el=1000),   # exactly at the limits: meets
               record(2, ttft=250, tpot=10, e2el=1000),   # TTFT too slow
               record(3, ttft=100, tpot=60, e2el=1000),   # TPOT too slow
               record(4, ttft=100, tpot=None, e2el=900, out=1),  # one token: no TPOT to miss
               record(5, ttft=None, tpot=None, e2el=50, out=0),  # no text at all: misses the TTFT SLO
               record(6, success=False, ttft=10, tpot=1, e2el=20, error="x")]  # failed: never good
    assert [sr.meets_slos(r, slos) for r in records] == [True, True, False, False, True, False, False]
    s = sr.rate_summary(records, duration_s=4.0, slos=slos)
    assert s["good_requests"] == 3 and s["request_goodput"] == pytest.approx(0.75)
    assert sr.meets_slos(record(0, ttft=1, tpot=1, e2el=1001), {"e2el": 1000.0}) is False


# --- flags -------------------------------------------------------------------------------------------------


def test_parse_goodput():
    assert sb.parse_goodput(["ttft:500", "tpot:50,e2el:1e4"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 10000.0}


@pytest.mark.parametrize("items, match", [
    (["ttft:abc"], r"'abc' is not a number of milliseconds"),
    (["foo:10"], r"unknown metric 'foo'; allowed: ttft, tpot, e2el"),
    (["ttft"], r"expected METRIC:MS with METRIC one of ttft, tpot, e2el"),
    (["ttft:0"], r"> 0"),
    (["ttft:5", "ttft:6"], r"twice"),
])
def test_parse_goodput_errors(items, match):
    with pytest.raises(ValueError, match=match):
        sb.parse_goodput(items)


def flags(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sb.add_arguments(parser)
    return parser.parse_args(list(argv))


def parse_flags(*argv: str) -> sb.BenchConfig:
    return sb.config_from_args(flags(*argv))


def test_flags_resolve_to_config():
    c = parse_flags("--request-rate", "1,2.5,inf", "--goodput", "ttft:300", "--extra-body", '{"speculation": false}',
                    "--base-url", "http://h:9/", "--max-concurrency", "4")
    assert c.request_rates == (1.0, 2.5, math.inf) and c.goodput == {"ttft": 300.0}
    assert c.extra_body == {"speculation": False} and c.base_url == "http://h:9" and c.max_concurrency == 4
    assert c.max_tokens == sb.DEFAULT_MAX_TOKENS
    assert parse_flags("--dataset", "random", "--random-output-len", "32").max_tokens == 32
    assert parse_flags("--dataset", "random").max_tokens == sb.DEFAULT_RANDOM_OUTPUT_LEN


@pytest.mark.parametrize("argv, match", [
    (["--request-rate", "0"], r"--request-rate '0'.*> 0"),
    (["--request-rate", "1,fast"], r"'fast' is not a number"),
    (["--request-rate", "nan"], r"> 0"),
    (["--burstiness", "0"], r"--burstiness must be a finite number > 0"),
    (["--num-prompts", "0"], r"--num-prompts must be an integer >= 1"),
    (["--max-tokens", "0"], r"--max-tokens must be an integer >= 1"),
    (["--max-concurrency", "0"], r"--max-concurrency must be >= 1"),
    (["--timeout", "-1"], r"--timeout"),
    (["--temperature", "-0.5"], r"--temperature"),
    (["--base-url", "localhost:8000"], r"--base-url must start with http:// or https://"),
    (["--extra-body", "{bad"], r"--extra-body is not valid JSON"),
    (["--extra-body", "[1]"], r"--extra-body must be a JSON object"),
    (["--extra-body", '{"stream": false}'], r"must not set 'stream'"),
    (["--random-input-len", "64"], r"--random-input-len applies only to --dataset random"),
    (["--dataset", "random", "--random-output-len", "8", "--max-tokens", "9"], r"not both"),
    (["--dataset", "random", "--random-input-len", "0"], r"--random-input-len must be an integer >= 1"),
])
def test_bad_flags_raise_value_error(argv, match):
    with pytest.raises(ValueError, match=match):
        parse_flags(*argv)


def test_random_prompts_seeded_and_sized():
    a, b = load_random(3, 40, seed=7), load_random(3, 40, seed=7)
    assert a == b and len({p.text for p in a}) == 3
    assert all(len(p.text.split()) == 40 for p in a) and a[0].id == "random/0"
    assert load_random(1, 40, seed=8)[0] != a[0]


def test_mixed_dataset_alternates_chat_and_code_and_cycles():
    config = sb.BenchConfig(dataset="mixed", num_prompts=5)
    ids = [p.id for p in sb.load_dataset(config)]
    assert len(ids) == 5 and len(set(ids)) == 5
    assert [i.split("/")[0] for i in ids] == ["sharegpt", "HumanEval", "sharegpt", "HumanEval", "sharegpt"]
    assert parse_flags("--dataset", "mixed").dataset == "mixed"


def test_cycle_prompts():
    base = [BenchPrompt("a", "x"), BenchPrompt("b", "y")]
    assert [p.id for p in sb.cycle_prompts(base, 5)] == ["a", "b", "a#1", "b#1", "a#2"]


@pytest.mark.parametrize("module", [sb, sc, sr, pt], ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_module_imports_neither_torch_nor_machine(module):
    tree = ast.parse(Path(module.__file__).read_text())
    imported = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any("torch" in m or m.endswith("machine") for m in imported), imported


# --- server-sent events ------------------------------------------------------------------------------------

EVENTS = [
    {"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    {"id": "c", "choices": [{"index": 0, "delta": {"content": "Hel"}}]},
    {"id": "c", "choices": [{"index": 0, "delta": {"content": "lo wör"}}]},  # two tokens in one chunk
    {"id": "c", "choices": [{"index": 0, "delta": {"content": "ld ✓"}}]},
    {"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    {"id": "c", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}},
]


def sse_bytes(events, newline="\n") -> bytes:
    body = f": keep-alive{newline}{newline}event: message{newline}"
    body += "".join(f"data: {json.dumps(e, ensure_ascii=False)}{newline}{newline}" for e in events)
    return (body + f"data: [DONE]{newline}{newline}").encode()


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 10_000])
def test_sse_parser_reassembles_any_split(newline, size):
    raw = sse_bytes(EVENTS, newline)
    parser, payloads = sc.SSEParser(), []
    for i in range(0, len(raw), size):  # 1-byte pieces split the UTF-8 of 'ö' and '✓', and every \r\n
        payloads += parser.feed(raw[i:i + size])
    payloads += parser.close()
    assert payloads[-1] == "[DONE]"
    assert [json.loads(p) for p in payloads[:-1]] == EVENTS


def test_sse_parser_multiline_data_and_unterminated_last_event():
    parser = sc.SSEParser()
    assert parser.feed(b"data: a\ndata:b\n\ndata: {\"x\"") == ["a\nb"]
    assert parser.feed(b": 1}") == []
    assert parser.close() == ['{"x": 1}']
    # a \r\n split after its \r is one line end, not two (which would cut the event after 'a')
    parser = sc.SSEParser()
    assert parser.feed(b"data: a\r") == [] and parser.feed(b"\ndata: b\r\n\r") == []
    assert parser.feed(b"\n") == ["a\nb"] and parser.close() == []


def streaming_response(pieces):
    """A 200 event stream delivering (delay_s, bytes) pieces."""
    async def body():
        for delay, data in pieces:
            if delay:
                await asyncio.sleep(delay)
            yield data
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())


def send_one(handler, endpoint="chat", **config):
    cfg = sb.BenchConfig(base_url="http://test", model="m", endpoint=endpoint, **config)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await sc.send_request(client, cfg, "m", BenchPrompt("p", "hi"))
    return asyncio.run(go())


def test_request_timing_from_stream_split_at_awkward_boundaries():
    raw = sse_bytes(EVENTS)
    # Boundaries: inside the role chunk, then each text event ends (its blank line arrives) after a delay;
    # every timed piece also carries the first bytes of the next event.
    ends = [raw.index(b"\n\n", raw.index(f'"{t}"'.encode())) + 2 for t in ("Hel", "lo wör", "ld ✓")]
    pieces = [(0, raw[:30]), (0, raw[30:ends[0] - 1]), (0.06, raw[ends[0] - 1:ends[0] + 5]),
              (0.02, raw[ends[0] + 5:ends[1] + 3]), (0.02, raw[ends[1] + 3:])]
    sent = {}

    def handler(request):
        sent.update(json.loads(request.content))
        return streaming_response(pieces)

    r = send_one(handler, ignore_eos=True, extra_body={"speculation": False})
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["messages"] == [{"role": "user", "content": "hi"}] and sent["ignore_eos"] is True
    assert sent["speculation"] is False and sent["max_tokens"] == sb.DEFAULT_MAX_TOKENS
    assert r.success and r.error is None
    assert r.ttft_ms >= 55  # the role-only chunk came at once; the first text 60 ms later
    assert len(r.itl_ms) == 2 and all(g >= 15 for g in r.itl_ms)  # 3 text chunks -> 2 gaps, though 5 tokens
    assert (r.prompt_tokens, r.output_tokens, r.output_tokens_from) == (7, 5, "usage")
    assert r.e2el_ms >= r.ttft_ms + sum(r.itl_ms) - 1e-6
    assert r.tpot_ms == pytest.approx((r.e2el_ms - r.ttft_ms) / 4)


def test_completions_without_usage_counts_chunks():
    events = [{"choices": [{"text": t}]} for t in ("a", "", "b", "c")]
    r = send_one(lambda _: streaming_response([(0, sse_bytes(events))]), endpoint="completions")
    assert r.success and (r.output_tokens, r.output_tokens_from, r.prompt_tokens) == (3, "chunks", None)
    assert len(r.itl_ms) == 2


def test_failures_are_recorded_with_reason():
    r = send_one(lambda _: httpx.Response(400, json={"error": {"message": "max_tokens too large"}}))
    assert not r.success and r.error.startswith("HTTP 400") and "max_tokens too large" in r.error
    r = send_one(lambda _: streaming_response([(0, sse_bytes([EVENTS[1], {"error": {"message": "oom"}}]))]))
    assert not r.success and "oom" in r.error
    r = send_one(lambda _: streaming_response([(0, b"data: {not json\n\n")]))
    assert not r.success and "JSONDecodeError" in r.error
    r = send_one(lambda _: streaming_response([(0.5, sse_bytes(EVENTS))]), timeout=0.05)
    assert not r.success and "timed out after 0.05 s" in r.error

    def refuse(request):
        raise httpx.ConnectError("connection refused", request=request)
    r = send_one(refuse)
    assert not r.success and "ConnectError" in r.error


# --- Prometheus --------------------------------------------------------------------------------------------

METRICS = """# HELP turbospec:spec_decode_num_drafts_total Drafts proposed.
# TYPE turbospec:spec_decode_num_drafts_total counter
turbospec:spec_decode_num_drafts_total{model_name="a",engine="0"} 10.0
turbospec:spec_decode_num_drafts_total{model_name="a",engine="1"} 5
turbospec:spec_decode_num_drafts_created{model_name="a"} 1.7e9
turbospec:spec_decode_num_draft_tokens_total{model_name="we\\"ird, {x} \\\\ name"} 60 1712345678000
turbospec:spec_decode_num_accepted_tokens_total 30
http_requests_total{code="200",path="/v1/chat/completions"} +Inf
not a sample line
"""


def test_prometheus_parser():
    samples = pt.parse_prometheus(METRICS)
    assert len(samples) == 6
    weird = next(s for s in samples if s.name == "turbospec:spec_decode_num_draft_tokens_total")
    assert weird.labels == {"model_name": 'we"ird, {x} \\ name'} and weird.value == 60.0
    assert samples[0].labels == {"model_name": "a", "engine": "0"}
    totals = pt.metric_totals(samples)
    assert totals["turbospec:spec_decode_num_drafts_total"] == 15.0  # summed over label sets
    assert totals["turbospec:spec_decode_num_accepted_tokens_total"] == 30.0
    assert math.isinf(totals["http_requests_total"])


def test_speculation_stats_deltas():
    before = {"turbospec:spec_decode_num_drafts_total": 5, "turbospec:spec_decode_num_draft_tokens_total": 20,
              "turbospec:spec_decode_num_accepted_tokens_total": 10}
    after = {"turbospec:spec_decode_num_drafts_total": 15, "turbospec:spec_decode_num_draft_tokens_total": 60,
             "turbospec:spec_decode_num_accepted_tokens_total": 40, "vllm:spec_decode_num_drafts_total": 0,
             "vllm:spec_decode_num_draft_tokens_total": 0, "vllm:spec_decode_num_accepted_tokens_total": 0}
    stats = pt.speculation_stats(before, after)
    assert stats["turbospec"] == {"drafts": 10, "draft_tokens": 40, "accepted_tokens": 30, "acceptance_rate": 0.75,
                                  "mean_accepted_length": 4.0}
    assert stats["vllm"]["acceptance_rate"] is None  # no drafts: undefined, not 0
    assert pt.speculation_stats({}, {"other_total": 1}) == {}


# --- benchmark() end to end over a mock transport ----------------------------------------------------------


class FakeServer:
    """An OpenAI-compatible server in a handler: /v1/models, /metrics, and streamed chat completions (two
    text chunks; each request drafts 2 times, 3 tokens each, 4 accepted); prompt 'fail' gets HTTP 500."""

    def __init__(self, with_metrics=True):
        self.with_metrics = with_metrics
        self.chat_requests = 0
        self.counters = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "fake-model"}, {"id": "other"}]})
        if path == "/metrics":
            if not self.with_metrics:
                return httpx.Response(404, text="not found")
            return httpx.Response(200, text="".join(f"turbospec:spec_decode_num_{k}_total{{model_name=\"f\"}} {v}\n"
                                                    for k, v in self.counters.items()))
        assert path == "/v1/chat/completions"
        body = json.loads(request.content)
        assert body["model"] == "fake-model"
        self.chat_requests += 1
        if body["messages"][0]["content"] == "fail":
            return httpx.Response(500, text="internal error")
        for key, step in (("drafts", 2), ("draft_tokens", 6), ("accepted_tokens", 4)):
            self.counters[key] += step
        events = [EVENTS[1], EVENTS[2], {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 6}}]
        return streaming_response([(0.002, sse_bytes(events))])


def run_benchmark(server, prompts, **config):
    cfg = sb.BenchConfig(base_url="http://fake", **config)
    return asyncio.run(sb.benchmark(cfg, prompts, transport=httpx.MockTransport(server)))


def test_benchmark_end_to_end(tmp_path, capsys):
    server = FakeServer()
    prompts = [BenchPrompt(f"p{i}", "fail" if i == 2 else f"prompt {i}") for i in range(5)]
    result = run_benchmark(server, prompts, request_rates=(math.inf, 200.0), warmup=2, max_concurrency=2,
                           goodput={"e2el": 60_000.0}, label="fake run")
    assert server.chat_requests == 2 + 2 * 5  # warmup requests are sent but not measured
    assert (result["model"], result["label"], result["endpoint"]) == ("fake-model", "fake run", "chat")
    assert result["config"]["request_rates"] == ["inf", 200.0] and result["config"]["model"] == "fake-model"
    assert set(result["machine"]) >= {"date", "platform", "cpus", "python"}
    for rate in result["rates"]:
        assert (rate["completed"], rate["failed"], rate["num_requests"]) == (4, 1, 5)
        assert rate["total_output_tokens"] == 24 and rate["total_input_tokens"] == 12
        assert rate["good_requests"] == 4
        assert rate["errors"] == {"HTTP 500: internal error": 1}
        failed = rate["requests"][2]
        assert failed["prompt_id"] == "p2" and not failed["success"] and failed["error"].startswith("HTTP 500")
        # 4 successful requests in this rate only (warmup excluded): 8 drafts, 24 draft tokens, 16 accepted
        assert rate["speculation"]["turbospec"] == {"drafts": 8, "draft_tokens": 24, "accepted_tokens": 16,
                                                    "acceptance_rate": pytest.approx(2 / 3),
                                                    "mean_accepted_length": 3.0}
    assert [r["scheduled_s"] for r in result["rates"][0]["requests"]] == [0.0] * 5
    assert result["rates"][1]["requests"][-1]["scheduled_s"] > 0

    paths = sr.write_outputs(result, str(tmp_path / "sub" / "run"))
    assert [p.name for p in paths][:2] == ["run.json", "run.md"]
    assert json.loads((tmp_path / "sub" / "run.json").read_text())["rates"][0]["completed"] == 4
    table = (tmp_path / "sub" / "run.md").read_text()
    assert "| inf | 4 | 1 |" in table and "| 200 | 4 | 1 |" in table and "0.67 (len 3.00)" in table
    assert "HTTP 500: internal error" in table
    if len(paths) == 3:
        assert paths[2].read_bytes()[:4] == b"\x89PNG"


def test_benchmark_without_metrics_and_with_unreachable_models():
    result = run_benchmark(FakeServer(with_metrics=False), [BenchPrompt("a", "x")], model="fake-model")
    assert result["rates"][0]["speculation"] is None and result["rates"][0]["completed"] == 1
    assert "| - |" in sr.markdown_report(result)

    def down(request):
        raise httpx.ConnectError("refused", request=request)
    with pytest.raises(RuntimeError, match="could not read a model id.*pass --model"):
        run_benchmark(down, [BenchPrompt("a", "x")])
    with pytest.raises(RuntimeError, match="all 1 warmup requests failed"):
        run_benchmark(down, [BenchPrompt("a", "x")], model="m", warmup=1)


# --- against a real turbospec server -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    """A dummy-weight model with a byte tokenizer: fast, and its random bytes are often not valid UTF-8, so the
    server streams fewer text chunks than tokens (what makes the chunk and token counts differ below)."""
    engine = build_engine(EngineConfig("dummy:tiny", num_threads=1, max_model_len=256), progress=False)
    with live_server(engine, "tiny") as live:
        yield live


class _Tee(httpx.AsyncByteStream):
    def __init__(self, stream: httpx.AsyncByteStream, sink: bytearray) -> None:
        self.stream, self.sink = stream, sink

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.stream:
            self.sink += chunk
            yield chunk

    async def aclose(self) -> None:
        await self.stream.aclose()


class TeeTransport(httpx.AsyncBaseTransport):
    """The network, keeping the raw bytes of each generation response: raw[prompt] is one bytearray per request
    of that prompt, in the order they were sent."""

    def __init__(self) -> None:
        self.network = httpx.AsyncHTTPTransport()
        self.raw: dict[str, list[bytearray]] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.network.handle_async_request(request)
        if request.method != "POST":
            return response
        body = json.loads(request.content)
        sink = bytearray()
        self.raw.setdefault(body.get("prompt") or body["messages"][0]["content"], []).append(sink)
        return httpx.Response(response.status_code, headers=response.headers, extensions=response.extensions,
                              stream=_Tee(response.stream, sink))

    async def aclose(self) -> None:
        await self.network.aclose()


def stream_events(raw: bytes) -> list[dict]:
    """The JSON events of a turbospec event stream (which ends every line with \\n), read without SSEParser."""
    payloads = [line.removeprefix("data: ") for line in raw.decode().split("\n") if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def scrape(server: LiveServer | str, name: str) -> float:
    """One counter of the server's /metrics (a live server or a URL), summed over its label sets, read without
    parse_prometheus."""
    lines = httpx.get((server if isinstance(server, str) else server.url) + "/metrics").text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if re.match(rf"{re.escape(name)}[{{ ]", line))


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_benchmark_against_the_turbospec_server(server, endpoint):
    prompts = load_random(6, 16, seed=1)
    cfg = sb.BenchConfig(base_url=server.url, endpoint=endpoint, dataset="random", num_prompts=6,
                         random_input_len=16, max_tokens=16, ignore_eos=True, request_rates=(20.0, math.inf))
    tee = TeeTransport()
    generated, prompted = (scrape(server, f"turbospec:{c}_tokens_total") for c in ("generation", "prompt"))
    result = asyncio.run(sb.benchmark(cfg, prompts, transport=tee))
    generated, prompted = (scrape(server, f"turbospec:{c}_tokens_total") - before
                           for c, before in (("generation", generated), ("prompt", prompted)))

    assert result["model"] == "tiny" and result["endpoint"] == endpoint  # the model id from GET /v1/models
    assert [r["request_rate"] for r in result["rates"]] == [20.0, "inf"]
    for k, rate in enumerate(result["rates"]):
        assert (rate["completed"], rate["failed"], rate["errors"]) == (6, 0, {})
        assert rate["total_output_tokens"] == 6 * 16 and rate["input_tokens_known"]
        assert rate["request_throughput"] * rate["duration_s"] == pytest.approx(6)
        assert rate["output_throughput"] * rate["duration_s"] == pytest.approx(96)
        assert rate["speculation"]["turbospec"]["drafts"] == 0  # no speculation configured
        for prompt, q in zip(prompts, rate["requests"]):
            events = stream_events(tee.raw[prompt.text][k])
            usage = events[-1]["usage"]
            texts = [sc.chunk_text(e, endpoint) for e in events]
            texts = [t for t in texts if t]
            assert q["prompt_id"] == prompt.id and q["success"] and q["error"] is None
            assert q["output_tokens"] == usage["completion_tokens"] == 16 and q["output_tokens_from"] == "usage"
            assert q["prompt_tokens"] == usage["prompt_tokens"]
            assert len(q["itl_ms"]) == len(texts) - 1 and q["output_chars"] == sum(map(len, texts))
            assert 0 < q["ttft_ms"] <= q["ttft_ms"] + sum(q["itl_ms"]) <= q["e2el_ms"] + 1e-6
            assert q["tpot_ms"] == pytest.approx((q["e2el_ms"] - q["ttft_ms"]) / 15)
            assert q["sent_s"] >= q["scheduled_s"] - 0.005
        assert rate["total_input_tokens"] == sum(q["prompt_tokens"] for q in rate["requests"])
    last_arrival = [rate["requests"][-1]["scheduled_s"] for rate in result["rates"]]
    assert last_arrival[0] > 0 and last_arrival[1] == 0  # 20 req/s spreads the arrivals; inf sends all at once
    assert generated == sum(r["total_output_tokens"] for r in result["rates"])
    assert prompted == sum(r["total_input_tokens"] for r in result["rates"])


def test_http_400_from_the_turbospec_server_is_recorded_not_raised(server, tmp_path, capsys):
    args = flags("--base-url", server.url, "--dataset", "random", "--num-prompts", "3", "--random-input-len", "8",
                 "--random-output-len", "4", "--extra-body", '{"bogus_field": 1}', "--output", str(tmp_path / "bad"))
    assert sb.run(args) == 1  # every request failed
    rate = json.loads((tmp_path / "bad.json").read_text())["rates"][0]
    assert (rate["completed"], rate["failed"]) == (0, 3)
    [(error, count)] = rate["errors"].items()
    assert count == 3 and error.startswith("HTTP 400: ") and "unknown or unsupported field 'bogus_field'" in error
    for q in rate["requests"]:
        assert (q["success"], q["error"], q["ttft_ms"], q["output_tokens"]) == (False, error, None, 0)
    assert "rate inf: 3 failed: HTTP 400" in capsys.readouterr().out


def test_a_server_killed_mid_run_ends_the_run_with_what_completed(tmp_path, capsys):
    """A real `turbospec serve` process, SIGKILLed once two requests have finished: the run stops at once (it
    neither waits out the arrival schedule nor starts the next rate), saves what completed and says so."""
    with serve_process("--max-model-len", "256", "--num-threads", "1") as (proc, url):
        args = flags("--base-url", url, "--dataset", "random", "--num-prompts", "40", "--random-input-len", "8",
                     "--random-output-len", "8", "--ignore-eos", "--request-rate", "4,inf",
                     "--output", str(tmp_path / "run"))
        outcome: dict[str, int] = {}
        runner = threading.Thread(target=lambda: outcome.update(code=sb.run(args)))
        runner.start()
        deadline = time.monotonic() + 60
        while scrape(url, "turbospec:request_success_total") < 2:
            assert time.monotonic() < deadline and runner.is_alive()
            time.sleep(0.02)
        proc.kill()
        killed = time.monotonic()
        runner.join(timeout=60)
    assert time.monotonic() - killed < 5  # the 40 arrivals at 4 req/s span ~10 s: the rest were not waited for
    assert outcome["code"] == 1
    result = json.loads((tmp_path / "run.json").read_text())
    [rate] = result["rates"]  # the inf rate never ran
    assert rate["request_rate"] == 4.0 and rate["server_gone"]
    assert 2 <= rate["completed"] < 40 and rate["completed"] + rate["failed"] == 40
    assert rate["errors"].get(sb.NOT_SENT, 0) > 0
    assert result["stopped"] == (f"the server stopped answering during rate 4 req/s: {rate['completed']} of 40 "
                                 "requests completed there; 1 later rate(s) not run")
    assert "Run stopped early" in (tmp_path / "run.md").read_text()
    err = capsys.readouterr().err
    assert "error: the server stopped answering" in err and "partial results are in" in err
    assert "Traceback" not in err
