"""Is an EAGLE draft's fixed vocabulary what holds it back?

The draft layer scores only its file's draft vocabulary (the 8,192 tokens the target chose most often in the
training answers): a token outside it can never be drafted. This measures how much that costs. The target answers
the zoo's prompts greedily (the first N MT-Bench first turns and HumanEval tasks, chat template, bf16). The draft
is then teacher-forced over those answers, as training's held-out score is (top-1 per draft step, a label
outside the vocabulary a miss), with three vocabularies on the same trained layer:

- the file's own;
- the file's own plus every token of each prompt and its answer: an oracle that covers every label;
- the target's full vocabulary.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/eagle_vocab.py --prompts 10
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
from proposer_zoo import datasets  # (benchmarks/: the script's directory)
from harness import benchmark_meta, default_out, header_lines, save

from turbospec import LLM, SamplingParams
from turbospec.proposers.eagle import EagleDraft
from turbospec.training.eagle import WINDOW, FlatExamples, flat_examples, heldout_accuracy, target_features
from turbospec.training.heads import vocab_remap
from turbospec.proposers.heads import file_sha256, head_path


def vocabularies(own: torch.Tensor, sequences: list[tuple[list[int], int]], vocab_size: int
                 ) -> dict[str, torch.Tensor]:
    seen = {t for ids, _ in sequences for t in ids}
    return {"the file's own": own,
            "own + every prompt and answer token (oracle)": torch.tensor(sorted(set(own.tolist()) | seen)),
            "full": torch.arange(vocab_size)}


def first_step_coverage(flat: FlatExamples, remap: torch.Tensor) -> float:
    """Share of the first draft step's labels (the target's choice after each example position) in the vocabulary."""
    t = torch.tensor([e[0] for e in flat.examples])
    return float((remap[flat.choice[t + 1]] >= 0).float().mean())


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = ["# EAGLE's draft vocabulary: teacher-forced top-1 with the file's own, an oracle and the full vocabulary",
             "", *header_lines(meta),
             f"- {meta['model']}, `{Path(meta['heads']).name}` (sha256 {meta['heads_sha256'][:8]}); the target's own "
             f"greedy answers (bf16, at most {meta['max_tokens']} tokens) to the first {meta['prompts']} MT-Bench "
             f"first turns and HumanEval tasks; the draft in float32, a label outside the vocabulary a miss", "",
             "| set | vocabulary | tokens | first-step labels covered | top-1 per draft step | positions |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        top1 = " / ".join(f"{a:.3f}" for a in r["top1"])
        lines.append(f"| {r['set']} | {r['vocabulary']} | {r['size']} | {r['coverage']:.1%} | {top1} | "
                     f"{r['positions']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--heads", default="", help="the EAGLE file (default: the model's committed one in heads/)")
    ap.add_argument("--prompts", type=int, default=10, help="per data set")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default=str(default_out("eagle_vocab")))
    args = ap.parse_args()
    path = Path(args.heads) if args.heads else head_path(args.model, "eagle")
    try:
        draft, _ = EagleDraft.load(path)
    except (OSError, ValueError) as e:
        ap.error(f"--heads: {e}")
    llm = LLM(args.model, dtype="bfloat16", weight_format="bf16", num_threads=args.threads, progress=False,
              enable_prefix_caching=False)
    engine = llm.engine
    model = engine.loaded.model
    vocab_size = engine.model_config.vocab_size
    own = draft.vocab.clone()
    rows = []
    for name, prompts in datasets(args.model, args.prompts).items():
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=args.max_tokens), use_tqdm=True)
        sequences = [(p + list(o.outputs[0].token_ids), len(p)) for p, o in zip(prompts, outs)]
        flat = flat_examples(sequences, target_features(engine, sequences, list(draft.config.feature_layers),
                                                        WINDOW), WINDOW)
        for label, vocab in vocabularies(own, sequences, vocab_size).items():
            draft.vocab = vocab.long()
            draft.attach(model.lm_head_weight.float(), model.embed.weight.float())
            remap = vocab_remap(draft.vocab, vocab_size)
            rows.append({"set": name, "vocabulary": label, "size": len(vocab), "positions": len(flat.examples),
                         "coverage": first_step_coverage(flat, remap),
                         "top1": heldout_accuracy(draft, flat, draft.config.depth, remap)})
            print(rows[-1], flush=True)
    meta = benchmark_meta(args.threads, model=args.model, heads=str(path), heads_sha256=file_sha256(path),
                          prompts=args.prompts, max_tokens=args.max_tokens)
    save(Path(args.out), meta, rows, markdown(meta, rows))


if __name__ == "__main__":
    main()
