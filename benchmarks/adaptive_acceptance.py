"""Lossy acceptance against speed, with accuracy measured by executing HumanEval's tests (seed 002's table).

Single stream, greedy, target `qwen2.5-coder-1.5b` with draft `qwen2.5-coder-0.5b`, on the first N HumanEval tasks
(the same tasks for every row). Each answer is pre-filled with the task's prompt in a code fence and stops at the
closing fence (turbospec/bench/humaneval.py); pass@1 comes from running the task's tests in the sandbox
(turbospec/bench/sandbox.py). Rows, all from one run:
- target alone, draft alone (turbospec, no speculation);
- vanilla speculative decoding (exact acceptance, k fixed);
- HF transformers assisted generation (the same target and draft, its own draft-length heuristic);
- each acceptance policy of verification/lossy.py at the same k: typical, adasd, adasd-generation, adasd-verification.
Columns: pass@1, tokens/s (generated tokens over wall time, prefill included), "= target" (tasks whose answer is
token for token the target's own), relaxed (share of output tokens kept only by a lossy rule), tau, and the
speedups over the target alone and over vanilla speculative decoding.

    .venv/bin/python benchmarks/adaptive_acceptance.py                  # full run (about an hour here)
    .venv/bin/python benchmarks/adaptive_acceptance.py --tasks 2 --max-tokens 32 --rows target,adasd --out /tmp/aa
"""

from __future__ import annotations

import argparse
import gc
import os
from pathlib import Path
from typing import Any

import torch
from harness import Partial, benchmark_meta, default_out, header_lines, hf_generate, load_hf, run_sets, save, stats
from harness import warm_up
from tqdm import tqdm

from turbospec import LLM, SamplingParams
from turbospec.bench.humaneval import (
    STOP,
    HumanEvalTask,
    answer_prefix,
    chat_messages,
    check_completion,
    load_humaneval,
)

POLICIES = ("typical", "adasd", "adasd-generation", "adasd-verification")
ROWS = ("target", "draft", "vanilla", "hf-assisted", *POLICIES)


def prompt_ids(model: str, tasks: list[HumanEvalTask]) -> list[list[int]]:
    from turbospec.models.loader import load_model

    tok = load_model(model, "bfloat16", progress=False).tokenizer
    return [tok.apply_chat_template(chat_messages(t)) + tok.encode(answer_prefix(t), add_special_tokens=False)
            for t in tasks]


def run_turbospec(args: argparse.Namespace, row: str, model: str, spec: dict[str, Any] | None,
                  tasks: list[HumanEvalTask], ids: list[list[int]]) -> dict[str, Any]:
    llm = LLM(model, dtype=args.dtype, num_threads=args.threads, max_model_len=args.max_model_len,
              speculative_config=spec, progress=False, enable_prefix_caching=False)
    warm_up(llm, ids[0])
    texts, relaxed = [], [0]

    def keep(_row: str, _set: str, out: Any) -> None:
        texts.append(out.outputs[0].text)
        relaxed[0] += out.relaxed_tokens

    s = run_sets({row: llm}, {"humaneval": ids}, SamplingParams(temperature=0, max_tokens=args.max_tokens, stop=STOP),
                 on_output=keep)[row]["humaneval"]
    thresholds = llm.spec_stats().get("adaptive_thresholds")
    del llm
    gc.collect()
    return {"row": row, "engine": "turbospec", "outputs": s["outputs"], "texts": texts, "seconds": s["seconds"],
            "relaxed_tokens": relaxed[0], "tau": s["tau"], "mean_k": s["mean_k"], "adaptive_thresholds": thresholds}


class _StopAtFence:
    """HF stopping criterion: the decoded tail of the answer contains a stop string (as turbospec's `stop`)."""

    def __init__(self, tokenizer: Any, prompt_len: int) -> None:
        self.tokenizer, self.prompt_len = tokenizer, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        tail = self.tokenizer.decode(input_ids[0, self.prompt_len:][-8:].tolist())
        done = any(s in tail for s in STOP)
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool)


def run_hf_assisted(args: argparse.Namespace, tasks: list[HumanEvalTask], ids: list[list[int]]) -> dict[str, Any]:
    from transformers import StoppingCriteriaList

    from turbospec.models.loader import load_model

    target, draft = load_hf(args.target, args.dtype), load_hf(args.draft, args.dtype)
    tok = load_model(args.target, "bfloat16", progress=False).tokenizer
    eos = list(tok.eos_token_ids)
    outputs, texts, seconds = [], [], 0.0
    bar = tqdm(list(zip(tasks, ids)), desc="hf-assisted", unit="task")
    for task, p in bar:
        new, took = hf_generate(target, p, args.max_tokens, eos, assistant_model=draft,
                                stopping_criteria=StoppingCriteriaList([_StopAtFence(tok, len(p))]))
        seconds += took
        text = tok.decode(new)
        cut = min((text.find(s) for s in STOP if s in text), default=-1)
        outputs.append(new)
        texts.append(text if cut < 0 else text[:cut])
        bar.set_postfix(tok_s=f"{sum(map(len, outputs)) / seconds:.2f}")
    del target, draft
    gc.collect()
    return {"row": "hf-assisted", "engine": "hf", "outputs": outputs, "texts": texts, "seconds": seconds,
            "relaxed_tokens": 0, "tau": None}


def score(rows: list[dict[str, Any]], tasks: list[HumanEvalTask]) -> None:
    """pass@1 by execution, agreement with the target, and speedups."""
    for r in rows:
        results = [check_completion(t, text) for t, text in zip(tasks, r["texts"])]
        r["passed"] = [res.passed for res in results]
        r["status"] = [res.status for res in results]
        r["pass_at_1"] = sum(r["passed"]) / len(tasks)
        r["tokens"] = sum(map(len, r["outputs"]))
        r["tok_s"] = stats.tok_s(r["tokens"], r["seconds"])
        r["network_isolated"] = all(res.isolated_network for res in results)
    by_row = {r["row"]: r for r in rows}
    target, vanilla = by_row.get("target"), by_row.get("vanilla")
    for r in rows:
        if target:
            r["same_as_target"] = stats.matches(r["outputs"], target["outputs"])
            r["speedup_vs_target"] = r["tok_s"] / target["tok_s"]
        if vanilla:
            r["speedup_vs_vanilla"] = r["tok_s"] / vanilla["tok_s"]
        r["relaxed_share"] = r["relaxed_tokens"] / r["tokens"] if r["tokens"] else 0.0


LABELS = {"target": "target alone", "draft": "draft alone", "vanilla": "vanilla speculative (exact)",
          "hf-assisted": "HF assisted generation", "typical": "typical acceptance (lossy)",
          "adasd": "AdaSD (lossy)", "adasd-generation": "AdaSD generation only (lossless)",
          "adasd-verification": "AdaSD verification only (lossy)"}


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        "# Lossy acceptance: HumanEval pass@1 (executed) against speed",
        "",
        *header_lines(meta),
        (f"- target `{meta['target']}`, draft `{meta['draft']}`, {meta['dtype']}; greedy, single stream, k = {meta['k']} "
         f"for every speculative row; the first {meta['tasks']} HumanEval tasks (a fixed subset, the same for every "
         f"row), answers pre-filled with the task prompt, stopped at the closing code fence, at most "
         f"{meta['max_tokens']} tokens; tests run in the sandbox (network namespace: {meta['network_isolated']})"),
        "",
        "| method | pass@1 | tok/s | = target | relaxed | tau | speedup vs target | speedup vs vanilla |",
        "|---|---|---|---|---|---|---|---|",
    ]
    def f(r: dict[str, Any], key: str) -> str:
        return f"{r[key]:.2f}" if r.get(key) is not None else "-"

    for r in rows:
        lines.append(f"| {LABELS[r['row']]} | {100 * r['pass_at_1']:.1f} | {r['tok_s']:.2f} | {f(r, 'same_as_target')} "
                     f"| {100 * r['relaxed_share']:.1f}% | {f(r, 'tau')} | {f(r, 'speedup_vs_target')}x | "
                     f"{f(r, 'speedup_vs_vanilla')}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--tasks", type=int, default=40, help="the first N HumanEval tasks")
    ap.add_argument("--k", type=int, default=8, help="draft tokens per step for every speculative row")
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {','.join(ROWS)}")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--max-model-len", type=int, default=1536)
    ap.add_argument("--out", default=str(default_out("adaptive_acceptance")))
    ap.add_argument("--resume", action="store_true", help="keep the rows a stopped run saved in OUT.partial.json")
    args = ap.parse_args()
    wanted = args.rows.split(",")
    unknown = sorted(set(wanted) - set(ROWS))
    if unknown:
        ap.error(f"unknown rows {unknown}: expected some of {', '.join(ROWS)}")
    if args.tasks < 1 or args.k < 1 or args.max_tokens < 1:
        ap.error("--tasks, --k and --max-tokens must be >= 1")

    tasks = load_humaneval(args.tasks)
    ids = prompt_ids(args.target, tasks)
    out = Path(args.out)
    partial = Partial(out, args.resume)  # every finished row, so a crash loses at most one row
    rows = partial.rows
    done = {r["row"] for r in rows}
    for row in [r for r in ROWS if r in wanted and r not in done]:
        if row == "hf-assisted":
            rows.append(run_hf_assisted(args, tasks, ids))
            partial.save()
            continue
        model = args.draft if row == "draft" else args.target
        spec = None
        if row not in ("target", "draft"):
            spec = {"method": "draft", "model": args.draft, "num_speculative_tokens": args.k,
                    "acceptance": "exact" if row == "vanilla" else row}
        rows.append(run_turbospec(args, row, model, spec, tasks, ids))
        partial.save()
    rows.sort(key=lambda r: ROWS.index(r["row"]))
    score(rows, tasks)
    meta = benchmark_meta(args.threads, target=args.target, draft=args.draft, dtype=args.dtype, k=args.k,
                          tasks=args.tasks, task_ids=[t.task_id for t in tasks], max_tokens=args.max_tokens,
                          network_isolated=all(r["network_isolated"] for r in rows))
    save(out, meta, rows, markdown(meta, rows))


if __name__ == "__main__":
    main()
