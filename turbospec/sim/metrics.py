"""Latency statistics of a simulated run, in the shape ``turbospec bench serve`` reports (ms, mean / median /
p90 / p99), so simulated and measured runs compare field by field."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..bench.serve_report import summarize
from .batching import LiveRequest


@dataclass(frozen=True)
class RequestTimes:
    request_id: str
    replica: int
    arrival_s: float
    ttft_s: float
    e2el_s: float
    output_tokens: int

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None for a one-token output (as bench serve)."""
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def request_times(live: LiveRequest, replica: int) -> RequestTimes:
    assert live.first_token_s is not None and live.finish_s is not None
    r = live.req
    return RequestTimes(r.request_id, replica, r.arrival_s, live.first_token_s - r.arrival_s,
                        live.finish_s - r.arrival_s, r.output_tokens)


def run_summary(times: Sequence[RequestTimes], prompt_tokens: int) -> dict[str, Any]:
    """Throughput over the run (first arrival to last finish, as bench serve's duration) and latencies."""
    if not times:
        raise ValueError("no finished requests to summarize")
    start = min(t.arrival_s for t in times)
    duration = max(t.arrival_s + t.e2el_s for t in times) - start
    output_tokens = sum(t.output_tokens for t in times)
    return {
        "completed": len(times),
        "duration_s": duration,
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(times) / duration if duration > 0 else float("inf"),
        "output_throughput": output_tokens / duration if duration > 0 else float("inf"),
        "ttft_ms": summarize([t.ttft_s * 1e3 for t in times]),
        "tpot_ms": summarize([t.tpot_s * 1e3 for t in times if t.tpot_s is not None]),
        "e2el_ms": summarize([t.e2el_s * 1e3 for t in times]),
    }
