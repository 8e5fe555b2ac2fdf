"""Does speculation pay on this machine? One engine, one process, draft lengths taking turns per prompt.

Across processes (benchmarks/weight_formats.py runs each row in its own) a shared machine moves a row by 10-25%
between runs, more than the gap between drafting and not. Here one engine with a draft model serves every prompt
once per mode (`engine.set_speculation`: a fixed k, or "auto" for the goodput controller), the modes in turn,
their order reversed every repeat, so slow and fast stretches of the machine fall on every mode alike.

    .venv/bin/python benchmarks/spec_ab.py                                 # k 0, 4 and auto; 3 + 3 prompts, twice
    .venv/bin/python benchmarks/spec_ab.py --modes 0,2,4 --repeats 1 --out /tmp/ab
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from harness import alternating, benchmark_meta, default_out, save, stats, warm_up  # noqa: E402


def parse_mode(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"mode {text!r}: expected a draft length (0, 1, ...) or auto")
    return int(text)


def main() -> None:
    from weight_formats import DRAFT, build_job

    from turbospec.tuning import set_speculation
    from turbospec import LLM, SamplingParams

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b", choices=sorted(DRAFT))
    p.add_argument("--modes", default="0,4,auto", help="comma-separated draft lengths and/or auto")
    p.add_argument("--prompts", type=int, default=3, help="per data set")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(default_out("spec_ab")))
    args = p.parse_args()
    try:
        modes = [parse_mode(m) for m in args.modes.split(",")]
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    job = build_job(args)
    llm = LLM(args.model, speculative_config={"method": "draft", "model": DRAFT[args.model]},
              num_threads=args.threads, progress=False, enable_prefix_caching=False, max_model_len=2048,
              kv_cache_memory_gib=0.25)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    warm_up(llm, job["sets"]["mt-bench"][0])  # and the controller's step-time profile (cached)
    totals: dict[tuple[str, str], dict[str, Any]] = {}
    runs = [(rep, name, ids) for rep in range(args.repeats) for name, sets in job["sets"].items() for ids in sets]
    for rep, name, ids in tqdm(runs, desc="prompts", unit="prompt"):
        for mode in alternating(modes, rep):
            set_speculation(engine, mode)
            engine.reset_spec_stats()
            start = time.perf_counter()
            out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
            t = totals.setdefault((name, str(mode)), {"seconds": 0.0, "tokens": 0, "drafts": 0, "accepted": 0})
            t["seconds"] += time.perf_counter() - start
            t["tokens"] += len(out.outputs[0].token_ids)
            spec = llm.spec_stats()
            t["drafts"] += spec["num_drafts"]
            t["accepted"] += spec["num_accepted_tokens"] + spec["num_drafts"]  # each verification adds one
    rows = [{"set": name, "mode": mode, **t, "tok_s": stats.tok_s(t["tokens"], t["seconds"])}
            for (name, mode), t in totals.items()]
    meta = benchmark_meta(args.threads, model=args.model, draft=DRAFT[args.model], prompts=args.prompts,
                          max_tokens=args.max_tokens, repeats=args.repeats)
    save(Path(args.out), meta, rows, markdown(meta, rows))


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [f"# Speculation on or off, in one process: {meta['model']} with {meta['draft']} as draft", "",
             f"- {meta['command']}", f"- {meta['machine']}, {meta['threads']} threads, torch {meta['torch']}, "
             f"{meta['date']}, commit {meta['commit']}",
             f"- greedy, chat template, at most {meta['max_tokens']} tokens, {meta['prompts']} prompts per set, every "
             f"prompt once per mode, modes in turn (order reversed each repeat), {meta['repeats']} repeats", "",
             "| set | mode (k) | tok/s | vs k = 0 | tau | steps with drafts |", "|---|---|---|---|---|---|"]
    plain = {r["set"]: r["tok_s"] for r in rows if r["mode"] == "0"}
    for r in sorted(rows, key=lambda r: (r["set"], r["mode"])):
        vs = f"{r['tok_s'] / plain[r['set']]:.2f}x" if r["set"] in plain else "-"
        tau = stats.tau({"num_drafts": r["drafts"], "num_accepted_tokens": r["accepted"] - r["drafts"]})
        tau = f"{tau:.2f}" if tau else "-"
        lines.append(f"| {r['set']} | {r['mode']} | {r['tok_s']:.2f} | {vs} | {tau} | {r['drafts']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
