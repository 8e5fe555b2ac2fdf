"""A/B of one compiled kernel source against its version at an earlier git revision.

Two builds register the same torch operators, so they cannot share a process: each variant runs in its own
process (`script --worker SOURCE`), which swaps that one source into the kernel build and prints a JSON line
{"op_ms": {measurement: ms}, "decode_step_ms": {measurement: ms}}. Rounds alternate the order (A B, B A, ...), so
machine drift between rounds cannot decide the comparison; the table gives each measurement's median over rounds.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

from .turns import alternating


def use_source(source: str | Path) -> None:
    """In a worker: build the kernels with `source` in place of the current file of the same name."""
    from turbospec import kernels

    source = Path(source)
    kernels.SOURCES = [source, *(p for p in kernels.SOURCES if p.name != source.name)]
    if kernels.load() is None:
        raise SystemExit(f"kernel build failed: {kernels.failure()}")


def run_rounds(script: str, source: Path, baseline: str, rounds: int, worker_args: list[str]) -> dict[str, list[dict]]:
    """Each round runs the baseline's and the current source's worker once, in alternating order."""
    folder = Path(tempfile.mkdtemp(prefix="kernel_ab_"))
    # the baseline's source, next to the baseline's headers that it includes from its own folder
    for path in [source, *source.parent.glob("*.h")]:
        old = subprocess.run(["git", "show", f"{baseline}:{path}"], capture_output=True, text=True)
        if old.returncode == 0:
            (folder / path.name).write_text(old.stdout)
    tmp = folder / source.name
    variants = {f"baseline ({baseline})": str(tmp), "current": str(source.resolve())}
    results: dict[str, list[dict]] = {name: [] for name in variants}
    for r in range(rounds):
        for name in alternating(list(variants), r):
            out = subprocess.run([sys.executable, script, "--worker", variants[name], *worker_args],
                                 capture_output=True, text=True, check=True)
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            steps = ", ".join(f"{k} {v:.1f} ms" for k, v in results[name][-1]["decode_step_ms"].items())
            print(f"round {r} {name}: {steps}", flush=True)
    return results


def medians(results: dict[str, list[dict]]) -> dict[str, dict[str, tuple[float, float]]]:
    """{part: {measurement: (baseline, current)}}, each the median over rounds."""
    base, cur = results.values()
    return {part: {key: (statistics.median(run[part][key] for run in base),
                         statistics.median(run[part][key] for run in cur)) for key in base[0][part]}
            for part in ("op_ms", "decode_step_ms")}


def table_lines(results: dict[str, list[dict]]) -> list[str]:
    """| measurement | baseline ms | current ms | baseline / current |, the medians over rounds."""
    lines = ["| measurement | baseline ms | current ms | baseline / current |", "|---|---|---|---|"]
    for part in medians(results).values():
        lines += [f"| {key} | {b:.3f} | {c:.3f} | {b / c:.2f}x |" for key, (b, c) in part.items()]
    return lines


def main(script: str, source: Path, worker: Callable[[str, int, int], dict], title: str, default_baseline: str,
         benchmark: str, model: str, notes: tuple[str, ...] = ()) -> None:
    """A kernel A/B script's command line: `--worker SOURCE` runs one variant in this process (worker(source,
    threads, steps) -> its JSON line); otherwise the alternating rounds, the table and the saved result."""
    import argparse
    import os

    from .output import default_out, save
    from .provenance import benchmark_meta, header_lines

    ap = argparse.ArgumentParser(description=title)
    ap.add_argument("--baseline", default=default_baseline, help="git revision whose kernel source is the A side")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--steps", type=int, default=24, help="decode steps timed per measurement and round")
    ap.add_argument("--out", default=str(default_out(benchmark)))
    ap.add_argument("--worker", metavar="SOURCE", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.threads, args.steps)))
        return
    results = run_rounds(script, source, args.baseline, args.rounds,
                         ["--threads", str(args.threads), "--steps", str(args.steps)])
    speedups = {part: {key: b / c for key, (b, c) in values.items()} for part, values in medians(results).items()}
    meta = benchmark_meta(args.threads, model=model, baseline=args.baseline, rounds=args.rounds, speedups=speedups)
    lines = [f"# {title}", "", *header_lines(meta),
             f"- medians over {args.rounds} alternating rounds (the order reversed every round), each variant built "
             "from its own source in its own process; op times are each round's median of repeated calls",
             *notes, "", *table_lines(results)]
    save(Path(args.out), meta, [results], "\n".join(lines) + "\n")
