"""Results of ``turbospec bench serve``: per-rate statistics (throughput, latency percentiles, goodput under
SLOs) of the request records, and the reports written from them (Markdown table, JSON, latency plot).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .serve_client import RequestRecord


# --- statistics --------------------------------------------------------------------------------------------


def summarize(values: Sequence[float]) -> dict[str, float | None]:
    """mean, median, p90 and p99 (numpy's linear interpolation); all None for no values."""
    if len(values) == 0:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    a = np.asarray(values, dtype=float)
    return {"mean": float(a.mean()), "median": float(np.median(a)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99))}


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    """Whether a successful request met every SLO (ms). No text at all misses a TTFT SLO (nothing came); a
    one-token output has no TPOT, so a TPOT SLO has nothing to miss."""
    if not record.success:
        return False
    measured = {"ttft": record.ttft_ms, "tpot": record.tpot_ms, "e2el": record.e2el_ms}
    for name, limit in slos.items():
        value = measured[name]
        if value is None:
            if name != "tpot":
                return False
        elif value > limit:
            return False
    return True


def rate_summary(records: Sequence[RequestRecord], duration_s: float, slos: dict[str, float]) -> dict[str, Any]:
    """Throughput and latency statistics of one rate's records; latencies over the successful requests."""
    ok = [r for r in records if r.success]
    input_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "input_tokens_known": all(r.prompt_tokens is not None for r in ok),
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "ttft_ms": summarize([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        "tpot_ms": summarize([r.tpot_ms for r in ok if r.tpot_ms is not None]),
        "itl_ms": summarize([g for r in ok for g in r.itl_ms]),
        "e2el_ms": summarize([r.e2el_ms for r in ok if r.e2el_ms is not None]),
        "goodput_slos_ms": dict(slos) or None,
        "good_requests": None,
        "request_goodput": None,
        "errors": dict(Counter(r.error for r in records if not r.success).most_common()),
    }
    if slos:
        good = sum(meets_slos(r, slos) for r in records)
        summary["good_requests"], summary["request_goodput"] = good, good / duration_s
    return summary


# --- reports -----------------------------------------------------------------------------------------------


def rate_label(rate: float | str) -> str:
    return "inf" if rate == "inf" or (isinstance(rate, float) and math.isinf(rate)) else f"{rate:g}"


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _acceptance(spec: dict[str, dict[str, Any]] | None) -> str:
    """The first server's acceptance rate and mean accepted length, or '-'."""
    for stats in (spec or {}).values():
        if stats["acceptance_rate"] is not None:
            return f"{stats['acceptance_rate']:.2f} (len {stats['mean_accepted_length']:.2f})"
    return "-"


def markdown_report(result: dict[str, Any]) -> str:
    """A title, one table row per rate, and the distinct errors of failed requests."""
    c = result["config"]
    lines = [f"## {result['label']}", "",
             (f"{result['endpoint']} endpoint of {result['base_url']}, model {result['model']}, {result['dataset']} "
              f"prompts, max_tokens {c['max_tokens']}, burstiness {c['burstiness']:g}, max concurrency "
              f"{c['max_concurrency'] or 'unlimited'}; {result['machine']['date']}"), "",
             ("| rate (req/s) | completed | failed | req/s | out tok/s | TTFT mean (ms) | TTFT p99 | TPOT mean (ms) "
              "| TPOT p99 | E2EL mean (ms) | E2EL p99 | goodput (req/s) | acceptance |"),
             "|" + "---:|" * 13]
    for r in result["rates"]:
        lines.append(
            f"| {rate_label(r['request_rate'])} | {r['completed']} | {r['failed']} | {r['request_throughput']:.2f} "
            f"| {r['output_throughput']:.1f} | {_fmt(r['ttft_ms']['mean'])} | {_fmt(r['ttft_ms']['p99'])} "
            f"| {_fmt(r['tpot_ms']['mean'])} | {_fmt(r['tpot_ms']['p99'])} | {_fmt(r['e2el_ms']['mean'])} "
            f"| {_fmt(r['e2el_ms']['p99'])} | {_fmt(r['request_goodput'], 2)} | {_acceptance(r['speculation'])} |")
    if any(r["goodput_slos_ms"] for r in result["rates"]):
        slos = result["rates"][0]["goodput_slos_ms"]
        lines += ["", "Goodput SLOs: " + ", ".join(f"{k} <= {v:g} ms" for k, v in slos.items())]
    for r in result["rates"]:
        for error, count in r["errors"].items():
            lines.append(f"\nrate {rate_label(r['request_rate'])}: {count} failed: {error}")
    if result.get("stopped"):  # .get: reports written before the field existed
        lines.append(f"\n**Run stopped early:** {result['stopped']}.")
    return "\n".join(lines) + "\n"


def write_plot(result: dict[str, Any], path: Path) -> bool:
    """E2EL CDF per rate; with several rates also output throughput vs mean and p99 E2EL. False (with a note)
    when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure  # lazy: optional, and slow to import
    except ImportError:
        print("note: matplotlib is not installed, skipping the plot (pip install matplotlib)")
        return False
    rates = result["rates"]
    fig = Figure(figsize=(12 if len(rates) > 1 else 6.5, 4.5), layout="constrained")
    axes = fig.subplots(1, 2 if len(rates) > 1 else 1, squeeze=False)[0]
    for r in rates:
        e2el = np.sort([q["e2el_ms"] for q in r["requests"] if q["success"]]) / 1e3
        if len(e2el):
            axes[0].step(e2el, np.arange(1, len(e2el) + 1) / len(e2el), where="post",
                         label=f"{rate_label(r['request_rate'])} req/s")
    axes[0].set(xlabel="end-to-end latency (s)", ylabel="fraction of requests", title=f"E2EL CDF: {result['label']}")
    if len(rates) > 1:
        done = [r for r in rates if r["completed"]]
        x = [r["output_throughput"] for r in done]
        for stat, style in (("mean", "o-"), ("p99", "s--")):
            axes[1].plot(x, [r["e2el_ms"][stat] / 1e3 for r in done], style, label=f"{stat} E2EL")
        for r in done:
            axes[1].annotate(rate_label(r["request_rate"]), (r["output_throughput"], r["e2el_ms"]["mean"] / 1e3),
                             textcoords="offset points", xytext=(4, 4), fontsize=8)
        axes[1].set(xlabel="output throughput (tok/s)", ylabel="end-to-end latency (s)",
                    title="latency vs throughput (points: request rate)")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.savefig(path, dpi=120)
    return True


def write_outputs(result: dict[str, Any], prefix: str) -> list[Path]:
    """PREFIX.json, PREFIX.md and (with matplotlib) PREFIX.png; the paths written."""
    base = Path(prefix)
    base.parent.mkdir(parents=True, exist_ok=True)
    paths = [base.with_name(base.name + ".json"), base.with_name(base.name + ".md")]
    paths[0].write_text(json.dumps(result, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    paths[1].write_text(markdown_report(result), encoding="utf-8")
    png = base.with_name(base.name + ".png")
    if write_plot(result, png):
        paths.append(png)
    return paths
