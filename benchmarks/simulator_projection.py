"""Project a large deployment with ``turbospec simulate``'s engine: how many replicas serve 1,000 requests/s of
ShareGPT-like traffic within a p99 latency SLO, and latency vs replica count.

    PYTHONPATH=$PWD python benchmarks/simulator_projection.py                       # roofline estimate
    PYTHONPATH=$PWD python benchmarks/simulator_projection.py --profile GPU.json     # a measured profile

No GPU was available where this was written, so by default the step times are a ROOFLINE ESTIMATE, NOT
MEASURED (turbospec/sim/step_cost.py, roofline_model): Llama-3-8B shapes in bf16 on an H200 (4.8 TB/s HBM,
989 TFLOP/s dense bf16), linear layers max(weight bytes / bandwidth, 2 x params x tokens / FLOP/s), KV reads
and attention math added, scaled by stated efficiencies (75% of peak bandwidth, 50% of peak FLOP/s) plus a
stated 2 ms per step and 10 us per request of overhead. Rerun with a profile measured on the GPU
(`turbospec profile --model ... ` on the GPU machine, then --profile PATH) before relying on the numbers.

Traffic: ShareGPT conversations (first human turn -> its reply) cycled, lengths in tokens estimated as
characters / 4, prompts capped at 2,048 and outputs at 1,024 tokens, Poisson arrivals. Latencies are taken
over the requests that arrive in the middle of the run (after the replicas have filled, before arrivals stop).

Writes benchmarks/results/simulator_projection/simulator_projection.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from turbospec.sim.draft_outcomes import rates_from_trace
from turbospec.sim.metrics import run_summary
from turbospec.sim.replica import SpecPolicy
from turbospec.sim.simulator import Deployment, simulate
from turbospec.sim.step_cost import H200, SHAPES, RooflineAssumptions, StepCost, load_profile, roofline_model
from turbospec.sim.workload import sharegpt_lengths, with_arrivals

RESULTS = Path(__file__).resolve().parent / "results"
LABEL = "roofline estimate, not measured; rerun with a profile measured on a GPU"


def window_summary(result: Any, start: float, end: float) -> dict[str, Any]:
    times = [t for t in result.times if start <= t.arrival_s < end]
    summary = run_summary(times, 0)
    summary["request_throughput"] = result.summary["request_throughput"]  # of the whole run
    summary["output_throughput"] = result.summary["output_throughput"]
    summary.pop("total_input_tokens")
    return summary


def meets(summary: dict[str, Any], slo: dict[str, float]) -> bool:
    return all(summary[f"{metric}_ms"]["p99"] <= limit for metric, limit in slo.items())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--profile", default=None, help="a step-time profile measured on the GPU (replaces the roofline)")
    p.add_argument("--shape", default="Llama-3-8B", choices=sorted(SHAPES))
    p.add_argument("--rate", type=float, default=1000.0, help="requests/s into the whole deployment")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals")
    p.add_argument("--replicas", default="12,16,20,21,22,23,24,28")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--acceptance-from", default=str(RESULTS / "simulator_validation" / "simulator_validation.json"),
                   help="speculation scenario: n-gram acceptance pooled from the traces recorded there (a stand-in "
                        "measured on smollm2-135m, not on the projected model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "simulator_projection" / "simulator_projection"))
    args = p.parse_args()
    t0 = time.time()
    assumptions = RooflineAssumptions()
    if args.profile:
        cost = StepCost(load_profile(args.profile), source=f"measured profile {args.profile}")
    else:
        cost = StepCost(roofline_model(SHAPES[args.shape], H200, assumptions), source=LABEL)
    n = int(args.rate * args.duration)
    lengths = sharegpt_lengths(n, max_prompt=2048, max_output=1024)
    requests = with_arrivals(lengths, args.rate, seed=args.seed)
    window = (args.duration * 0.25, args.duration * 0.75)
    slo = {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms}
    counts = [int(c) for c in args.replicas.split(",")]
    rows: list[dict[str, Any]] = []
    for router in ("fewest-tokens", "round-robin"):
        for count in counts:
            deployment = Deployment(count, router, args.max_num_seqs, args.max_num_batched_tokens, seed=args.seed)
            res = simulate(requests, cost, None, deployment)
            s = window_summary(res, *window)
            util = [r["utilisation"] for r in res.per_replica()]
            rows.append({"router": router, "replicas": count, "speculation": "off", **s,
                         "mean_utilisation": sum(util) / len(util), "meets_slo": meets(s, slo)})
            print(f"{router:13s} {count:3d} replicas: p99 TTFT {s['ttft_ms']['p99']:8.0f} ms, p99 TPOT "
                  f"{s['tpot_ms']['p99']:6.1f} ms, p99 E2EL {s['e2el_ms']['p99']:8.0f} ms", flush=True)
    best = min((r["replicas"] for r in rows if r["router"] == "fewest-tokens" and r["meets_slo"]), default=None)
    spec_rows = []
    if best is not None:  # does the goodput controller change the count? (acceptance: a stated stand-in)
        runs = json.loads(Path(args.acceptance_from).read_text())["runs"]
        rates = rates_from_trace([(str(r[0]), int(r[1]), int(r[2])) for run in runs for r in run["trace"]])
        for count in sorted({max(1, best - 2), max(1, best - 1), best}):
            deployment = Deployment(count, "fewest-tokens", args.max_num_seqs, args.max_num_batched_tokens,
                                    SpecPolicy("auto", 4), args.seed)
            res = simulate(requests, cost, rates, deployment)
            s = window_summary(res, *window)
            spec_rows.append({"router": "fewest-tokens", "replicas": count, "speculation": "auto (n-gram)", **s,
                              "meets_slo": meets(s, slo)})
            print(f"auto n-gram   {count:3d} replicas: p99 TTFT {s['ttft_ms']['p99']:8.0f} ms, p99 TPOT "
                  f"{s['tpot_ms']['p99']:6.1f} ms, p99 E2EL {s['e2el_ms']['p99']:8.0f} ms", flush=True)
    result = {
        "command": "PYTHONPATH=$PWD python benchmarks/simulator_projection.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "step_time": cost.source, "measured": bool(args.profile),
        "roofline": None if args.profile else {"shape": asdict(SHAPES[args.shape]), "accelerator": asdict(H200),
                                               "assumptions": asdict(assumptions), "label": LABEL,
                                               "parts": {k: {"columns": v.columns, "coef": v.coef}
                                                         for k, v in cost.model.parts.items()}},
        "traffic": {"rate": args.rate, "duration_s": args.duration, "requests": n, "window_s": window,
                    "mean_prompt_tokens": sum(ln.prompt_tokens for ln in lengths) / n,
                    "mean_output_tokens": sum(ln.output_tokens for ln in lengths) / n,
                    "lengths": "ShareGPT, characters / 4, prompt <= 2048, output <= 1024"},
        "engine": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens},
        "slo_p99_ms": slo, "replicas_needed": best, "rows": rows, "speculation_rows": spec_rows,
        "acceptance_stand_in": {"source": args.acceptance_from, **(asdict(rates) if best is not None else {})},
        "seconds": time.time() - t0,
    }
    write(result, Path(args.out))
    return 0


def write(result: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    t = result["traffic"]
    label = "measured profile" if result["measured"] else f"**{LABEL}**"
    lines = [f"# Projection: {t['rate']:.0f} requests/s of ShareGPT-like traffic", "",
             f"`{result['command']}` on {result['date']}. Step times: {label}"
             + ("" if result["measured"] else
                f" ({result['roofline']['shape']['name']} bf16 on {result['roofline']['accelerator']['name']}: "
                f"assumptions {result['roofline']['assumptions']})") + ".", "",
             f"{t['requests']} requests over {t['duration_s']:.0f} s (mean prompt {t['mean_prompt_tokens']:.0f}, "
             f"mean output {t['mean_output_tokens']:.0f} tokens; {t['lengths']}); latencies of the requests arriving "
             f"in {t['window_s'][0]:.1f}-{t['window_s'][1]:.1f} s. Per replica: max_num_seqs "
             f"{result['engine']['max_num_seqs']}, max_num_batched_tokens "
             f"{result['engine']['max_num_batched_tokens']}.",
             "", f"SLO: p99 TTFT <= {result['slo_p99_ms']['ttft']:.0f} ms and p99 TPOT <= "
             f"{result['slo_p99_ms']['tpot']:.0f} ms. **Replicas needed (fewest-tokens routing, no speculation): "
             f"{result['replicas_needed']}** ({label}).", "",
             "| router | speculation | replicas | TTFT p50 / p99 ms | TPOT p50 / p99 ms | E2EL mean / p99 ms | "
             "utilisation | SLO |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"] + result["speculation_rows"]:
        util = f"{r['mean_utilisation'] * 100:.0f}%" if "mean_utilisation" in r else "-"
        lines.append(f"| {r['router']} | {r['speculation']} | {r['replicas']} | {r['ttft_ms']['median']:.0f} / "
                     f"{r['ttft_ms']['p99']:.0f} | {r['tpot_ms']['median']:.1f} / {r['tpot_ms']['p99']:.1f} | "
                     f"{r['e2el_ms']['mean']:.0f} / {r['e2el_ms']['p99']:.0f} | {util} | "
                     f"{'yes' if r['meets_slo'] else 'no'} |")
    lines += ["", "utilisation: the share of the run a replica spent running steps (busy time, not FLOP efficiency)."]
    if result["speculation_rows"]:
        a = result["acceptance_stand_in"]
        lines += ["", "Speculation rows: the goodput controller (k <= 4) with n-gram acceptance "
                      + ", ".join(f"{x:.2f}" for x in a["rates"]) + f" per position and proposals on "
                      f"{a['proposal_share']:.0%} of decoding steps, pooled from the traces recorded in "
                      f"`{Path(a['source']).name}`: a stand-in measured on smollm2-135m (CPU), not on the projected "
                      "model."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, metric, limit in zip(axes, ("ttft_ms", "tpot_ms", "e2el_ms"),
                                 (result["slo_p99_ms"]["ttft"], result["slo_p99_ms"]["tpot"], None)):
        for router, style in (("fewest-tokens", "o-"), ("round-robin", "s--")):
            rows = [r for r in result["rows"] if r["router"] == router]
            ax.plot([r["replicas"] for r in rows], [r[metric]["p99"] for r in rows], style, label=f"p99, {router}")
        rows = [r for r in result["rows"] if r["router"] == "fewest-tokens"]
        ax.plot([r["replicas"] for r in rows], [r[metric]["median"] for r in rows], "^:", label="p50, fewest-tokens")
        if limit:
            ax.axhline(limit, color="red", linewidth=0.8, label="SLO")
        ax.set_yscale("log")
        ax.set_xlabel("replicas")
        ax.set_ylabel(metric.replace("_ms", " (ms)").upper())
        ax.legend(fontsize=7)
    fig.suptitle(f"{t['rate']:.0f} req/s ShareGPT-like: latency vs replicas ("
                 + ("measured profile" if result["measured"] else LABEL) + ")", fontsize=9)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    sys.exit(main())
