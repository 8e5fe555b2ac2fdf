"""``turbospec bench serve``: a serving benchmark client for any OpenAI-compatible server (turbospec, vLLM,
SGLang, llama.cpp's server).

Sends streamed chat or completion requests with gamma-distributed arrivals (Poisson at burstiness 1, as
vLLM's benchmark_serving) at one or more request rates, and reports per rate: throughput, TTFT / TPOT / ITL /
E2EL statistics, goodput under SLOs, and the speculation counters the server's Prometheus ``/metrics`` moved
by. Runs on a client machine: it needs httpx, numpy and tqdm, never torch (matplotlib only for the plot).

The core is :func:`benchmark`, an ``async`` function of a :class:`BenchConfig` and the prompts to send; the
CLI (:func:`add_arguments`, :func:`run`) loads the data set, calls it and writes the reports. One request is
sent and timed in :mod:`.serve_client`, statistics and reports are in :mod:`.serve_report`, and the
``/metrics`` parser is in :mod:`turbospec.server.prometheus_text`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from ..data.arrivals import arrival_offsets, parse_rates
from ..data.prompts import BenchPrompt, load_mixed, load_mtbench, load_prompts, load_random, load_sharegpt
from ..server.prometheus_text import METRICS_TIMEOUT_S, fetch_metrics, speculation_stats
from .serve_client import RequestRecord, send_request
from .serve_config import (DATASETS, DEFAULT_BASE_URL, DEFAULT_MAX_TOKENS, DEFAULT_RANDOM_INPUT_LEN,
                           DEFAULT_RANDOM_OUTPUT_LEN, ENDPOINTS, SLO_METRICS, BenchConfig)
from .serve_report import markdown_report, rate_label, rate_summary, write_outputs


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """['ttft:500', 'tpot:50,e2el:10000'] -> {'ttft': 500.0, 'tpot': 50.0, 'e2el': 10000.0} (ms)."""
    allowed = ", ".join(SLO_METRICS)
    slos: dict[str, float] = {}
    for piece in (p.strip() for item in items for p in item.split(",")):
        name, sep, value = piece.partition(":")
        name = name.strip().lower()
        if not sep:
            raise ValueError(f"--goodput {piece!r}: expected METRIC:MS with METRIC one of {allowed} (e.g. ttft:500)")
        if name not in SLO_METRICS:
            raise ValueError(f"--goodput {piece!r}: unknown metric {name!r}; allowed: {allowed}")
        try:
            limit = float(value)
        except ValueError:
            raise ValueError(f"--goodput {piece!r}: {value.strip()!r} is not a number of milliseconds") from None
        if not (math.isfinite(limit) and limit > 0):
            raise ValueError(f"--goodput {piece!r}: the limit must be a finite number of milliseconds > 0")
        if name in slos:
            raise ValueError(f"--goodput gives {name} twice; give each of {allowed} at most once")
        slos[name] = limit
    return slos


def parse_extra_body(text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--extra-body is not valid JSON ({exc}); e.g. '{{\"speculation\": false}}'") from None
    if not isinstance(body, dict):  # ValueError: the CLI's usage error, like every bad flag value
        example = '{"speculation": false}'
        raise ValueError(f"--extra-body must be a JSON object, e.g. '{example}', got {text!r}")  # noqa: TRY004
    return body


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``turbospec bench serve``."""
    p = parser
    p.add_argument("--base-url", default=DEFAULT_BASE_URL, help="server root, without /v1 (default %(default)s)")
    p.add_argument("--model", default=None, help="model id sent in requests (default: first id of GET /v1/models)")
    p.add_argument("--endpoint", choices=ENDPOINTS, default="chat",
                   help="chat: /v1/chat/completions, prompt as one user message; completions: /v1/completions, "
                        "raw prompt (default %(default)s)")
    p.add_argument("--dataset", choices=DATASETS, default="mtbench",
                   help="prompts (cycled when fewer than --num-prompts exist; mixed: ShareGPT first turns and HumanEval "
                        "problems alternating; default %(default)s)")
    p.add_argument("--num-prompts", type=int, default=80, help="requests per rate (default %(default)s)")
    p.add_argument("--random-input-len", type=int, default=None,
                   help=f"--dataset random: words per prompt, about one token each "
                        f"(default {DEFAULT_RANDOM_INPUT_LEN})")
    p.add_argument("--random-output-len", type=int, default=None,
                   help=f"--dataset random: max_tokens of each request (default {DEFAULT_RANDOM_OUTPUT_LEN}); "
                        "add --ignore-eos for exactly that many")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"output cap sent as max_tokens (default {DEFAULT_MAX_TOKENS}; "
                        "--random-output-len for --dataset random)")
    p.add_argument("--ignore-eos", action="store_true", help='send "ignore_eos": true (vLLM/turbospec extension)')
    p.add_argument("--temperature", type=float, default=0.0, help="default %(default)s (greedy)")
    p.add_argument("--request-rate", default="inf",
                   help="comma-separated requests/s, one run each; inf sends all at once (default %(default)s)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the inter-arrival times: 1 = Poisson, < 1 burstier, > 1 more regular")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    p.add_argument("--warmup", type=int, default=0,
                   help="requests sent (the first prompts) and discarded before measuring (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seeds the arrival times and random prompts")
    p.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs, e.g. ttft:500 tpot:50 e2el:10000; goodput counts the requests meeting all of them")
    p.add_argument("--extra-body", default=None, help='JSON merged into each request body, e.g. \'{"speculation": '
                                                      'false}\'')
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default %(default)s)")
    p.add_argument("--output", default=None, metavar="PREFIX", help="write PREFIX.json, PREFIX.md and PREFIX.png")
    p.add_argument("--label", default=None, help="name of the run in the reports (default: the model id)")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The BenchConfig of parsed flags; ValueError on bad or contradictory values."""
    if args.dataset != "random":
        for flag, value in (("--random-input-len", args.random_input_len),
                            ("--random-output-len", args.random_output_len)):
            if value is not None:
                raise ValueError(f"{flag} applies only to --dataset random (got --dataset {args.dataset})")
    elif args.random_output_len is not None and args.max_tokens is not None:
        raise ValueError("--dataset random: give --random-output-len or --max-tokens, not both (they set the "
                         "same cap)")
    def given(value: int | None, default: int) -> int:  # 0 is a bad value, not "use the default"
        return default if value is None else value

    random_output_len = given(args.random_output_len, DEFAULT_RANDOM_OUTPUT_LEN)
    max_tokens = given(args.max_tokens, random_output_len if args.dataset == "random" else DEFAULT_MAX_TOKENS)
    return BenchConfig(
        base_url=args.base_url, model=args.model, endpoint=args.endpoint, dataset=args.dataset,
        num_prompts=args.num_prompts, random_input_len=given(args.random_input_len, DEFAULT_RANDOM_INPUT_LEN),
        random_output_len=random_output_len, max_tokens=max_tokens,
        ignore_eos=args.ignore_eos, temperature=args.temperature, request_rates=parse_rates(args.request_rate),
        burstiness=args.burstiness, max_concurrency=args.max_concurrency, warmup=args.warmup, seed=args.seed,
        goodput=parse_goodput(args.goodput) if args.goodput else {}, extra_body=parse_extra_body(args.extra_body),
        timeout=args.timeout, output=args.output, label=args.label,
    )


# --- prompts and arrivals ----------------------------------------------------------------------------------


def cycle_prompts(prompts: Sequence[BenchPrompt], n: int) -> list[BenchPrompt]:
    """The first `n` of `prompts` repeated cyclically; repeats get a '#k' id suffix (as load_prompts)."""
    if not prompts:
        raise ValueError("the data set holds no prompts")
    return [BenchPrompt(p.id if i < len(prompts) else f"{p.id}#{i // len(prompts)}", p.text)
            for i, p in ((i, prompts[i % len(prompts)]) for i in range(n))]


def load_dataset(config: BenchConfig) -> list[BenchPrompt]:
    """config.num_prompts prompts of config.dataset. A data set that is not installed is a bad --dataset value
    for this machine, so it raises ValueError with the install hint."""
    n = config.num_prompts
    try:
        if config.dataset == "random":
            return load_random(n, config.random_input_len, config.seed)
        if config.dataset == "humaneval":
            return load_prompts(n, "humaneval")[0]
        if config.dataset == "mixed":
            return cycle_prompts(load_mixed(n), n)
        loaded = load_mtbench(n) if config.dataset == "mtbench" else load_sharegpt(n)
    except RuntimeError as exc:
        raise ValueError(f"--dataset {config.dataset}: {exc}") from None
    return cycle_prompts(loaded, n)


# --- the benchmark -----------------------------------------------------------------------------------------


async def fetch_model_id(client: httpx.AsyncClient, base_url: str) -> str:
    url = base_url + "/v1/models"
    try:
        response = await client.get(url, timeout=METRICS_TIMEOUT_S)
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise RuntimeError(f"could not read a model id from {url} ({type(exc).__name__}: {exc}); "
                           "is the server up? or pass --model") from None


NOT_SENT = "not sent: the server had stopped answering"


async def server_answers(client: httpx.AsyncClient, base_url: str) -> bool:
    """Whether the server still answers GET /v1/models (any HTTP status: the process is there)."""
    try:
        await client.get(base_url + "/v1/models", timeout=METRICS_TIMEOUT_S)
    except httpx.HTTPError:
        return False
    return True


async def _send_all(client: httpx.AsyncClient, config: BenchConfig, model: str, prompts: Sequence[BenchPrompt],
                    offsets: Sequence[float], desc: str) -> tuple[list[RequestRecord], float, bool]:
    """Send prompts[i] at offsets[i] s from now (held back by --max-concurrency); the records in prompt order,
    the duration from the start to the last response, and whether the server stopped answering. When a
    request loses its connection and /v1/models does not answer either, the server is gone: the requests not
    sent yet are recorded as failed (NOT_SENT) at once instead of each waiting for its arrival time."""
    semaphore = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    gone = asyncio.Event()
    bar = tqdm(total=len(prompts), desc=desc, unit="req")
    origin = time.perf_counter()

    async def send_unless_gone(index: int, prompt: BenchPrompt) -> RequestRecord:
        if gone.is_set():
            return RequestRecord(index=index, prompt_id=prompt.id, error=NOT_SENT)
        record = await send_request(client, config, model, prompt, index, origin)
        if record.connection_lost and not gone.is_set() and not await server_answers(client, config.base_url):
            gone.set()
        return record

    async def one(index: int, prompt: BenchPrompt, offset: float) -> RequestRecord:
        with contextlib.suppress(TimeoutError):  # the arrival time, or earlier when the server is gone
            await asyncio.wait_for(gone.wait(), max(0.0, origin + offset - time.perf_counter()))
        if semaphore is None:
            record = await send_unless_gone(index, prompt)
        else:
            async with semaphore:
                record = await send_unless_gone(index, prompt)
        record.scheduled_s = float(offset)
        bar.update()
        return record

    try:
        records = await asyncio.gather(*(one(i, p, o) for i, (p, o) in enumerate(zip(prompts, offsets))))
    finally:
        bar.close()
    return list(records), time.perf_counter() - origin, gone.is_set()


async def _warm_up(client: httpx.AsyncClient, config: BenchConfig, model: str,
                   prompts: Sequence[BenchPrompt]) -> None:
    """Send config.warmup requests (the first prompts) at once and discard them; fail fast when all fail,
    since the measured run would fail the same way."""
    warm = cycle_prompts(prompts, config.warmup)
    records, _, _ = await _send_all(client, config, model, warm, [0.0] * len(warm), "warmup")
    failed = [r for r in records if not r.success]
    if len(failed) == len(records):
        raise RuntimeError(f"all {len(records)} warmup requests failed; first error: {failed[0].error}")
    if failed:
        print(f"warning: {len(failed)} of {len(records)} warmup requests failed: {failed[0].error}",
              file=sys.stderr)


async def _run_rate(client: httpx.AsyncClient, config: BenchConfig, model: str, prompts: Sequence[BenchPrompt],
                    rate: float) -> dict[str, Any]:
    before = await fetch_metrics(client, config.base_url)
    # The same seed at every rate: the arrival pattern is the same, scaled (see arrival_offsets).
    offsets = arrival_offsets(len(prompts), rate, config.burstiness, np.random.default_rng(config.seed))
    records, duration, gone = await _send_all(client, config, model, prompts, offsets, f"rate {rate_label(rate)}")
    after = None if gone else await fetch_metrics(client, config.base_url)
    summary = {"request_rate": rate_json(rate), "burstiness": config.burstiness,
               "max_concurrency": config.max_concurrency, "num_requests": len(records), "server_gone": gone}
    summary |= rate_summary(records, duration, config.goodput)
    summary["speculation"] = speculation_stats(before, after) if before is not None and after is not None else None
    summary["requests"] = [asdict(r) for r in records]
    return summary


async def benchmark(config: BenchConfig, prompts: Sequence[BenchPrompt],
                    transport: httpx.AsyncBaseTransport | None = None) -> dict[str, Any]:
    """Run the benchmark: for each of config.request_rates, send one streamed request per prompt. Returns the
    report as a JSON-ready dict, the content of PREFIX.json. Failed requests are in the report; a server that
    stops answering ends the run there, with the rates measured so far and `stopped` saying where.
    Raises RuntimeError only when the model id cannot be listed or every warmup request fails.
    transport: an httpx transport to use instead of the network (tests, custom networking)."""
    if not prompts:
        raise ValueError("no prompts to send")
    # No connection limit: a pool limit would queue requests inside the client and inflate their TTFT;
    # --max-concurrency is the limit.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(config.timeout), limits=limits,
                                 transport=transport) as client:
        model = config.model or await fetch_model_id(client, config.base_url)
        if config.warmup:
            await _warm_up(client, config, model, prompts)
        rates, stopped = [], None
        for rate in config.request_rates:
            rates.append(await _run_rate(client, config, model, prompts, rate))
            if rates[-1]["server_gone"]:
                left = len(config.request_rates) - len(rates)
                stopped = (f"the server stopped answering during rate {rate_label(rate)} req/s: "
                           f"{rates[-1]['completed']} of {len(prompts)} requests completed there"
                           + (f"; {left} later rate(s) not run" if left else ""))
                break
    config_json = asdict(replace(config, model=model))
    config_json["request_rates"] = [rate_json(r) for r in config.request_rates]
    return {"label": config.label or model, "base_url": config.base_url, "model": model,
            "endpoint": config.endpoint, "dataset": config.dataset, "config": config_json,
            "machine": machine_info(), "rates": rates, "stopped": stopped}


def machine_info() -> dict[str, Any]:
    """Where the client ran (torch-free, unlike turbospec.bench.machine)."""
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "platform": platform.platform(),
            "cpus": os.cpu_count(), "python": platform.python_version()}


def rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate  # JSON has no infinity


def run(args: argparse.Namespace) -> int:
    """``turbospec bench serve``: 0 when every measured request succeeded, 1 when some failed or the server
    could not be used (reports are still written); ValueError for bad flags."""
    config = config_from_args(args)
    prompts = load_dataset(config)
    try:
        result = asyncio.run(benchmark(config, prompts))
    except RuntimeError as exc:
        print(f"turbospec bench serve: error: {exc}", file=sys.stderr)
        return 1
    print(markdown_report(result))
    if config.output:
        print("wrote " + ", ".join(str(p) for p in write_outputs(result, config.output)))
    if result["stopped"]:
        saved = f"; the partial results are in {config.output}.json" if config.output else ""
        print(f"turbospec bench serve: error: {result['stopped']}{saved}", file=sys.stderr)
    failed = sum(r["failed"] for r in result["rates"])
    return 1 if failed else 0
