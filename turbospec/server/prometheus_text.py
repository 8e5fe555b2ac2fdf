"""The server's Prometheus ``/metrics`` for ``turbospec bench serve``: a parser of the text exposition format,
per-metric totals, and the speculation counters (turbospec's or vLLM's) a run moved by.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

METRICS_TIMEOUT_S = 10.0
# Speculation counters (Prometheus names) per server; a server's block is reported when it exposes them.
SPEC_PREFIXES = ("turbospec", "vllm")
SPEC_COUNTERS = {
    "drafts": "spec_decode_num_drafts_total",
    "draft_tokens": "spec_decode_num_draft_tokens_total",
    "accepted_tokens": "spec_decode_num_accepted_tokens_total",
}

# name{labels} value [timestamp]: also the Ray ingress's merge of replicas' metrics (server/ray_bridge.py)
SAMPLE_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(?:\s+-?\d+)?\s*$")
_LABEL_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')
_LABEL_ESCAPE = re.compile(r"\\(.)")


@dataclass(frozen=True)
class PromSample:
    name: str
    labels: dict[str, str]
    value: float


def parse_prometheus(text: str) -> list[PromSample]:
    """Samples of a Prometheus text exposition: ``name{label="v",...} value [timestamp]`` lines; comment
    (# HELP / # TYPE) and malformed lines are skipped."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or not (m := SAMPLE_LINE.match(line)):
            continue
        try:
            value = float(m.group(3))  # also +Inf, -Inf, NaN
        except ValueError:
            continue
        labels = {k: _LABEL_ESCAPE.sub(lambda e: "\n" if e.group(1) == "n" else e.group(1), v)
                  for k, v in _LABEL_PAIR.findall(m.group(2) or "")}
        samples.append(PromSample(m.group(1), labels, value))
    return samples


def metric_totals(samples: Sequence[PromSample]) -> dict[str, float]:
    """Each metric's value summed over its label sets (a server may split a counter by model or engine)."""
    totals: dict[str, float] = {}
    for s in samples:
        totals[s.name] = totals.get(s.name, 0.0) + s.value
    return totals


def speculation_stats(before: dict[str, float], after: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Per server prefix whose counters `after` exposes: the counter deltas, the acceptance rate
    (accepted / draft tokens) and the mean accepted length (1 + accepted / drafts: tokens per verify step).
    A counter missing before is taken as 0 (created on first use)."""
    stats = {}
    for prefix in SPEC_PREFIXES:
        names = {key: f"{prefix}:{counter}" for key, counter in SPEC_COUNTERS.items()}
        if not all(name in after for name in names.values()):
            continue
        delta = {key: after[name] - before.get(name, 0.0) for key, name in names.items()}
        stats[prefix] = delta | {
            "acceptance_rate": delta["accepted_tokens"] / delta["draft_tokens"] if delta["draft_tokens"] else None,
            "mean_accepted_length": 1 + delta["accepted_tokens"] / delta["drafts"] if delta["drafts"] else None,
        }
    return stats


async def fetch_metrics(client: httpx.AsyncClient, base_url: str) -> dict[str, float] | None:
    """The server's metric totals, or None when it has no /metrics (not every server does)."""
    try:
        response = await client.get(base_url + "/metrics", timeout=METRICS_TIMEOUT_S)
    except httpx.HTTPError:
        return None
    return metric_totals(parse_prometheus(response.text)) if response.status_code == 200 else None
