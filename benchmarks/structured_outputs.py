"""Structured outputs: 200 JSON-schema requests with every proposer, and what the grammar costs.

Validity (--validity-model, float32 so greedy ties do not move with the batch): the 200 (schema, prompt) pairs of
data/json_schemas.py, chat template, greedy, --validity-max-tokens, in batches of --batch; for no speculation,
n-gram, a draft model and EAGLE: answers that parse, that validate with `jsonschema` (numbers read as decimals, so
multipleOf is exact), and how many are token for token those of no speculation.

Cost (--model, its default weights): --requests of the pairs, one at a time and 16 at once, each proposer with and
without the schema (the same prompts): tok/s, the grammar's share of the run's wall time (masks for every
verification row, draft checks, advancing: `grammar_seconds`), drafts cut and tokens forced, and each proposer's
speed-up over plain constrained decoding. Rows alternate order between the two turns of each batch size.

    python benchmarks/structured_outputs.py
"""

from __future__ import annotations

import argparse
import json
import time
from decimal import Decimal
from typing import Any

import jsonschema
from data.json_schemas import SchemaCase, requests
from harness import benchmark_meta, default_out, header_lines, save, stats, table
from tqdm import tqdm

from turbospec import LLM, SamplingParams
from turbospec.structured.params import StructuredOutputsParams

VALIDITY_SPECS: dict[str, dict[str, Any] | None] = {
    "off": None,
    "n-gram k=4": {"method": "ngram", "num_speculative_tokens": 4},
    "draft (self) k=3": {"method": "draft", "model": "{model}", "num_speculative_tokens": 3},
    "EAGLE k=4": {"method": "eagle", "num_speculative_tokens": 4},
}
COST_SPECS: dict[str, dict[str, Any] | None] = {
    "off": None,
    "n-gram k=4": {"method": "ngram", "num_speculative_tokens": 4},
    "draft 0.5B k=4": {"method": "draft", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 4},
    "EAGLE k=4": {"method": "eagle", "num_speculative_tokens": 4},
    "EAGLE under the controller": {"method": "eagle"},
    "n-gram under the controller": {"method": "ngram"},
}


def conversation(case: SchemaCase, prompt: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "Answer with JSON only."}, {"role": "user", "content": prompt}]


def params(case: SchemaCase | None, max_tokens: int) -> SamplingParams:
    ask = None if case is None else StructuredOutputsParams(json=case.schema)
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=ask)


def spec_for(spec: dict[str, Any] | None, model: str) -> dict[str, Any] | None:
    return None if spec is None else {k: (v.format(model=model) if isinstance(v, str) else v) for k, v in spec.items()}


def exact_validator(case: SchemaCase) -> jsonschema.Draft202012Validator:
    """A validator whose numbers are decimals, for answers parsed with parse_float=Decimal: with floats,
    jsonschema's multipleOf 0.01 refuses one cent value in nine (0.07 / 0.01 = 7.000000000000001)."""
    return jsonschema.Draft202012Validator(json.loads(json.dumps(case.schema), parse_float=Decimal))


def validity(model: str, threads: int, batch: int, max_tokens: int, count: int,
             proposers: list[str]) -> list[dict[str, Any]]:
    pairs = requests()[:count]
    rows, reference = [], None
    for name in proposers:  # (the first is the reference of "identical to")
        spec = VALIDITY_SPECS[name]
        llm = LLM(model, dtype="float32", num_threads=threads, speculative_config=spec_for(spec, model), progress=False)
        outs, start = [], time.perf_counter()
        for i in tqdm(range(0, len(pairs), batch), desc=f"validity {name}", unit="batch"):
            chunk = pairs[i: i + batch]
            outs += llm.chat([conversation(c, p) for c, p in chunk], [params(c, max_tokens) for c, _ in chunk],
                             use_tqdm=False)
        seconds = time.perf_counter() - start
        parsed = valid = 0
        invalid: list[dict[str, str]] = []
        for (case, _), out in zip(pairs, outs):
            text = out.outputs[0].text
            try:
                value = json.loads(text, parse_float=Decimal)
            except json.JSONDecodeError:
                continue
            parsed += 1
            if exact_validator(case).is_valid(value):
                valid += 1
            else:
                invalid.append({"schema": case.name, "text": text})
        tokens = [o.outputs[0].token_ids for o in outs]
        reference = reference or tokens
        s = llm.spec_stats()
        rows.append({"part": "validity", "model": model, "proposer": name, "requests": len(pairs),
                     "parsed": parsed, "valid": valid, "finished": sum(o.outputs[0].finish_reason == "stop" for o in outs),
                     "identical_to_off": sum(a == b for a, b in zip(tokens, reference)),
                     "tokens": sum(map(len, tokens)), "seconds": seconds, "tau": stats.tau(s),
                     "grammar_cuts": s["num_grammar_cuts"], "forced_tokens": s["num_forced_tokens"],
                     "max_tokens": max_tokens, "cut_by_max_tokens": sorted({c.name for (c, _), o in zip(pairs, outs)
                                                                            if o.outputs[0].finish_reason == "length"}),
                     "invalid": invalid})
        del llm
    return rows


def run(llm: LLM, pairs: list[tuple[SchemaCase, str]], constrained: bool, batch: int,
        max_tokens: int) -> dict[str, Any]:
    engine = llm.engine
    engine.reset_spec_stats()
    outs, start = [], time.perf_counter()
    for i in range(0, len(pairs), batch):
        chunk = pairs[i: i + batch]
        outs += llm.chat([conversation(c, p) for c, p in chunk],
                         [params(c if constrained else None, max_tokens) for c, _ in chunk], use_tqdm=False)
    seconds = time.perf_counter() - start
    s = llm.spec_stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tokens": tokens, "seconds": seconds, "tok_s": stats.tok_s(tokens, seconds), "tau": stats.tau(s),
            "grammar_seconds": s["grammar_seconds"], "grammar_cuts": s["num_grammar_cuts"],
            "forced_tokens": s["num_forced_tokens"], "mean_k": s["mean_k"],
            "parsed": sum(_parses(o.outputs[0].text) for o in outs)}


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


def cost(model: str, threads: int, count: int, max_tokens: int, proposers: list[str]) -> list[dict[str, Any]]:
    pairs = requests()[:: max(1, len(requests()) // count)][:count]  # a spread over the schemas
    llms = {name: LLM(model, num_threads=threads, speculative_config=COST_SPECS[name], progress=True)
            for name in proposers}
    for llm in llms.values():  # warm-up: kernels, the vocabulary of the grammar library, the controller's profile
        run(llm, pairs[:1], True, 1, 8)
    rows = []
    for batch in (1, 16):
        cells = [(name, constrained) for name in llms for constrained in (True, False)]
        results: dict[tuple[str, bool], dict[str, Any]] = {}
        for turn in range(2):
            order = cells if turn == 0 else cells[::-1]
            for name, constrained in tqdm(order, desc=f"cost batch {batch} turn {turn + 1}", unit="row"):
                r = run(llms[name], pairs, constrained, batch, max_tokens)
                prev = results.get((name, constrained))
                results[(name, constrained)] = r if prev is None else _sum(prev, r)  # (tau, mean k: the last turn's)
        base = results[("off", True)]
        for (name, constrained), r in results.items():
            r["tok_s"] = stats.tok_s(r["tokens"], r["seconds"])
            rows.append({"part": "cost", "model": model, "batch": batch, "proposer": name, "constrained": constrained,
                         "requests": len(pairs), **r, "grammar_share": r["grammar_seconds"] / r["seconds"],
                         "speedup_over_plain_constrained": (r["tok_s"] / base["tok_s"]) if constrained else None})
    return rows


def _sum(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return {**b, **{k: a[k] + b[k] for k in ("tokens", "seconds", "grammar_seconds", "grammar_cuts", "forced_tokens",
                                              "parsed")}}


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = ["# Structured outputs", "", *header_lines(meta), "",
             "## Validity: JSON-schema requests, greedy, float32", ""]
    lines += table(["model", "proposer", "requests", "max tokens", "parsed", "valid", "ended by the grammar",
                    "identical to off", "tau", "drafts cut", "forced tokens"],
                   [[r["model"], r["proposer"], r["requests"], r.get("max_tokens", 256), r["parsed"], r["valid"],
                     r["finished"], r["identical_to_off"],
                     f"{r['tau']:.2f}" if r["tau"] else "-", r["grammar_cuts"], r["forced_tokens"]]
                    for r in rows if r["part"] == "validity"])
    lines += [f"\n{r['proposer']}: cut by the cap: {', '.join(r['cut_by_max_tokens'])}"
              for r in rows if r["part"] == "validity" and r.get("cut_by_max_tokens")]
    lines += [f"\n{r['proposer']}: parsed but invalid: {', '.join(sorted(i['schema'] for i in r['invalid']))}"
              for r in rows if r["part"] == "validity" and r.get("invalid")]
    cost_rows = [r for r in rows if r["part"] == "cost"]
    if not cost_rows:
        return "\n".join(lines) + "\n"
    lines += ["", "## Cost: tok/s with and without the schema, the grammar's share of wall time", ""]
    lines += table(["model", "batch", "proposer", "tok/s free", "tok/s schema", "grammar share", "speed-up vs plain "
                    "constrained", "drafts cut", "forced tokens"],
                   [[r["model"], r["batch"], r["proposer"],
                     f"{next(f['tok_s'] for f in cost_rows if f['batch'] == r['batch'] and f['proposer'] == r['proposer'] and not f['constrained']):.1f}",
                     f"{r['tok_s']:.1f}", f"{100 * r['grammar_share']:.2f}%", f"{r['speedup_over_plain_constrained']:.2f}x",
                     r["grammar_cuts"], r["forced_tokens"]]
                    for r in cost_rows if r["constrained"]])
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--validity-model", default="smollm2-135m")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16, help="validity: requests per batch")
    ap.add_argument("--validity-requests", type=int, default=200, help="validity: the first N pairs")
    ap.add_argument("--validity-proposers", default=",".join(VALIDITY_SPECS),
                    help="validity: comma-separated rows, the first the reference (default %(default)s)")
    ap.add_argument("--cost-proposers", default=",".join(COST_SPECS),
                    help="cost: comma-separated rows; 'off' is the base of the speed-ups (default %(default)s)")
    ap.add_argument("--requests", type=int, default=16, help="cost: requests per row")
    ap.add_argument("--max-tokens", type=int, default=256, help="cost: output cap")
    ap.add_argument("--validity-max-tokens", type=int, default=1024,
                    help="validity: output cap (the larger schemas' answers pass 256 tokens)")
    ap.add_argument("--skip", choices=["validity", "cost"], default=None)
    ap.add_argument("--out", default=None, help="default: benchmarks/results/structured_outputs/<part(s) run>")
    args = ap.parse_args()
    if min(args.requests, args.batch, args.max_tokens, args.validity_requests, args.validity_max_tokens) < 1:
        ap.error("--requests, --batch, --validity-requests and the max-tokens flags must be >= 1")
    proposers = [p.strip() for p in args.validity_proposers.split(",")]
    unknown = [p for p in proposers if p not in VALIDITY_SPECS]
    if unknown:
        ap.error(f"--validity-proposers: unknown {unknown}; known: {', '.join(VALIDITY_SPECS)}")
    cost_proposers = [p.strip() for p in args.cost_proposers.split(",")]
    unknown = [p for p in cost_proposers if p not in COST_SPECS]
    if unknown or "off" not in cost_proposers:
        ap.error(f"--cost-proposers: unknown {unknown} or 'off' missing; known: {', '.join(COST_SPECS)}")
    rows: list[dict[str, Any]] = []
    if args.skip != "validity":
        rows += validity(args.validity_model, args.threads, args.batch, args.validity_max_tokens,
                         args.validity_requests, proposers)
    if args.skip != "cost":
        rows += cost(args.model, args.threads, args.requests, args.max_tokens, cost_proposers)
    meta = benchmark_meta(args.threads, validity_model=args.validity_model, model=args.model)
    name = {"cost": "structured_outputs_validity", "validity": "structured_outputs_cost"}.get(args.skip or "")
    save(args.out or default_out("structured_outputs", name), meta, rows, markdown(meta, rows))


if __name__ == "__main__":
    main()
