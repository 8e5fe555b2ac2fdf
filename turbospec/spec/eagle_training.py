"""Train the EAGLE-style draft (eagle.py) by self-distillation: ``turbospec train-head --method eagle``.

The same data as the heads (head_training.py: the target's own greedy answers to ShareGPT first turns, cached),
with richer features: for each position from `window` before the answer to its end, the outputs of the
feature layers and the final hidden state. A training example is an answer position t with a window of the
entries before it; the draft predicts the token at t + 2, then, as at inference, appends its own output with
the true next token and predicts again, `depth` times (EAGLE-3's training-time test). Window lengths are drawn
per batch from 1 to `window`, because a fresh request starts with a window of one entry.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..runner import SeqInput
from .eagle import EagleConfig, EagleDraft, default_feature_layers
from .head_training import IGNORE, PROMPT_SKIP, TrainHeadOptions, cached, split_answers, train_loop, work_dir

if TYPE_CHECKING:
    from ..engine import LLMEngine

WINDOW = 16


@torch.inference_mode()
def target_features(engine: LLMEngine, sequences: list[tuple[list[int], int]], layers: list[int], window: int,
                    progress: bool = True) -> list[tuple[torch.Tensor, int]]:
    """Per sequence: features [n, (len(layers) + 1) H] bf16 of positions first .. len-2 and `first`, which is
    `window` positions before the answer's first prediction (or 0)."""
    model = engine.loaded.model
    saved = model.capture_layers
    model.capture_layers = tuple(layers)
    out = []
    try:
        for i, (ids, plen) in enumerate(tqdm(sequences, desc="target features", unit="seq", disable=not progress)):
            first = max(0, plen - 1 - window)
            rid = f"eagle-features-{i}"
            engine.blocks.allocate(rid, ids, len(ids) - 1)
            try:
                feats = engine.runner.run([SeqInput(rid, ids[:-1], 0, len(ids) - 1 - first)]).features
            finally:
                engine.blocks.free(rid)
            assert feats is not None
            out.append((feats.to(torch.bfloat16), first))
    finally:
        model.capture_layers = saved
    return out


def _examples(sequences: list[tuple[list[int], int]], feats: list[tuple[torch.Tensor, int]], window: int
              ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """Flat features [N, F] and next tokens [N] (the token each feature's row chose), and the examples: (flat index
    of position t, flat index of the sequence's first position), for answer positions with a full window."""
    all_feats, all_next, examples = [], [], []
    base = 0
    for (ids, plen), (f, first) in zip(sequences, feats):
        n = f.shape[0]  # positions first .. len-2
        all_feats.append(f)
        all_next.append(torch.tensor(ids[first + 1: first + 1 + n]))
        for t in range(max(plen - 1, first + window - 1), len(ids) - 2):
            examples.append((base + t - first, base))
        base += n
    return torch.cat(all_feats), torch.cat(all_next), examples


def _batch_loss(draft: EagleDraft, feats: torch.Tensor, next_tok: torch.Tensor, batch: list[tuple[int, int]],
                width: int, depth: int, remap: torch.Tensor, seq_end: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Unrolled loss over `depth` draft steps for a batch of positions with windows of `width` entries."""
    t = torch.tensor([b[0] for b in batch])
    idx = t[:, None] - torch.arange(width - 1, -1, -1)[None]  # [B, width] window positions, oldest first
    states = draft.fuse(feats[idx].float())
    tokens = next_tok[idx]
    mask = torch.ones(width, width, dtype=torch.bool).tril()[None].expand(len(batch), -1, -1)
    past = None
    losses, hits = [], []
    for step in range(depth):
        outs, past = draft(states, tokens, mask, past)
        out = outs[:, -1]
        target_pos = t + 1 + step  # the label: the token chosen at position t + 1 + step (its next_tok)
        ok = target_pos < seq_end[t]
        label = remap[next_tok[target_pos.clamp(max=len(next_tok) - 1)]]
        label = torch.where(ok & (label >= 0), label, torch.full_like(label, IGNORE))
        logits = draft.logits(out)
        losses.append(F.cross_entropy(logits, label, ignore_index=IGNORE, reduction="sum"))
        with torch.no_grad():
            hits.append(((logits.argmax(-1) == label) & (label != IGNORE)).sum())
        # the next entry: the draft's own output with the true token (teacher forcing on tokens), which sees
        # every entry before it
        states = out[:, None]
        tokens = next_tok[target_pos.clamp(max=len(next_tok) - 1)][:, None]
        mask = torch.ones(len(batch), 1, width + step + 1, dtype=torch.bool)
    return torch.stack(losses), torch.stack(hits)


def train_eagle(engine: LLMEngine, opts: TrainHeadOptions, out_path: Path, resume: bool = False,
                progress: bool = True) -> dict[str, object]:
    torch.manual_seed(opts.seed)
    started = time.perf_counter()
    split = split_answers(engine, opts, progress)
    n_seqs = len(split.train) + len(split.held_out)
    cfg = engine.model_config
    layers = default_feature_layers(cfg.num_layers)
    feats = cached(work_dir(engine.config.model) / f"eagle-features-{PROMPT_SKIP}-{opts.max_tokens}-{n_seqs}.pt",
                   lambda: target_features(engine, split.train + split.held_out, layers, WINDOW, progress))
    depth = opts.num_heads
    f_train, n_train, ex_train = _examples(split.train, feats[: len(split.train)], WINDOW)
    f_eval, n_eval, ex_eval = _examples(split.held_out, feats[len(split.train):], WINDOW)
    end_train = _sequence_ends(f_train.shape[0], feats[: len(split.train)])
    end_eval = _sequence_ends(f_eval.shape[0], feats[len(split.train):])

    h = cfg.hidden_size
    config = EagleConfig(h, layers, max(16, h // 4), 256, 512, WINDOW, depth, engine.config.model, cfg.vocab_size)
    model = engine.loaded.model
    draft = EagleDraft(config, split.vocab)
    lm_weight = model.embed.weight if model.lm_head is None else model.lm_head.weight
    draft.attach(lm_weight.float(), model.embed.weight.float())
    widths = random.Random(opts.seed)

    def loss_of(batch: list[int], step: int) -> torch.Tensor:
        examples = [ex_train[j] for j in batch]
        per_step, _ = _batch_loss(draft, f_train, n_train, examples, widths.randint(1, WINDOW), depth, split.remap,
                                  end_train)
        return per_step.sum() / (len(examples) * depth)

    step, total_steps, losses, train_s = train_loop(
        draft, opts, len(ex_train), work_dir(engine.config.model) / "checkpoint-eagle.pt", resume, loss_of,
        "training eagle draft", progress)
    with torch.no_grad():
        _, hits = _batch_loss(draft, f_eval, n_eval, ex_eval, WINDOW, depth, split.remap, end_eval)
    accuracy = (hits.float() / max(1, len(ex_eval))).tolist()
    report = {
        "options": asdict(opts), "steps": step, "total_steps": total_steps,
        "final_loss": losses[-1] if losses else None,
        "heldout_top1_accuracy": [round(a, 4) for a in accuracy], "train_positions": len(ex_train),
        "eval_positions": len(ex_eval), "prompts": n_seqs, "feature_layers": layers, "window": WINDOW,
        "seconds": round(time.perf_counter() - started, 1), "train_seconds": round(train_s, 1),
        "data": f"sharegpt[{PROMPT_SKIP}:{PROMPT_SKIP + n_seqs}] first turns, the target's greedy answers",
        "complete": step >= total_steps,
    }
    draft.save(out_path, report)
    return report


def _sequence_ends(total: int, feats: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """For every flat position, the flat index one past its sequence's last position (labels never cross it)."""
    ends = torch.empty(total, dtype=torch.long)
    base = 0
    for f, _ in feats:
        ends[base: base + f.shape[0]] = base + f.shape[0]
        base += f.shape[0]
    return ends
