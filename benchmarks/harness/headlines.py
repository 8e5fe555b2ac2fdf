"""One line per result for benchmarks/results/LATEST.md: the number a reader looks for first, taken from the
result's JSON rows as its script wrote them. A benchmark without an entry here (or a result its entry cannot
read) is summed up by its markdown's title."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

SETS = {"mt-bench": "MT-Bench", "humaneval": "HumanEval", "mtbench": "MT-Bench"}


def _x(v: float) -> str:
    return f"{v:.2f}x"


def sets_rows(rows: list[dict[str, Any]]) -> str:
    """proposer_zoo, head_ab, adaptive_estimators: per model, plain's tok/s and the fastest speculative row per set
    (speedup over the same engine's plain row, measured in the same run)."""
    parts = []
    for model in dict.fromkeys(r.get("model") for r in rows if "sets" in r):
        mine = [r for r in rows
                if r.get("model") == model and "sets" in r and r.get("engine", "turbospec") == "turbospec"]
        plain = next((r for r in mine if r["row"] == "plain"), None)
        cells = []
        for name in (plain or mine[0])["sets"]:
            spec = [r for r in mine if r is not plain and not r["row"].startswith("plain") and name in r["sets"]
                    and r["sets"][name].get("speedup") and not r["row"].endswith("-alongside")]
            best = max(spec, key=lambda r: r["sets"][name]["speedup"], default=None)
            label = SETS.get(name, name)
            if plain is not None:
                label += f" plain {plain['sets'][name]['tok_s']:.1f} tok/s"
            if best is not None:
                s = best["sets"][name]
                tau = f", tau {s['tau']:.2f}" if s.get("tau") else ""
                label += f", best {best['row']} {_x(s['speedup'])}{tau}"
            cells.append(label)
        parts.append(f"{model or ''}: {'; '.join(cells)}".lstrip(": "))
    return " | ".join(parts)


def adaptive_estimators(rows: list[dict[str, Any]]) -> str:
    """Each auto row's tok/s over the fixed row (the first), per set."""
    fixed = rows[0]["sets"]
    cells = []
    for r in rows[1:]:
        ratios = [f"{SETS.get(n, n)} {_x((s['tokens'] / s['seconds']) / (fixed[n]['tokens'] / fixed[n]['seconds']))}"
                  for n, s in r["sets"].items()]
        cells.append(f"{r['row']}: {', '.join(ratios)}")
    return f"over {rows[0]['row']}: " + "; ".join(cells)


def spec_decode(rows: list[dict[str, Any]]) -> str:
    cells = []
    for dataset in dict.fromkeys(r["dataset"] for r in rows):
        mine = [r for r in rows if r["dataset"] == dataset and r["engine"] == "turbospec"]
        plain = next(r for r in mine if r["method"] == "plain")
        best = max(mine, key=lambda r: r["speedup"])
        cells.append(f"{SETS.get(dataset, dataset)} plain {plain['tok_s']:.1f} tok/s, best {best['method']} "
                     f"{_x(best['speedup'])}")
    return "; ".join(cells)


def weight_formats(rows: list[dict[str, Any]]) -> str:
    def rate(r: dict[str, Any], name: str) -> float:
        s = r["sets"].get(name) or {}
        return s["tokens"] / s["seconds"] if s.get("seconds") else 0.0

    single = [r for r in rows if "mt-bench" in r["sets"]]
    ours = [r for r in single if r["row"].startswith("turbospec")]
    best = max(ours, key=lambda r: rate(r, "mt-bench") + rate(r, "humaneval"))
    text = f"best turbospec row {best['row']} {rate(best, 'mt-bench'):.1f} / {rate(best, 'humaneval'):.1f} tok/s " \
           "(MT-Bench / HumanEval)"
    peer = next((r for r in single if r["row"] == "llama.cpp-plain"), None)
    if peer is not None:
        text += f", llama.cpp plain {rate(peer, 'mt-bench'):.1f} / {rate(peer, 'humaneval'):.1f}"
    conc = {r["row"]: rate(r, "concurrent-16") for r in rows if "concurrent-16" in r["sets"]}
    if conc:
        text += "; 16 concurrent: " + ", ".join(f"{k} {v:.1f}" for k, v in conc.items())
    return text


def adaptive_acceptance(rows: list[dict[str, Any]]) -> str:
    cells = [f"{r['row']} pass@1 {100 * r['pass_at_1']:.1f}, {_x(r['speedup_vs_target'])}"
             for r in rows if r.get("speedup_vs_target") is not None and r["row"] != "target"]
    return "over the target alone: " + "; ".join(cells)


def spec_ab(rows: list[dict[str, Any]]) -> str:
    plain = {r["set"]: r["tok_s"] for r in rows if r["mode"] == "0"}
    return "; ".join(f"{r['set']} k={r['mode']} {_x(r['tok_s'] / plain[r['set']])} of k=0"
                     for r in rows if r["mode"] != "0" and r["set"] in plain)


def plain_ab(data: dict[str, Any]) -> str:
    rounds = data["rounds"] if "rounds" in data else data["rows"]
    ratio = statistics.median(r["turbospec_tok_s"] / r["hf_tok_s"] for r in rounds)
    ours = statistics.median(r["turbospec_tok_s"] for r in rounds)
    return f"plain decode {ours:.1f} tok/s, {_x(ratio)} HF transformers (median of {len(rounds)} rounds)"


def engine_throughput(data: dict[str, Any]) -> str:
    cells = []
    for r in data["results"]:
        s = r.get("summary")
        if s and s.get("turbospec_tok_s"):
            cells.append(f"{r['model']} {r['dtype']} {s['turbospec_tok_s']:.1f} tok/s "
                         f"({_x(s['turbospec_over_hf'])} HF)")
    return "single stream: " + "; ".join(cells)


# benchmark -> what reads its rows (or, for the older shapes, its whole JSON)
ROWS: dict[str, Callable[[list[dict[str, Any]]], str]] = {
    "proposer_zoo": sets_rows, "head_ab": sets_rows, "adaptive_estimators": adaptive_estimators,
    "spec_decode": spec_decode, "weight_formats": weight_formats, "adaptive_acceptance": adaptive_acceptance,
    "spec_ab": spec_ab,
}
WHOLE: dict[str, Callable[[dict[str, Any]], str]] = {"plain_ab": plain_ab, "engine_throughput": engine_throughput}


def title(markdown: Path) -> str:
    """The result's markdown title (its first line, heading marks dropped)."""
    try:
        first = next((line for line in markdown.read_text().splitlines() if line.strip()), "")
    except OSError:
        return "-"
    return first.lstrip("# ").strip() or "-"


def headline(benchmark: str, data: dict[str, Any], markdown: Path) -> str:
    try:
        if benchmark in ROWS:
            return ROWS[benchmark](data["rows"])
        if benchmark in WHOLE:
            return WHOLE[benchmark](data)
    except (KeyError, TypeError, ValueError, ZeroDivisionError, IndexError, StopIteration):
        pass
    return title(markdown)
