"""Train the DART-style parallel draft (dart.py) on a trained EAGLE draft: ``turbospec train-head --method dart``.

Data and features are EAGLE's (training/eagle.py). With the base's own data options the split is the base's, so
the held-out sequences are unseen by the base too; the report says whether the options matched
(`held_out_unseen_by_base`), and a mismatch is warned about; `train_sequences` keeps only the first N training sequences
(the target's features are most of the cost on a CPU without bf16 arithmetic). An example is a position t with
a window of entries ending there; one pass predicts the target's choice at t + 1 (the last entry's output) and
at t + 1 + i (mask entry i), i < depth. Only the mask entries and the low-rank deltas are trained. The n-gram
table counts, over the training sequences, which token the target chose after each token.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..proposers.dart import DartConfig, DartDraft, ngram_table
from ..proposers.eagle import EagleDraft
from ..proposers.heads import file_sha256
from .eagle import WINDOW, FlatExamples, features_path, flat_examples, position_loss, target_features
from .heads import TrainHeadOptions, cached, data_description, split_answers, train_loop, vocab_remap, work_dir

if TYPE_CHECKING:
    from ..engine import LLMEngine

LORA_RANK = 32
SPLIT_OPTIONS = ("data", "code_only", "num_prompts", "max_tokens", "seed")  # these make the sequences and split
log = logging.getLogger(__name__)


def choice_pairs(flat: FlatExamples) -> Counter[tuple[int, int]]:
    """(token at j + 1, the target's choice after it) over every position j whose successor is in the same
    sequence."""
    j = torch.arange(len(flat.next_tok) - 1)
    ok = j + 1 < flat.seq_end[j]
    return Counter(zip(flat.next_tok[j[ok]].tolist(), flat.choice[j[ok] + 1].tolist()))


def _batch_loss(dart: DartDraft, flat: FlatExamples, batch: list[tuple[int, int]], width: int,
                remap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position summed cross-entropy [depth] and top-1 hits [depth] of one parallel pass."""
    t = torch.tensor([b[0] for b in batch])
    idx = t[:, None] - torch.arange(width - 1, -1, -1)[None]  # [B, width] window positions, oldest first
    with torch.no_grad():
        states = dart.base.fuse(flat.feats[idx].float())
    logits = dart.base.logits(dart(states, flat.next_tok[idx]))  # [B, depth, Vd]
    losses, hits = zip(*(position_loss(logits[:, j], flat, t, 1 + j, remap) for j in range(dart.config.depth)))
    return torch.stack(losses), torch.stack(hits)


def train_dart(engine: LLMEngine, opts: TrainHeadOptions, out_path: Path, base_path: Path, resume: bool = False,
               progress: bool = True) -> dict[str, object]:
    torch.manual_seed(opts.seed)
    started = time.perf_counter()
    if not base_path.exists():
        raise ValueError(f"DART adapts a trained EAGLE draft and {base_path} is missing: train one first "
                         f"(`turbospec train-head --model {engine.config.model} --method eagle`) or give --base")
    base, base_report = EagleDraft.load(base_path)
    base_split = {k: (base_report.get("options") or {}).get(k) for k in SPLIT_OPTIONS}  # type: ignore[union-attr]
    same_split = base_split == {k: getattr(opts, k) for k in SPLIT_OPTIONS}
    if not same_split:
        log.warning("the base %s was trained with other data options (%s): its training sequences may include "
                    "this run's held-out ones, so held-out accuracy may read high", base_path, base_split)
    cfg = engine.model_config
    if base.config.hidden_size != cfg.hidden_size or base.config.vocab_size != cfg.vocab_size:
        raise ValueError(f"{base_path} was trained for another model ({base.config.model})")
    model = engine.loaded.model
    base.attach(model.lm_head_weight.float(), model.embed.weight.float())

    split = split_answers(engine, opts, progress)
    n_seqs = len(split.train) + len(split.held_out)
    train_seqs = split.train[: opts.train_sequences] if opts.train_sequences else split.train
    # EAGLE's file holds every training sequence; a subset is cached apart
    suffix = f"-first{len(train_seqs)}" if opts.train_sequences else ""
    layers = base.config.feature_layers
    feats = cached(features_path(engine.config.model, opts, n_seqs, suffix),
                   lambda: target_features(engine, train_seqs + split.held_out, layers, WINDOW, progress))
    train = flat_examples(train_seqs, feats[: len(train_seqs)], WINDOW)
    held_out = flat_examples(split.held_out, feats[-len(split.held_out):], WINDOW)
    remap = vocab_remap(base.vocab, cfg.vocab_size)

    base_name = base_path.name if base_path.parent.resolve() == out_path.parent.resolve() else str(base_path.resolve())
    config = DartConfig(base_name, file_sha256(base_path), opts.num_heads, LORA_RANK, engine.config.model,
                        cfg.hidden_size, cfg.vocab_size)
    dart = DartDraft(config, base, ngram_table(choice_pairs(train), base.vocab))
    widths = random.Random(opts.seed)

    def loss_of(batch: list[int], step: int) -> torch.Tensor:
        examples = [train.examples[j] for j in batch]
        per_position, _ = _batch_loss(dart, train, examples, widths.randint(1, WINDOW), remap)
        return per_position.sum() / (len(examples) * config.depth)

    # the checkpoint belongs to this base, depth and data: --resume never continues another run's deltas
    ckpt = f"checkpoint-dart-{config.base_sha256[:12]}-{config.depth}-{len(train_seqs)}-{n_seqs}.pt"
    step, total_steps, losses, train_s = train_loop(
        dart, opts, len(train.examples), work_dir(engine.config.model) / ckpt, resume, loss_of,
        "training dart draft", progress)
    with torch.no_grad():
        hits = sum((_batch_loss(dart, held_out, held_out.examples[s: s + 512], WINDOW, remap)[1]
                    for s in range(0, len(held_out.examples), 512)), torch.zeros(config.depth, dtype=torch.long))
    accuracy = (hits.float() / max(1, len(held_out.examples))).tolist()
    report = {
        "options": asdict(opts), "steps": step, "total_steps": total_steps,
        "final_loss": losses[-1] if losses else None,
        "heldout_top1_accuracy": [round(a, 4) for a in accuracy],
        "train_positions": len(train.examples), "eval_positions": len(held_out.examples), "prompts": n_seqs,
        "train_sequences": len(train_seqs), "base": config.base, "ngram_pairs": len(dart.ngram_prev),
        "held_out_unseen_by_base": same_split,
        "seconds": round(time.perf_counter() - started, 1), "train_seconds": round(train_s, 1),
        "data": data_description(opts, n_seqs), "complete": step >= total_steps,
    }
    dart.save(out_path, report)
    return report
