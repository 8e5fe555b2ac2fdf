"""What an EAGLE draft costs per engine step, by tree size: the proposer as it is (each tree node's entry computed
once, at its expansion) against the reference that runs the draft layer over the whole window and path for
every expanded row (turbospec/bench/eagle_reference.py).

One engine (fixed k, greedy, batch 1, HumanEval prompts pre-filled in a code fence); for every prompt and tree
size the two proposers take turns (the order alternating), so machine drift moves both alike. Per step the
engine's own sample splits the time into the draft part (proposing) and the target's forward. Also shows how
the draft's time grows with the tree's levels (min(depth, k)), which the step-time model prices
(StepFeatures.draft_levels).

    .venv/bin/python benchmarks/eagle_draft_cost.py
    .venv/bin/python benchmarks/eagle_draft_cost.py --model smollm2-135m --prompts 1 --max-tokens 16 --out /tmp/e
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from statistics import mean
from typing import Any

from tqdm import tqdm
from harness import alternating, benchmark_meta, default_out, header_lines, save

from turbospec import LLM, SamplingParams
from turbospec.bench.eagle_reference import RecomputingEagleProposer
from turbospec.bench.humaneval import answer_prefix, chat_messages, load_humaneval
from turbospec.proposers.head_proposer import EagleProposer

PROPOSERS = ("kept entries", "recomputed")


def run_prompt(llm: LLM, ids: list[int], max_tokens: int) -> tuple[list[float], list[float], int]:
    """Draft and target seconds of every step that drafted, and the answer's length."""
    engine = llm.engine
    rid = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=max_tokens))
    draft, target, tokens = [], [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = len(out.outputs[0].token_ids)
        sample = engine.last_sample
        if sample is not None and sample.features.draft_levels:
            draft.append(sample.draft_s)
            target.append(sample.target_s)
    assert rid not in engine.requests
    return draft, target, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--nodes", default="1,2,4,8", help="tree sizes (fixed k), comma-separated")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default=str(default_out("eagle_draft_cost")))
    args = ap.parse_args()
    nodes = [int(n) for n in args.nodes.split(",")]

    llm = LLM(args.model, dtype="bfloat16", weight_format="bf16", num_threads=args.threads, max_model_len=1024,
              speculative_config={"method": "eagle", "num_speculative_tokens": max(nodes)}, progress=False,
              enable_prefix_caching=False)
    engine = llm.engine
    ours = engine.speculation.proposer
    assert isinstance(ours, EagleProposer)
    proposers = {"kept entries": ours,
                 "recomputed": RecomputingEagleProposer(ours.draft, ours.branch, ours.beam, ours.depth)}
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template(chat_messages(t)) + tok.encode(answer_prefix(t), add_special_tokens=False)
               for t in load_humaneval(args.prompts)]
    engine.sample_steps = True
    run_prompt(llm, prompts[0], 4)  # warm-up
    seconds: dict[tuple[int, str], dict[str, list[float]]] = {
        (k, p): {"draft": [], "target": [], "tokens": []} for k in nodes for p in PROPOSERS}
    turn = 0
    for ids in tqdm(prompts, desc="prompts", unit="prompt"):
        for k in nodes:
            engine.set_speculation(k)
            for name in alternating(PROPOSERS, turn):
                engine.speculation.proposer = proposers[name]
                draft, target, tokens = run_prompt(llm, ids, args.max_tokens)
                cell = seconds[(k, name)]
                cell["draft"] += draft
                cell["target"] += target
                cell["tokens"].append(tokens)
            turn += 1
    rows: list[dict[str, Any]] = []
    for k in nodes:
        row: dict[str, Any] = {"nodes": k, "levels": min(ours.depth, k)}
        for name in PROPOSERS:
            cell = seconds[(k, name)]
            row[name] = {"draft_ms": 1000 * mean(cell["draft"]), "target_ms": 1000 * mean(cell["target"]),
                         "steps": len(cell["draft"]), "tokens": sum(cell["tokens"])}
        rows.append(row)
    meta = benchmark_meta(args.threads, model=args.model, prompts=args.prompts, max_tokens=args.max_tokens,
                          depth=ours.depth)
    save(Path(args.out), meta, rows, markdown(meta, rows))


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        "# EAGLE drafting time per step: each tree node's entry kept, or the window and path recomputed", "",
        *header_lines(meta),
        f"- {meta['model']}, bf16, greedy, batch 1, the first {meta['prompts']} HumanEval tasks, at most "
        f"{meta['max_tokens']} tokens, fixed tree sizes, draft depth {meta['depth']}; the two proposers took turns "
        "prompt by prompt on one engine; mean milliseconds per step that drafted", "",
        "| tree nodes | levels | draft ms, kept | draft ms, recomputed | kept / recomputed | target ms (kept) | "
        "draft share of the step (kept) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        kept, again = r["kept entries"], r["recomputed"]
        lines.append(f"| {r['nodes']} | {r['levels']} | {kept['draft_ms']:.1f} | {again['draft_ms']:.1f} | "
                     f"{kept['draft_ms'] / again['draft_ms']:.2f} | {kept['target_ms']:.1f} | "
                     f"{kept['draft_ms'] / (kept['draft_ms'] + kept['target_ms']):.1%} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
