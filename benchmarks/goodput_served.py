"""The goodput sweep through the real server: Poisson arrivals on the wall clock, streamed chat requests.

goodput_sweep.py drives the engine in process on a virtual clock (idle gaps skipped), which makes many rates
cheap. This script checks the same policies where users meet them: for every (repeat, rate, policy) a fresh
`turbospec serve` (no prefix cache carried from another run) and `turbospec bench serve` sending the data set's
prompts at that rate. Policies: no-spec (the same server, each request sending `"speculation": false`), fixed-k
and adaptive (the server's speculative config with that k or "auto"). Runs are interleaved (every policy at a
rate, then the next rate; then the whole again), so machine drift hits every policy alike. Latency: a request's
end-to-end time as the client saw it (queueing, HTTP and streaming included).

Writes <out>.json, <out>.md and <out>.png (mean / p99 latency and goodput against rate, as goodput_sweep.py),
and each run's bench and server output under <out>_runs/ (not committed).

    python benchmarks/goodput_served.py --workload b --rates 0.05,0.2,1 --num-prompts 16 --max-tokens 48 \\
        --policies no-spec,fixed-4,adaptive --repeats 2 --out benchmarks/results/goodput_sweep/goodput_served_b
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import goodput_sweep as gs  # noqa: E402
from harness import alternating  # noqa: E402
from serve_compare import TURBOSPEC, free_port, run_one, Target  # noqa: E402

from turbospec.bench.machine import machine_info  # noqa: E402
from turbospec.bench.serve_config import DATASETS  # noqa: E402


def server_command(workload: str, policy: str, port: int, threads: int) -> Target:
    target, spec, *_ = gs.WORKLOADS[workload]
    value = gs.policy_value(policy)
    config = {**spec, "num_speculative_tokens": "auto" if value in (0, "auto") else value,
              "max_speculative_tokens": gs.MAX_K}
    command = [TURBOSPEC, "serve", "--model", target, "--port", str(port), "--num-threads", str(threads),
               "--speculative-config", json.dumps(config), "--log-level", "warning"]
    return Target(policy, command, {"speculation": False} if value == 0 else {})


def row_from_rate(workload: str, policy: str, rate: float, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One (rate, policy) row in goodput_sweep's shape, pooling the repeats' requests."""
    requests = [{"index": q["index"], "latency": q["e2el_ms"] / 1e3, "ttft": q["ttft_ms"] / 1e3,
                 "output_tokens": q["output_tokens"]}
                for r in runs for q in r["requests"] if q["success"]]
    latency = [q["latency"] for q in requests]
    spec = [next(iter(r["speculation"].values()), None) if r.get("speculation") else None for r in runs]
    drafted = sum(s["draft_tokens"] for s in spec if s)
    accepted = sum(s["accepted_tokens"] for s in spec if s)
    return {
        "workload": workload, "policy": policy, "request_rate": rate, "num_requests": len(requests),
        "failed": sum(r["failed"] for r in runs),
        "mean_latency_s": float(np.mean(latency)), "p50_latency_s": float(np.percentile(latency, 50)),
        "p99_latency_s": float(np.percentile(latency, 99)), "mean_ttft_s": float(np.mean([q["ttft"] for q in requests])),
        "output_throughput_tok_s": float(np.mean([r["output_throughput"] for r in runs])),
        "mean_latency_runs_s": [float(np.mean([q["e2el_ms"] / 1e3 for q in r["requests"] if q["success"]]))
                                for r in runs],
        "draft_tokens_per_output_token": drafted / max(1, sum(r["total_output_tokens"] for r in runs)),
        "acceptance_rate": accepted / drafted if drafted else None,
        "virtual_s": float(np.mean([r["duration_s"] for r in runs])),  # wall seconds of one run (goodput's span)
        "mean_k": None, "requests": requests,
    }


def markdown(report: dict[str, Any]) -> str:
    m, cfg = report["machine"], report["config"]
    rows = report["rows"]
    policies, rates = cfg["policies"], sorted({r["request_rate"] for r in rows})
    target, spec, *_ = gs.WORKLOADS[cfg["workload"]]
    lines = ["# Goodput sweep through the real server", "",
             f"- command: `{report['command']}`",
             f"- machine: {m['cpu']}, {m['cpus']} CPUs, torch {m['torch']}, {cfg['threads']} threads",
             f"- date: {report['date']}, commit {m['commit']}",
             f"- workload {cfg['workload']}: `{target}`, {spec['method']}; {cfg['num_prompts']} {cfg['dataset']} "
             f"prompts per run, max {cfg['max_tokens']} new tokens, greedy, chat; {cfg['repeats']} interleaved runs "
             "per (rate, policy), each on a freshly started server",
             "- latency: end to end as the streaming client saw it (wall clock, queueing included)", "",
             "Mean latency (s), the runs' means in brackets:", "",
             "| rate (req/s) | " + " | ".join(policies) + " |", "|---|" + "---|" * len(policies)]
    for rate in rates:
        cells = []
        for p in policies:
            r = gs.find(rows, cfg["workload"], rate, p)
            cells.append("-" if r is None else f"{r['mean_latency_s']:.2f} ("
                         + ", ".join(f"{x:.2f}" for x in r["mean_latency_runs_s"]) + ")")
        lines.append(f"| {rate:g} | " + " | ".join(cells) + " |")
    lines += ["", "| rate | policy | mean latency (s) | p99 latency (s) | mean TTFT (s) | throughput (tok/s) | "
              "draft tokens per output token | acceptance | failed |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["request_rate"], policies.index(r["policy"]))):
        lines.append(f"| {r['request_rate']:g} | {r['policy']} | {r['mean_latency_s']:.2f} | {r['p99_latency_s']:.2f} | "
                     f"{r['mean_ttft_s']:.2f} | {r['output_throughput_tok_s']:.1f} | "
                     f"{r['draft_tokens_per_output_token']:.2f} | {gs.fmt(r['acceptance_rate'])} | {r['failed']} |")
    lines += ["", *gs.claims_markdown(report["claims"].get(cfg["workload"], {})), ""]
    if report.get("plots"):
        lines += ["## Plots", "", *[f"- `{p}`" for p in report["plots"]], ""]
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="b", choices=list(gs.WORKLOADS))
    ap.add_argument("--dataset", default=None, choices=DATASETS,
                    help="default: the workload's own (a, d: mixed; b, c: humaneval), as goodput_sweep.py sends")
    ap.add_argument("--rates", type=gs.float_list, default=gs.float_list("0.05,0.2,1"), help="req/s, comma list")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--policies", type=gs.str_list, default=["no-spec", "fixed-2", "fixed-4", "adaptive"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/goodput_sweep/goodput_served")
    args = ap.parse_args()
    args.dataset = args.dataset or gs.WORKLOADS[args.workload][2]
    if not args.rates or min(args.rates) <= 0:
        ap.error("--rates: give at least one rate, each > 0 req/s (a high rate sends everything at once)")
    for what in ("num_prompts", "max_tokens", "repeats", "threads"):
        if getattr(args, what) < 1:
            ap.error(f"--{what.replace('_', '-')} must be >= 1")
    for policy in args.policies:
        try:
            gs.policy_value(policy)
        except ValueError as exc:
            ap.error(str(exc))
    return args


def main() -> int:
    args = parse_args()
    out = Path(args.out)
    runs_dir = out.with_name(out.name + "_runs")
    runs_dir.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    bench = argparse.Namespace(dataset=args.dataset, num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                               seed=args.seed, concurrency=False, goodput="e2el:600000")
    results: dict[tuple[float, str], list[dict[str, Any]]] = {}
    total, done = args.repeats * len(args.rates) * len(args.policies), 0
    for repeat in range(args.repeats):
        for rate in args.rates:
            for policy in alternating(args.policies, repeat):
                done += 1
                target = server_command(args.workload, policy, free_port(), args.threads)
                result = run_one(bench, target, f"{rate:g}", runs_dir / f"r{repeat}-{rate:g}-{policy}")
                results.setdefault((rate, policy), []).extend(result["rates"])
                r = result["rates"][0]
                gs.log(f"[{done}/{total}] rate {rate:g} {policy}: mean e2el {r['e2el_ms']['mean'] / 1e3:.2f} s, "
                       f"{r['completed']} completed, {r['failed']} failed"
                       + (f"; {result['stopped']}" if result.get("stopped") else ""))
    rows = [row_from_rate(args.workload, policy, rate, runs) for (rate, policy), runs in results.items()]
    report = {"machine": machine_info(args.threads), "command": " ".join(["python", *sys.argv]), "date": started,
              "config": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows,
              "claims": gs.claims(rows)}
    try:
        import matplotlib

        matplotlib.use("Agg")
        gs.plot_workload(rows, args.workload, out.with_suffix(".png"))
        report["plots"] = [out.with_suffix(".png").name]
    except ImportError:
        gs.log("no matplotlib: no plot (pip install matplotlib)")
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
