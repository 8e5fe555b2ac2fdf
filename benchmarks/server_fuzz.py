"""The server under 10,000 fuzzed requests: every answer must be a 2xx or a 4xx in OpenAI's error shape (never a
5xx, never a dropped connection), /health must stay up, and a greedy answer must be the same after as before.

Bodies mix valid requests with wrong types, out-of-range numbers, unknown fields, huge integers, lone surrogates,
truncated JSON and raw random bytes, on every route, half of the generations streamed. A dummy-weight model keeps
each request cheap: what is tested is the serving layer.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/server_fuzz.py [--requests 10000 --concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from harness import benchmark_meta, default_out, header_lines, save, table  # noqa: E402
from live_server import live_server  # noqa: E402

from turbospec.config import EngineConfig  # noqa: E402
from turbospec.tuning import build_engine  # noqa: E402

MODEL = "tiny"
ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/models")
FIELDS = ("model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop",
          "stream", "logprobs", "echo", "ignore_eos", "deterministic", "acceptance", "speculation", "tokens",
          "min_p", "stream_options", "user", "frequency_penalty", "response_format")


def fuzz_value(rng: random.Random, depth: int = 0) -> Any:
    """A JSON-ish value of a random kind (containers only two levels deep)."""
    kinds = [
        lambda: None, lambda: True, lambda: rng.randint(-5, 300), lambda: rng.choice([2**64, -(2**63) - 1, 10**30]),
        lambda: rng.uniform(-3, 3), lambda: float("inf") if rng.random() < 0.5 else float("nan"),
        lambda: "".join(chr(rng.randrange(32, 0x2FF)) for _ in range(rng.randrange(12))), lambda: "\ud800x",
        lambda: "a" * rng.randrange(200), lambda: [rng.randrange(-3, 600) for _ in range(rng.randrange(6))],
    ]
    if depth < 2:
        kinds += [lambda: [fuzz_value(rng, depth + 1) for _ in range(rng.randrange(4))],
                  lambda: {rng.choice(FIELDS): fuzz_value(rng, depth + 1) for _ in range(rng.randrange(3))}]
    return rng.choice(kinds)()


def valid_body(rng: random.Random, route: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": rng.randrange(1, 6), "temperature": rng.choice([0, 0.7])}
    if route.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": rng.choice(["hi", "two words", "x" * 20])}]
    elif route == "/detokenize":
        body = {"model": MODEL, "tokens": [rng.randrange(256) for _ in range(4)]}
    else:
        body["prompt"] = rng.choice(["hello", "a b c", [1, 2, 3], ["p1", "p2"]])
    if route.startswith("/v1/") and rng.random() < 0.5:
        body["stream"] = True
    return body


def fuzz_request(rng: random.Random) -> tuple[str, str, bytes]:
    route = rng.choice(ROUTES)
    method = "GET" if route == "/v1/models" else "POST"
    roll = rng.random()
    if roll < 0.1:  # raw bytes
        return method, route, bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))
    body = valid_body(rng, route)
    if roll < 0.8:  # one to three fields mutated, removed or added
        for _ in range(rng.randrange(1, 4)):
            field = rng.choice(FIELDS)
            if rng.random() < 0.2:
                body.pop(field, None)
            else:
                body[field] = fuzz_value(rng)
    raw = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    if rng.random() < 0.05:  # truncated JSON
        raw = raw[: rng.randrange(1, max(2, len(raw)))]
    return method, route, raw


async def one(client: httpx.AsyncClient, method: str, route: str, raw: bytes) -> str:
    """The outcome's class: '2xx', '4xx' (with an OpenAI error body), or what went wrong."""
    try:
        r = await client.request(method, route, content=raw if method == "POST" else None,
                                 headers={"content-type": "application/json"})
        text = r.text
    except httpx.HTTPError as exc:
        return f"dropped ({type(exc).__name__})"
    if r.status_code >= 500:
        return f"{r.status_code}"
    if r.status_code >= 400:
        try:
            error = r.json()["error"]
            ok = isinstance(error["message"], str) and "Traceback" not in error["message"]
        except (ValueError, KeyError, TypeError):
            ok = False
        return "4xx" if ok else f"{r.status_code} without an OpenAI error body"
    if "text/event-stream" in r.headers.get("content-type", "") and not text.rstrip().endswith("data: [DONE]"):
        return "stream without [DONE]"
    return "2xx"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(default_out("server_fuzz")))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    engine = build_engine(EngineConfig("dummy:tiny", num_threads=1, max_model_len=128,
                                       speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
                          progress=False)
    outcomes: Counter[str] = Counter()
    with live_server(engine, MODEL) as live:
        greedy = {"model": MODEL, "prompt": "the same answer", "max_tokens": 8, "temperature": 0}
        before = httpx.post(live.url + "/v1/completions", json=greedy, timeout=60).json()["choices"][0]["text"]
        requests = [fuzz_request(rng) for _ in range(args.requests)]

        async def run() -> None:
            limits = asyncio.Semaphore(args.concurrency)
            bar = tqdm(total=len(requests), desc="fuzzing", unit="req")
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as client:
                async def guarded(request: tuple[str, str, bytes]) -> None:
                    async with limits:
                        outcomes[await one(client, *request)] += 1
                        bar.update(1)

                await asyncio.gather(*(guarded(r) for r in requests))
            bar.close()

        asyncio.run(run())
        after = httpx.post(live.url + "/v1/completions", json=greedy, timeout=60).json()["choices"][0]["text"]
        health = httpx.get(live.url + "/health").json()
        leftover = len(engine.requests), engine.blocks.usage()
    bad = {k: v for k, v in outcomes.items() if k not in ("2xx", "4xx")}
    rows = [{"outcome": k, "requests": v} for k, v in sorted(outcomes.items())]
    rows.append({"outcome": "greedy answer unchanged", "requests": int(before == after)})
    meta = benchmark_meta(1, model="dummy:tiny", requests=args.requests, concurrency=args.concurrency,
                          seed=args.seed, health_after=health, leftover_requests=leftover[0],
                          kv_usage_after=leftover[1])
    lines = [f"# Server fuzzing: {args.requests} requests, {args.concurrency} at a time", "", *header_lines(meta), "",
             *table(["outcome", "requests"], [[r["outcome"], r["requests"]] for r in rows]), "",
             f"5xx or dropped: {sum(bad.values())}; /health after: {health['status']}; engine requests left: "
             f"{leftover[0]}, KV in use: {leftover[1]}", ""]
    save(args.out, meta, rows, "\n".join(lines))
    return 1 if bad or before != after or health["status"] != "ok" or any(leftover) else 0


if __name__ == "__main__":
    sys.exit(main())
