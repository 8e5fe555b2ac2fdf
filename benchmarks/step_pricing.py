"""Does the step-time model price speculation as it runs? One request at a time, a fixed k against none.

For a workload of benchmarks/goodput_sweep.py, each prompt runs alone to the end under ``fixed-K`` and under
no speculation, rounds interleaved, on one engine holding the goodput controller's step-time model. Every step is
put in one kind (the prompt's prefill, a draft model's catch-up on it, a speculative step, a plain step) and its
measured time per part (target forward, draft, overhead) is set beside the model's prediction for the same
features. The last line is the one the controller decides on: the gain of k = K over none, measured and as the
model prices it (the sums of predictions over the same steps). Writes ``<out>.json`` and ``<out>.md``.

    .venv/bin/python benchmarks/step_pricing.py --workload b --prompts 3 --k 4          # the 0.5B draft
    .venv/bin/python benchmarks/step_pricing.py --workload a --prompts 1 --rounds 1 --max-tokens 8 \\
        --out /tmp/sp_test                                                                # smoke test
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from goodput_sweep import WORKLOADS, apply_policy, chat_ids, controlled, warm_up, workload_llm, workload_prompts
from harness import benchmark_meta, default_out, header_lines, save, table
from tqdm import tqdm

from turbospec import SamplingParams
from turbospec.control.step_time import PARTS, StepFeatures

def step_kind(f: StepFeatures) -> str:
    """One request's step: a draft model runs over k - 1 tokens of its own draft and the one or two tokens it has
    not seen; more than that is a catch-up on the prompt (GoodputController._catch_up_s draws the same line)."""
    if f.tokens > f.batch + f.spec_tokens:
        return "prefill"
    if f.draft_tokens > f.spec_tokens + 2:
        return "catch-up"
    return "speculative" if f.spec_tokens else "plain"


def run_alone(engine: Any, prompt: list[int], max_tokens: int, tag: str) -> dict[str, dict[str, Any]]:
    """One request to the end; per step kind: steps, measured and predicted seconds per part."""
    model = engine.speculation.controller.model
    kinds: dict[str, dict[str, Any]] = {}
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), request_id=tag)
    while engine.has_unfinished_requests():
        engine.step()
        sample = engine.last_sample
        if sample is None:
            continue
        k = kinds.setdefault(step_kind(sample.features), {"steps": 0, "measured_s": defaultdict(float),
                                                            "predicted_s": defaultdict(float)})
        k["steps"] += 1
        for part in PARTS:
            k["measured_s"][part] += sample.part(part)
            k["predicted_s"][part] += model.predict_part(part, sample.features)
    return kinds


def merge(runs: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for run in runs:
        for kind, k in run.items():
            m = out.setdefault(kind, {"steps": 0, "measured_s": defaultdict(float), "predicted_s": defaultdict(float)})
            m["steps"] += k["steps"]
            for part in PARTS:
                m["measured_s"][part] += k["measured_s"][part]
                m["predicted_s"][part] += k["predicted_s"][part]
    return {kind: {"steps": m["steps"], "measured_s": dict(m["measured_s"]), "predicted_s": dict(m["predicted_s"])}
            for kind, m in out.items()}


def total(kinds: dict[str, dict[str, Any]], which: str, skip: tuple[str, ...] = ()) -> float:
    return sum(sum(k[which].values()) for kind, k in kinds.items() if kind not in skip)


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]], gain: dict[str, float]) -> str:
    lines = ["# Speculation as the step-time model prices it, one request at a time", "", *header_lines(meta),
             f"- workload {meta['workload']} ({meta['target']}, {meta['method']}), {meta['prompts']} prompts alone, "
             f"{meta['max_tokens']} tokens each (ignore_eos), greedy, {meta['rounds']} interleaved rounds; "
             f"the controller's step-time model ({meta['profile']})",
             "- seconds summed over every step of a kind; measured / predicted per part", ""]
    lines += table(["policy", "step kind", "steps", "measured s", "predicted s", "predicted / measured",
                    *(f"{p} (meas / pred)" for p in PARTS)],
                   [[r["policy"], r["kind"], r["steps"], f"{r['measured']:.3f}", f"{r['predicted']:.3f}",
                     f"{r['predicted'] / r['measured']:.3f}" if r["measured"] else "-",
                     *(f"{r['measured_s'][p]:.3f} / {r['predicted_s'][p]:.3f}" for p in PARTS)] for r in rows])
    lines += ["", f"Gain of k = {meta['k']} over none in decode (prefill left out), measured "
              f"{gain['measured']:.3f}x, priced by the model {gain['predicted']:.3f}x; whole requests, measured "
              f"{gain['measured_with_prefill']:.3f}x."]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="b", choices=sorted(WORKLOADS))
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--k", type=int, default=4, help="the fixed draft length set against none")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=16, help="as goodput_sweep.py: the profile reaches it")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--out", default=None, help="default: benchmarks/results/step_pricing/step_pricing_<workload>")
    args = ap.parse_args(argv)
    for name in ("prompts", "k", "rounds", "max_tokens", "threads", "max_num_seqs"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    target, spec, *_ = WORKLOADS[args.workload]
    llm = workload_llm(target, controlled(spec, max(8, args.k)), args.threads, args.max_num_seqs, args.max_model_len)
    engine = llm.engine
    prompts = chat_ids(llm, workload_prompts(args.workload, args.prompts + 1))
    warm_up(engine, prompts[-1])
    apply_policy(engine, "adaptive")  # the controller's model: cached, or a brief profile now
    model = engine.speculation.controller.model
    engine.sample_steps = True  # step samples under fixed policies too
    policies = (f"fixed-{args.k}", "no-spec")
    runs: dict[str, list[dict[str, dict[str, Any]]]] = {p: [] for p in policies}
    with tqdm(total=args.rounds * len(policies) * args.prompts, unit="request") as bar:
        for round_ in range(args.rounds):
            for policy in policies if round_ % 2 == 0 else policies[::-1]:
                apply_policy(engine, policy)
                for i, prompt in enumerate(prompts[:args.prompts]):
                    runs[policy].append(run_alone(engine, prompt, args.max_tokens, f"{round_}-{policy}-{i}"))
                    bar.update()
    merged = {p: merge(r) for p, r in runs.items()}
    rows = [{"policy": p, "kind": kind, "steps": k["steps"], "measured_s": k["measured_s"],
             "predicted_s": k["predicted_s"], "measured": sum(k["measured_s"].values()),
             "predicted": sum(k["predicted_s"].values())}
            for p, kinds in merged.items() for kind, k in sorted(kinds.items())]
    spec_run, plain_run = merged[policies[0]], merged["no-spec"]
    gain = {"measured": total(plain_run, "measured_s", ("prefill",)) / total(spec_run, "measured_s", ("prefill",)),
            "predicted": total(plain_run, "predicted_s", ("prefill",)) / total(spec_run, "predicted_s", ("prefill",)),
            "measured_with_prefill": total(plain_run, "measured_s") / total(spec_run, "measured_s")}
    meta = benchmark_meta(args.threads, workload=args.workload, target=target, method=spec["method"],
                          prompts=args.prompts, k=args.k, rounds=args.rounds, max_tokens=args.max_tokens,
                          profile=f"profiled up to batch {model.max_profiled_batch}", gain=gain)
    out = Path(args.out) if args.out else default_out("step_pricing", f"step_pricing_{args.workload}")
    save(out, meta, rows, markdown(meta, rows, gain))


if __name__ == "__main__":
    main()
