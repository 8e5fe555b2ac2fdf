"""The proposer zoo side by side (seed 003's table): every speculative method on the same prompts, one run.

Single stream, greedy, chat template, at most --max-tokens answer tokens, for each target model on the first
MT-Bench turns and on HumanEval (the task's prompt pre-filled in a code fence, as benchmarks/adaptive_acceptance.py
does). Rows:
- plain: turbospec without speculation (the speedup baseline);
- SPS: a smaller draft model with the same tokenizer (qwen2.5-coder-0.5b for the 1.5b; none is packaged for SmolLM2);
- PLD: prompt lookup, k fixed; lookahead: Jacobi window + n-gram pool, trees of up to k nodes;
- layer-skip: the searched set (turbospec search-layers);
- Medusa, Hydra, EAGLE: our committed heads and draft layer (heads/), trees of up to k nodes;
- DART: our parallel draft (proposers/dart.py: the EAGLE layer adapted to predict 4 positions in one pass, its tree
  searched with an n-gram table), trees of up to k nodes;
- adaptive: the goodput controller choosing k on top of the best fixed row of the same run, measured alongside
  that fixed row and plain decoding once more (the engines loaded side by side, taking turns prompt by prompt):
  on a shared machine two runs made minutes apart differ by more than the controller's gain;
- HF transformers: plain, its prompt lookup, and assisted generation with the same draft where one exists.
`--rows` runs some of the fixed rows only; `--side-by-side` loads plain and those rows together and lets them take
turns prompt by prompt, as the adaptive rows are measured (on a shared machine the fairer comparison).
Columns per data set: tokens/s (generated tokens over wall time, prefill included), speedup over the same
engine's plain row, tau (tokens per verification step) and whether the output equals plain decoding.

    .venv/bin/python benchmarks/proposer_zoo.py                       # full run (about 46 minutes here)
    .venv/bin/python benchmarks/proposer_zoo.py --models smollm2-135m --prompts 1 --max-tokens 16 --out /tmp/zoo
"""

from __future__ import annotations

import argparse
import gc
import os
from pathlib import Path
from typing import Any

from harness import Partial, benchmark_meta, default_out, header_lines, hf_run_set, load_hf, run_sets, save, stats
from harness import warm_up

from turbospec import LLM, SamplingParams
from turbospec.bench.humaneval import answer_prefix, load_humaneval
from turbospec.bench.humaneval import chat_messages as humaneval_messages
from turbospec.data.prompts import load_mtbench

DRAFTS = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b"}
FIXED = ("sps", "pld", "lookahead", "layer-skip", "medusa", "hydra", "eagle", "dart")


def datasets(model: str, n: int) -> dict[str, list[list[int]]]:
    from turbospec.models.loader import load_model

    tok = load_model(model, "bfloat16", progress=False).tokenizer
    mt = [tok.apply_chat_template([{"role": "user", "content": p.text}]) for p in load_mtbench(n)]
    he = [tok.apply_chat_template(humaneval_messages(t)) + tok.encode(answer_prefix(t), add_special_tokens=False)
          for t in load_humaneval(n)]
    return {"mt-bench": mt, "humaneval": he}


def spec_config(row: str, model: str, args: argparse.Namespace) -> dict[str, Any] | None:
    k = args.k
    if row == "plain":
        return None
    if row == "sps":
        return {"method": "draft", "model": DRAFTS[model], "num_speculative_tokens": k}
    if row == "pld":
        return {"method": "ngram", "num_speculative_tokens": k}
    if row == "lookahead":
        return {"method": "lookahead", "num_speculative_tokens": args.tree_nodes}
    if row == "layer-skip":
        return {"method": "layer-skip", "num_speculative_tokens": args.layer_skip_k}
    return {"method": row, "num_speculative_tokens": args.tree_nodes}


def run_turbospec(args: argparse.Namespace, model: str, specs: dict[str, dict[str, Any] | None],
                  data: dict[str, list[list[int]]]) -> list[dict[str, Any]]:
    """One result per row of `specs`. With several rows, their engines are loaded side by side and take turns
    prompt by prompt (the order alternating: harness.run_sets), so a machine that drifts affects them alike: how
    the adaptive row is compared with the fixed row it builds on."""
    llms = {row: LLM(model, dtype=args.dtype, weight_format=args.weight_format, num_threads=args.threads,
                     max_model_len=args.max_model_len, speculative_config=spec, progress=False,
                     enable_prefix_caching=False)
            for row, spec in specs.items()}
    for llm in llms.values():
        warm_up(llm, data["mt-bench"][0])
    sets = run_sets(llms, data, SamplingParams(temperature=0, max_tokens=args.max_tokens),
                    desc=f"{model} {'+'.join(llms)}")
    del llms
    gc.collect()
    return [{"model": model, "row": row, "engine": "turbospec", "spec": specs[row], "sets": sets[row]}
            for row in specs]


def run_hf(args: argparse.Namespace, model: str, data: dict[str, list[list[int]]]) -> list[dict[str, Any]]:
    from turbospec.models.loader import load_model

    target = load_hf(model, args.dtype)
    eos = list(load_model(model, "bfloat16", progress=False).tokenizer.eos_token_ids)
    # the peer row: assisted generation with the same draft where one exists, else its prompt lookup mode
    variants: dict[str, dict[str, Any]] = {"hf-plain": {}}
    if model in DRAFTS:
        variants["hf-assisted"] = {"assistant_model": load_hf(DRAFTS[model], args.dtype)}
    else:
        variants["hf-prompt-lookup"] = {"prompt_lookup_num_tokens": args.k}
    rows = [{"model": model, "row": row, "engine": "hf", "spec": None,
             "sets": {name: hf_run_set(target, prompts, args.max_tokens, eos, desc=f"{model} {row} {name}", **extra)
                      for name, prompts in data.items()}}
            for row, extra in variants.items()]
    del target, variants
    gc.collect()
    return rows


def summarise(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        plain = next(p for p in rows if p["model"] == r["model"] and p["row"] == ("plain" if r["engine"] == "turbospec"
                                                                                   else "hf-plain"))
        for name, s in r["sets"].items():
            base = plain["sets"][name]
            s["tok_s"] = stats.tok_s(s["tokens"], s["seconds"])
            s["speedup"] = s["tok_s"] / stats.tok_s(base["tokens"], base["seconds"])
            s["matches_plain"] = stats.matches(s["outputs"], base["outputs"])
            if "first_token_seconds" in s and "first_token_seconds" in base:
                s["after_first_speedup"] = _after_first_rate(s) / _after_first_rate(base)


def _after_first_rate(s: dict[str, Any]) -> float:
    """Tokens per second after each prompt's first token: the decoding that speculation speeds up, without the
    prefill that every row pays alike."""
    return stats.after_first_tok_s(s["tokens"], len(s["outputs"]), s["seconds"], s["first_token_seconds"])


def after_first_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Per model: plain's share of time before the first token (prefill) and each speculative row's speedup after
    it (results since 2026-12-03 record the first token's time)."""
    lines = []
    for plain in (r for r in rows if r["row"] == "plain" and "sets" in r):
        sets = plain["sets"]
        if not all("first_token_seconds" in s for s in sets.values()):
            continue
        share = ", ".join(f"{n} {stats.prefill_share(s['first_token_seconds'], s['seconds']):.0%}"
                          for n, s in sets.items())
        rows_after = [f"{r['row']} " + " / ".join(f"{s['after_first_speedup']:.2f}x" for s in r["sets"].values())
                      for r in rows if r["model"] == plain["model"] and "sets" in r and r["engine"] == "turbospec"
                      and r["row"] not in ("plain", "plain-alongside")
                      and all("after_first_speedup" in s for s in r["sets"].values())]
        lines.append(f"- {plain['model']}: plain spent {share} of its time before each prompt's first token (prefill, "
                     f"paid alike by every row); speedup after the first token, {' / '.join(sets)}: "
                     f"{'; '.join(rows_after)}")
    return lines


LABELS = {"plain": "plain (turbospec)", "sps": "SPS (draft model)", "pld": "PLD (prompt lookup)",
          "layer-skip": "layer-skip (Self-SpecDec)", "medusa": "Medusa (our heads, tree)",
          "hydra": "Hydra (our heads, tree)", "eagle": "EAGLE-style (our draft layer, tree)",
          "lookahead": "lookahead (tree)", "adaptive": "adaptive controller on the best fixed row",
          "best-fixed-alongside": "the best fixed row again, alongside the adaptive one",
          "plain-alongside": "plain again, alongside the adaptive one",
          "hf-plain": "HF transformers plain", "hf-prompt-lookup": "HF prompt lookup",
          "hf-assisted": "HF assisted generation", "dart": "DART-style (our parallel draft, n-gram tree)"}


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        "# The proposer zoo: single-stream greedy speedups (seed 003's table, on this CPU)", "",
        *header_lines(meta),
        (f"- {meta['dtype']} (weight format {meta.get('weight_format', 'bf16')}), greedy, batch 1, chat template, at "
         f"most {meta['max_tokens']} tokens; the first N "
         f"MT-Bench first turns and the first N HumanEval tasks (prompt pre-filled in a code fence), N per model: "
         f"{meta['prompts']}; k = {meta['k']} for SPS and PLD, {meta['tree_nodes']} tree nodes for lookahead and the "
         f"heads, "
         f"layer-skip k = {meta['layer_skip_k']}; speedup over the same engine's plain row"),
        *(["- side by side: plain and the fixed rows were loaded together and took turns prompt by prompt "
           "(`--side-by-side`), so machine drift between rows cancels"] if meta.get("side_by_side") else []), "",
        "| model | method | MT-Bench tok/s | speedup | tau | HumanEval tok/s | speedup | tau | = plain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "missing" in r:
            lines.append(f"| {r['model']} | {LABELS[r['row']]} | - | - | - | - | - | - | {r['missing']} |")
            continue
        cells = []
        for name in ("mt-bench", "humaneval"):
            s = r["sets"][name]
            cells += [f"{s['tok_s']:.2f}", f"{s['speedup']:.2f}x", f"{s['tau']:.2f}" if s.get("tau") else "-"]
        same = min(s["matches_plain"] for s in r["sets"].values())
        label = LABELS[r["row"]] + (f" ({r['best']})" if r.get("best") else "")
        lines.append(f"| {r['model']} | {label} | {' | '.join(cells)} | {same:.2f} |")
    lines.append("")
    lines += after_first_lines(rows)
    for adaptive in (r for r in rows if r["row"] == "adaptive" and "sets" in r):
        for other, what in (("best-fixed-alongside", f"the best fixed row ({adaptive.get('best')})"),
                            ("plain-alongside", "plain decoding")):
            base = next((r for r in rows if r["row"] == other and r["model"] == adaptive["model"]), None)
            if base is not None:
                ratios = [f"{name} {adaptive['sets'][name]['tok_s'] / base['sets'][name]['tok_s']:.2f}x"
                          for name in ("mt-bench", "humaneval")]
                lines.append(f"- {adaptive['model']}: adaptive over {what}, measured alongside it prompt by prompt: "
                             f"{', '.join(ratios)} (target: at least 1.00x)")
        shares = [f"{name} {s['controller']['controller_overhead']:.2%}" for name, s in adaptive["sets"].items()
                  if s.get("controller")]
        if shares:
            lines.append(f"- {adaptive['model']}: the controller's own time, share of the adaptive row's step time: "
                         f"{', '.join(shares)}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-1.5b")
    ap.add_argument("--prompts", type=int, default=0, help="prompts per data set (0: 6 for small models, 3 for 1.5b)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step for SPS and PLD")
    ap.add_argument("--tree-nodes", type=int, default=8,
                    help="tree nodes per step (lookahead, Medusa, Hydra, EAGLE, DART)")
    ap.add_argument("--layer-skip-k", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    # dense by default, as seed 003 compares proposers (and HF runs dense): on this CPU a dense forward over 8
    # tokens costs about what one does, while the packed 4/6-bit weights make one token ~2.5x cheaper but each
    # further verified token dearer (benchmarks/weight_formats.py compares speculation on packed weights)
    ap.add_argument("--weight-format", default="bf16", choices=["auto", "bf16", "int4", "int8"])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-rows", default="", help="fixed rows not to run, comma-separated (e.g. layer-skip: "
                    "its first use searches the layers: 68 trials, 12 minutes for the 1.5b on 2 AVX2 cores, "
                    "benchmarks/results/layer_search/layer_search.md); "
                    "the table says so")
    ap.add_argument("--rows", default=",".join(FIXED), help="the fixed rows to run, comma-separated")
    ap.add_argument("--side-by-side", action="store_true",
                    help="plain and --rows loaded together, taking turns prompt by prompt (one measurement group)")
    ap.add_argument("--out", default=str(default_out("proposer_zoo")))
    ap.add_argument("--resume", action="store_true", help="keep the rows a stopped run saved in OUT.partial.json")
    args = ap.parse_args()
    chosen = [r for r in args.rows.split(",") if r]
    if unknown := set(chosen) - set(FIXED):
        ap.error(f"--rows: unknown rows {sorted(unknown)}: choose from {', '.join(FIXED)}")
    out = Path(args.out)
    partial = Partial(out, args.resume)
    rows = partial.rows

    def have(model: str, row: str) -> bool:
        return any(r["model"] == model and r["row"] == row for r in rows)

    def keep(row: dict[str, Any] | list[dict[str, Any]]) -> None:
        rows.extend(row if isinstance(row, list) else [row])
        partial.save()

    counts = {}
    for model in args.models.split(","):
        n = args.prompts or (3 if "1.5b" in model else 6)
        counts[model] = n
        data = datasets(model, n)
        rows_here = [r for r in ("plain", *chosen) if not have(model, r) and r not in args.skip_rows.split(",")
                     and (r != "sps" or model in DRAFTS)]
        if args.side_by_side and rows_here and "plain" not in rows_here:
            ap.error(f"--side-by-side: {model}'s plain row was measured by an earlier process (--resume) and the "
                     f"rows {rows_here} would run without it: resume with the plain row too, or start afresh")
        if args.side_by_side and rows_here:
            keep(run_turbospec(args, model, {r: spec_config(r, model, args) for r in rows_here}, data))
        for row in ("plain", *chosen):
            if have(model, row):
                continue
            if row == "sps" and model not in DRAFTS:
                keep({"model": model, "row": row, "missing": "no smaller model with this tokenizer is packaged"})
                continue
            if row in args.skip_rows.split(","):
                keep({"model": model, "row": row, "missing": "not run this time (--skip-rows)"})
                continue
            keep(run_turbospec(args, model, {row: spec_config(row, model, args)}, data))
        fixed = [r for r in rows if r["model"] == model and r["row"] in FIXED and "sets" in r]
        if not have(model, "adaptive") and fixed:  # (--rows may choose only rows that cannot run here)
            plain = next(r for r in rows if r["model"] == model and r["row"] == "plain")
            def speed(r: dict[str, Any]) -> float:  # mean speedup over the data sets (the same prompts)
                return sum(plain["sets"][s]["seconds"] / r["sets"][s]["seconds"] for s in r["sets"])

            best = max(fixed, key=speed)
            # the controller may go as far as the fixed row does (the default cap, 8, is below a 16-node tree)
            cap = max(8, int(best["spec"]["num_speculative_tokens"]))
            spec = {**best["spec"], "num_speculative_tokens": "auto", "max_speculative_tokens": cap}
            # plain and the best fixed row once more, alongside the adaptive one (taking turns prompt by prompt):
            # the comparison the target is about (k = 0 is a fixed setting too), free of the drift between runs
            plain_alongside, alongside, adaptive = run_turbospec(
                args, model, {"plain-alongside": None, "best-fixed-alongside": best["spec"], "adaptive": spec}, data)
            adaptive["best"] = alongside["best"] = best["row"]
            keep([plain_alongside, alongside, adaptive])
        if not args.skip_hf and not have(model, "hf-plain"):
            keep(run_hf(args, model, data))
    summarise([r for r in rows if "sets" in r])
    meta = benchmark_meta(args.threads, dtype=args.dtype, weight_format=args.weight_format,
                          max_tokens=args.max_tokens,
                          prompts=", ".join(f"{m}: {n}" for m, n in counts.items()), k=args.k,
                          tree_nodes=args.tree_nodes, layer_skip_k=args.layer_skip_k, side_by_side=args.side_by_side)
    save(out, meta, rows, markdown(meta, rows))


if __name__ == "__main__":
    main()
