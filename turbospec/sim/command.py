"""``turbospec simulate``: flags, their validation, and the table it prints.

Every bad value raises ValueError naming the flag and what is allowed; the CLI turns that into exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from ..config import check_positive, int_list
from ..data.arrivals import parse_rates
from ..host import turbospec_home
from .draft_outcomes import AcceptanceModel, PositionRates, TraceReplay, load_trace, rates_from_trace
from .replica import SpecPolicy
from .router import ROUTERS
from .simulator import Deployment, simulate
from .step_cost import (H200, SHAPES, RooflineAssumptions, StepCost, StepOverhead, find_profiles, load_profile,
                        mean_level, profile_for_key, roofline_model)
from .workload import Lengths, SimRequest, fixed_lengths, load_recorded, sharegpt_lengths, with_arrivals

DATASETS = ("sharegpt", "mtbench", "fixed")


def add_arguments(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("traffic")
    w.add_argument("--requests", default=None, metavar="JSON",
                   help="a recorded run: requests with arrival_s, prompt_tokens, output_tokens (replaces the "
                        "data set and the rates)")
    w.add_argument("--dataset", default="sharegpt", help=f"one of {', '.join(DATASETS)} (default %(default)s)")
    w.add_argument("--num-prompts", type=int, default=1000, help="requests per rate (default %(default)s)")
    w.add_argument("--input-len", type=int, default=256, help="--dataset fixed: prompt tokens")
    w.add_argument("--output-len", type=int, default=128, help="--dataset fixed: output tokens")
    w.add_argument("--max-tokens", type=int, default=1024,
                   help="cap on output tokens (ShareGPT replies; MT-Bench outputs are exactly this)")
    w.add_argument("--request-rate", default="1", help="comma-separated requests/s, or inf (default %(default)s)")
    w.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps: 1 = Poisson")
    w.add_argument("--seed", type=int, default=0)
    t = p.add_argument_group("step time (give one)")
    t.add_argument("--profile", default=None, metavar="JSON", help="a step-time profile file (turbospec profile)")
    t.add_argument("--profile-key", default=None, metavar="JSON",
                   help="the engine's profile key (the \"key\" object of a profile), looked up in the cache")
    t.add_argument("--profile-model", default=None, metavar="NAME",
                   help="the newest cached profile of this model (turbospec profile --model NAME)")
    t.add_argument("--roofline", default=None, metavar="SHAPE",
                   help=f"a roofline estimate on an H200 (not measured), shape one of {', '.join(SHAPES)}")
    t.add_argument("--step-overhead-ms", type=float, default=0.0, help="added to every step (serving loop)")
    t.add_argument("--request-overhead-ms", type=float, default=0.0, help="added per request in a step")
    t.add_argument("--step-time-scale", type=float, default=1.0,
                   help="multiplies the model's step times (a machine slower or faster than the profiled one)")
    s = p.add_argument_group("speculation")
    s.add_argument("--speculation", default="off", help="off, a fixed k >= 1, or auto (the goodput controller)")
    s.add_argument("--k-max", type=int, default=8, help="auto: the most drafts per request and step")
    s.add_argument("--proposer", default="ngram", choices=["ngram", "draft"],
                   help="ngram: free proposals (the controller chooses how many to verify); draft: a draft model")
    s.add_argument("--acceptance-trace", default=None, metavar="JSON",
                   help="[request_id, drafts, accepted] records (engine.speculation.verify_trace); per-position rates are "
                        "estimated from them")
    s.add_argument("--replay", action="store_true",
                   help="replay each request's own records in order (the trace's request ids must be the "
                        "requests' ids, as with --requests from the same run)")
    s.add_argument("--acceptance-rates", default=None, metavar="A1,A2,..",
                   help="conditional acceptance per draft position (the last one repeats)")
    s.add_argument("--proposal-share", type=float, default=1.0,
                   help="with --acceptance-rates: share of steps the proposer offers drafts (default 1)")
    d = p.add_argument_group("deployment")
    d.add_argument("--replicas", default="1", help="replica count(s), comma-separated, e.g. 1,2,4")
    d.add_argument("--router", default="round-robin", help=f"one of {', '.join(ROUTERS)}")
    d.add_argument("--max-num-seqs", type=int, default=32)
    d.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--output", default=None, metavar="PREFIX", help="write PREFIX.json")


def step_cost(args: argparse.Namespace) -> StepCost:
    given = [f for f in ("profile", "profile_key", "profile_model", "roofline") if getattr(args, f)]
    if len(given) != 1:
        raise ValueError("give exactly one of --profile, --profile-key, --profile-model or --roofline "
                         f"(got {len(given) or 'none'})")
    for flag in ("step_overhead_ms", "request_overhead_ms"):
        if not (math.isfinite(getattr(args, flag)) and getattr(args, flag) >= 0):
            raise ValueError(f"--{flag.replace('_', '-')} must be a number >= 0, got {getattr(args, flag)}")
    if not (math.isfinite(args.step_time_scale) and args.step_time_scale > 0):
        raise ValueError(f"--step-time-scale must be a number > 0, got {args.step_time_scale}")
    overhead = StepOverhead(args.step_overhead_ms / 1e3, args.request_overhead_ms / 1e3, args.step_time_scale)
    if args.roofline:
        if args.roofline not in SHAPES:
            raise ValueError(f"--roofline must be one of {', '.join(SHAPES)}, got {args.roofline!r}")
        return StepCost(roofline_model(SHAPES[args.roofline], H200, RooflineAssumptions()), overhead,
                        f"roofline estimate, not measured ({args.roofline} on H200)")
    if args.profile_key:
        try:
            key = json.loads(args.profile_key)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--profile-key is not valid JSON ({exc})") from None
        path = profile_for_key(key)
        if not path.exists():
            raise ValueError(f"--profile-key: no cached profile {path}; run `turbospec profile` for that engine")
    elif args.profile_model:
        found = find_profiles(turbospec_home() / "profiles", args.profile_model)
        if not found:
            raise ValueError(f"--profile-model {args.profile_model}: no cached profile; run `turbospec profile "
                             f"--model {args.profile_model}` or give --profile PATH")
        path = found[0]
    else:
        path = Path(args.profile)
    model = load_profile(path)
    level = mean_level(model, model.samples)  # the profile's fit is relative-error; latencies need the mean
    return StepCost(model, dataclasses.replace(overhead, scale=overhead.scale * level),
                    f"{path} (mean level x{level:.3f})")


def acceptance_model(args: argparse.Namespace) -> AcceptanceModel | None:
    if args.acceptance_trace and args.acceptance_rates:
        raise ValueError("give --acceptance-trace or --acceptance-rates, not both")
    if not 0.0 <= args.proposal_share <= 1.0:
        raise ValueError(f"--proposal-share must be in [0, 1], got {args.proposal_share}")
    if args.replay and not args.acceptance_trace:
        raise ValueError("--replay needs --acceptance-trace")
    if args.acceptance_trace:
        records = load_trace(args.acceptance_trace)
        rates = rates_from_trace(records)
        return TraceReplay(records, rates) if args.replay else rates
    if args.acceptance_rates:
        try:
            rates = tuple(float(a) for a in args.acceptance_rates.split(","))
        except ValueError:
            raise ValueError(f"--acceptance-rates must be comma-separated numbers in [0, 1], got "
                             f"{args.acceptance_rates!r}") from None
        return PositionRates(rates, args.proposal_share)
    return None


def policy(args: argparse.Namespace, has_acceptance: bool) -> SpecPolicy:
    value = args.speculation
    check_positive("--k-max", args.k_max)
    if value == "off":
        return SpecPolicy()
    if value == "auto":
        mode, k = "auto", args.k_max
    else:
        try:
            k = int(value)
        except ValueError:
            raise ValueError(f"--speculation must be off, a fixed k >= 1 or auto, got {value!r}") from None
        if k < 1:
            raise ValueError(f"--speculation must be off, a fixed k >= 1 or auto, got {value!r}")
        mode = "fixed"
    if not has_acceptance:
        raise ValueError("--speculation needs --acceptance-trace or --acceptance-rates (how many drafts are kept)")
    return SpecPolicy(mode, k, free_proposals=args.proposer == "ngram")


def traffic(args: argparse.Namespace) -> list[tuple[str, list[SimRequest]]]:
    """(label, requests) per rate; a recorded run is one entry."""
    if args.requests:
        return [("recorded", load_recorded(args.requests))]
    if args.dataset not in DATASETS:
        raise ValueError(f"--dataset must be one of {', '.join(DATASETS)}, got {args.dataset!r}")
    for flag in ("num_prompts", "input_len", "output_len", "max_tokens"):
        check_positive("--" + flag.replace("_", "-"), getattr(args, flag))
    if not (math.isfinite(args.burstiness) and args.burstiness > 0):
        raise ValueError(f"--burstiness must be a finite number > 0 (1.0 = Poisson), got {args.burstiness}")
    n = args.num_prompts
    lengths: list[Lengths]
    if args.dataset == "fixed":
        lengths = fixed_lengths(n, args.input_len, args.output_len)
    elif args.dataset == "sharegpt":
        lengths = sharegpt_lengths(n, max_output=args.max_tokens)
    else:
        from ..data.prompts import load_mtbench
        from .workload import CHARS_PER_TOKEN

        try:
            prompts = load_mtbench(n)
        except RuntimeError as exc:
            raise ValueError(f"--dataset mtbench: {exc}") from None
        lengths = [Lengths(max(1, math.ceil(len(q.text) / CHARS_PER_TOKEN)), args.max_tokens)
                   for q in (prompts[i % len(prompts)] for i in range(n))]
    rates = parse_rates(args.request_rate)
    return [(str(r), with_arrivals(lengths, r, args.burstiness, args.seed)) for r in rates]


def run(args: argparse.Namespace) -> int:
    if args.router not in ROUTERS:
        raise ValueError(f"--router must be one of {', '.join(ROUTERS)}, got {args.router!r}")
    check_positive("--max-num-seqs", args.max_num_seqs)
    check_positive("--max-num-batched-tokens", args.max_num_batched_tokens)
    counts = int_list("--replicas", args.replicas)
    cost = step_cost(args)
    acceptance = acceptance_model(args)
    spec = policy(args, acceptance is not None)
    runs = traffic(args)
    results: list[dict[str, Any]] = []
    print(f"step time: {cost.source}")
    print("| rate | replicas | TTFT mean / p50 / p99 ms | TPOT mean / p50 / p99 ms | E2EL mean / p50 / p99 ms | "
          "req/s | out tok/s |")
    print("|---|---|---|---|---|---|---|")
    for label, requests in runs:
        for count in counts:
            if isinstance(acceptance, TraceReplay):  # each run replays the records from their start
                acceptance = acceptance_model(args)
            deployment = Deployment(count, args.router, args.max_num_seqs, args.max_num_batched_tokens, spec,
                                    args.seed)
            res = simulate(requests, cost, acceptance, deployment)
            s = res.summary
            print(f"| {label} | {count} | {_three(s['ttft_ms'])} | {_three(s['tpot_ms'])} | {_three(s['e2el_ms'])} | "
                  f"{s['request_throughput']:.2f} | {s['output_throughput']:.0f} |")
            results.append({"rate": label, "replicas": count, **s, "per_replica": res.per_replica()})
    if args.output:
        path = Path(args.output + ".json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"step_time": cost.source, "speculation": args.speculation,
                                    "router": args.router, "results": results}, indent=1))
        print(f"wrote {path}")
    return 0


def _three(stats: dict[str, float | None]) -> str:
    if stats["mean"] is None:
        return "-"
    return f"{stats['mean']:.1f} / {stats['median']:.1f} / {stats['p99']:.1f}"
