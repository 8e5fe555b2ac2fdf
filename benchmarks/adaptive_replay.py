"""Adaptive speculation against every fixed draft length, replayed: the draft model's accepted runs recorded once
per answer position, then each policy served in the simulator on the committed step-time profile.

Why a replay: on a shared CPU two live runs of the same policy differ by more than the few percent that separate
the adaptive controller from the best fixed k (benchmarks/adaptive_estimators.md), so a change to the estimator
cannot be judged live in one stop. With a greedy draft model the run the target accepts depends only on where
the draft starts in the answer (while its drafts match, it reads the answer's own tokens), so recording that run
at every position (teacher-forced, the draft's cut vocabulary applied as the engine applies it) lets any policy
be replayed exactly: tokens per step without noise, time from the profile the live controller itself uses.

What it does not replay: the step noise, the profile's own error (the live controller refits it online), and the
draft model's prompt catch-up (priced alike for every policy). So it ranks policies; the live run
(adaptive_estimators.py) confirms the ranking.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/adaptive_replay.py [--prompts 20]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
from proposer_zoo import DRAFTS, datasets  # (benchmarks/: the script's directory)
from tqdm import tqdm
from harness import benchmark_meta, default_out, header_lines, save

from turbospec import LLM, SamplingParams
from turbospec.config import int_list
from turbospec.control.acceptance_estimators import ESTIMATORS
from turbospec.runner import SeqInput
from turbospec.sim.draft_outcomes import TextRuns
from turbospec.sim.replica import SpecPolicy
from turbospec.sim.simulator import Deployment, simulate
from turbospec.sim.step_cost import StepCost, load_profile
from turbospec.sim.workload import SimRequest

PROFILE = "benchmarks/results/profiles/qwen2.5-coder-1.5b-draft0.5b-bf16-t2-zen5-v9-attention.json"
MAX_RUN = 12  # longest run recorded: past the controller's cap (max_speculative_tokens = 8)
TOP = 64  # the draft's best tokens looked at per position for the best one its vocabulary allows there


def accepted_runs(llm: LLM, prompt: list[int], answer: list[int]) -> tuple[list[int], list[float]]:
    """runs[p]: drafts the target accepts when the draft model starts after p answer tokens; entropy[p]: the
    entropy (nats) of the draft's distribution for answer[p], what a confidence stop reads.

    One teacher-forced forward of the draft over prompt + answer gives its choice at every position. Its cut
    vocabulary (proposers/draft_vocab.py) allows, besides the frequent tokens, every token of the request at the time
    of drafting: the prompt and answer[:p], not the tokens the chain reaches later."""
    proposer = llm.engine.speculation.proposer
    runner, vocab = proposer.runner, proposer.vocab
    ids = prompt + answer[:-1]  # the row of position len(prompt) - 1 + p predicts answer[p]
    rid = "replay"
    runner.blocks.allocate(rid, ids, len(ids))
    try:
        with torch.inference_mode():
            out = runner.run([SeqInput(rid, ids, 0, len(answer))], logits=False)
            logits = proposer.model.model.compute_logits(out.hidden)
            best = logits.topk(TOP, dim=-1).indices.tolist()
            entropy = _entropies(logits, vocab, prompt, answer)
    finally:
        runner.blocks.free(rid)
    in_subset = None if vocab is None else vocab.in_subset
    first_seen: dict[int, int] = {}
    for p, t in enumerate(answer):
        first_seen.setdefault(t, p + 1)  # allowed once the answer holds it
    prompt_tokens = set(prompt)

    def allowed(token: int, p: int) -> bool:
        return (in_subset is None or bool(in_subset[token]) or token in prompt_tokens
                or first_seen.get(token, len(answer) + 1) <= p)

    runs = []
    for p in range(len(answer)):
        n = 0
        while p + n < len(answer) and n < MAX_RUN:
            choice = next((t for t in best[p + n] if allowed(t, p)), None)
            if choice != answer[p + n]:
                break
            n += 1
        runs.append(n)
    return runs, [round(h, 4) for h in entropy]


def _entropies(logits: torch.Tensor, vocab: Any, prompt: list[int], answer: list[int]) -> list[float]:
    """Row p's entropy over what the draft may propose there (as the engine computes it, proposers/draft_model.py): its
    cut vocabulary plus the request's tokens so far (prompt and answer[:p]), or everything without a cut."""
    if vocab is not None:
        allowed = vocab.in_subset.clone()
        allowed[torch.tensor(prompt)] = True
        mask = allowed.expand(len(answer), -1).clone()
        for p, t in enumerate(answer[:-1]):
            mask[p + 1:, t] = True
        logits = logits.masked_fill(~mask, float("-inf"))
    return torch.distributions.Categorical(logits=logits).entropy().tolist()


def record(args: argparse.Namespace) -> dict[str, Any]:
    """Greedy answers (SPS fixed k: the same tokens as plain decoding, faster) and their accepted runs."""
    llm = LLM(args.model, dtype="bfloat16", weight_format="bf16", num_threads=args.threads, max_model_len=2048,
              speculative_config={"method": "draft", "model": DRAFTS[args.model], "num_speculative_tokens": 4},
              progress=False, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    sets: dict[str, list[dict[str, Any]]] = {}
    for name, prompts in datasets(args.model, args.prompts).items():
        sets[name] = []
        for ids in tqdm(prompts, desc=f"record {name}", unit="prompt"):
            answer = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids
            runs, entropy = accepted_runs(llm, ids, list(answer))
            sets[name].append({"prompt_tokens": len(ids), "runs": runs, "entropy": entropy})
    return sets


def replay(answers: list[dict[str, Any]], profile: StepCost, policy: SpecPolicy, batch: int = 1) -> dict[str, Any]:
    """Every answer's request queued at once, served `batch` at a time (1: one after another, as the zoo
    measures); tokens/s includes prefill."""
    requests = [SimRequest(f"r{i}", 0.0, a["prompt_tokens"], len(a["runs"])) for i, a in enumerate(answers)]
    runs = TextRuns({f"r{i}": a["runs"] for i, a in enumerate(answers)},
                    {f"r{i}": a["entropy"] for i, a in enumerate(answers)})
    result = simulate(requests, profile, runs, Deployment(max_num_seqs=batch, policy=policy), record_steps=True)
    steps = [s for r in result.replicas for s in (r.steps or [])]
    ks = [k for s in steps for k in s.ks]  # one per request and decoding step
    tokens = sum(len(a["runs"]) for a in answers)
    seconds = sum(s.seconds for s in steps)
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "tau": (tokens - len(answers)) / max(len(ks), 1),
            "mean_k": sum(ks) / max(len(ks), 1), "k_histogram": [ks.count(k) for k in range(max(ks, default=0) + 1)]}


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = ["# Adaptive speculation against every fixed k, replayed on recorded accepted runs", "",
             *header_lines(meta),
             f"- {meta['model']} with the {meta['draft']} draft model, greedy, batch 1, at most {meta['max_tokens']} "
             f"tokens, the first {meta['prompts']} MT-Bench first turns and HumanEval tasks; step times from "
             f"`{meta['profile']}`", "- tau here: tokens per request and decoding step (the bonus token included)", "",
             "| batch | set | policy | tok/s | x best fixed | tau | mean k | k histogram (k = 0, 1, ...) |",
             "|---|---|---|---|---|---|---|---|"]
    for batch in dict.fromkeys(r["batch"] for r in rows):
        at = [r for r in rows if r["batch"] == batch]
        for name in at[0]["sets"]:
            best = max(r["sets"][name]["tok_s"] for r in at if r["policy"].startswith("fixed"))
            for r in at:
                s = r["sets"][name]
                lines.append(f"| {batch} | {name} | {r['policy']} | {s['tok_s']:.2f} | {s['tok_s'] / best:.3f}x | "
                             f"{s['tau']:.2f} | {s['mean_k']:.2f} | {s['k_histogram']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", choices=sorted(DRAFTS))
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--profile", default=PROFILE, help="the step-time profile the replay's steps take")
    ap.add_argument("--runs", default=str(default_out("adaptive_replay", "adaptive_replay_runs.json")),
                    help="recorded accepted runs: read if present, else recorded (needs the models) and written")
    ap.add_argument("--estimators", default=",".join(ESTIMATORS))
    ap.add_argument("--batches", type=lambda v: int_list("--batches", v), default=(1, 4, 8),
                    help="requests served at once (all queued at the start): 1 is the zoo's single stream")
    ap.add_argument("--out", default=str(default_out("adaptive_replay")))
    args = ap.parse_args()
    estimators = [e for e in args.estimators.split(",") if e]
    if unknown := set(estimators) - set(ESTIMATORS):
        ap.error(f"--estimators: unknown {sorted(unknown)}: choose from {', '.join(ESTIMATORS)}")
    runs_path = Path(args.runs)
    if runs_path.exists():
        sets = json.loads(runs_path.read_text())["sets"]
    else:
        sets = record(args)
        runs_path.write_text(json.dumps({"model": args.model, "draft": DRAFTS[args.model], "prompts": args.prompts,
                                         "max_tokens": args.max_tokens, "sets": sets}))
    profile = StepCost(load_profile(args.profile), source=args.profile)
    policies = {f"fixed k = {k}": SpecPolicy("fixed", k, free_proposals=False) for k in range(1, 9)}
    for e in estimators:  # the engine's default (draft_stop "confidence"), then the controller's lengths alone
        policies[f"auto, {e}"] = SpecPolicy("auto", 8, free_proposals=False, estimator=e, confidence_stop=True)
        policies[f"auto, {e}, draft_stop none"] = SpecPolicy("auto", 8, free_proposals=False, estimator=e)
    rows = [{"policy": name, "batch": b, "sets": {s: replay(a, profile, p, b) for s, a in sets.items()}}
            for b in args.batches for name, p in policies.items()]
    meta = benchmark_meta(args.threads, model=args.model, draft=DRAFTS[args.model], prompts=args.prompts,
                          max_tokens=args.max_tokens, profile=args.profile)
    md = markdown(meta, rows)
    print(md)
    save(Path(args.out), meta, rows, md)


if __name__ == "__main__":
    main()
