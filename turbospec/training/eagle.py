"""Train the EAGLE-style draft (eagle.py) by self-distillation: ``turbospec train-head --method eagle``.

The data (training/heads.py): the target's own greedy answers to ShareGPT first turns, or ShareGPT's recorded
answers read teacher-forced (`--data conversations`: one forward per conversation instead of a generation, so
several times more positions per CPU second). Features: for each position from `window` before the answer to its
end, the outputs of the feature layers and the final hidden state, and the token the target would choose there
(its greedy choice: the label; for its own greedy answers that is the next token itself). A training example is
an answer position t with a window of the entries before it; the draft predicts the target's choice after the
token at t + 1, then, as at inference, appends its own output with the next token and predicts again, `depth`
times (EAGLE-3's training-time test). Window lengths are drawn per batch from 1 to `window`, because a fresh
request starts with a window of one entry. The draft vocabulary is the target's most frequent choices.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..proposers.eagle import EagleConfig, EagleDraft, default_feature_layers
from ..proposers.heads import file_sha256
from ..runner import SeqInput
from .heads import (IGNORE, PROMPT_SKIP, TrainHeadOptions, cached, data_description, split_answers, train_loop,
                    vocab_remap, work_dir)

if TYPE_CHECKING:
    from ..engine import LLMEngine

WINDOW = 16


@torch.inference_mode()
def target_features(engine: LLMEngine, sequences: list[tuple[list[int], int]], layers: list[int], window: int,
                    progress: bool = True) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
    """Per sequence: features [n, (len(layers) + 1) H] bf16 of positions first .. len-2, `first` (`window`
    positions before the answer's first prediction, or 0), and the target's greedy choice at each of them [n]."""
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
                run = engine.runner.run([SeqInput(rid, ids[:-1], 0, len(ids) - 1 - first)])
            finally:
                engine.blocks.free(rid)
            assert run.features is not None and run.logits is not None
            out.append((run.features.to(torch.bfloat16), first, run.logits.argmax(-1).to(torch.int32)))
    finally:
        model.capture_layers = saved
    return out


Features = list[tuple[torch.Tensor, int, torch.Tensor]]


def features_path(model: str, opts: TrainHeadOptions, n_seqs: int, suffix: str = "") -> Path:
    """Where the target features of a data set are cached (EAGLE and DART share them)."""
    tag = f"{opts.data}{'-code' if opts.code_only else ''}-{PROMPT_SKIP}-{opts.max_tokens}-{n_seqs}{suffix}"
    return work_dir(model) / f"eagle-features-{tag}.pt"


@dataclass
class FlatExamples:
    feats: torch.Tensor  # [N, F] every kept position's features
    next_tok: torch.Tensor  # [N] the token that follows each position in the sequence (the entry's token)
    choice: torch.Tensor  # [N] the target's greedy choice at each position (the label)
    examples: list[tuple[int, int]]  # (flat index of position t, flat index of its sequence's first position)
    seq_end: torch.Tensor  # [N] one past the last flat index of each position's sequence


def flat_examples(sequences: list[tuple[list[int], int]], feats: Features, window: int) -> FlatExamples:
    """Flat rows of every sequence, and the examples: answer positions with a full window."""
    all_feats, all_next, all_choice, examples, ends = [], [], [], [], []
    base = 0
    for (ids, plen), (f, first, choice) in zip(sequences, feats):
        n = f.shape[0]  # positions first .. len-2
        all_feats.append(f)
        all_next.append(torch.tensor(ids[first + 1: first + 1 + n]))
        all_choice.append(choice.long())
        for t in range(max(plen - 1, first + window - 1), len(ids) - 2):
            examples.append((base + t - first, base))
        base += n
        ends.append(torch.full((n,), base))
    return FlatExamples(torch.cat(all_feats), torch.cat(all_next), torch.cat(all_choice), examples, torch.cat(ends))


def choice_vocabulary(flat: FlatExamples, size: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft vocabulary: the `size` tokens the target chooses most often at the training examples' label
    positions; and the remap [V] to its indices (-1 outside)."""
    t = torch.tensor([e[0] for e in flat.examples], dtype=torch.long)
    labels = flat.choice[(t + 1).clamp(max=len(flat.choice) - 1)]
    counts = torch.bincount(labels, minlength=vocab_size)
    vocab = torch.sort(torch.topk(counts, min(size, int((counts > 0).sum()))).indices).values
    return vocab, vocab_remap(vocab, vocab_size)


def position_loss(logits: torch.Tensor, flat: FlatExamples, t: torch.Tensor, ahead: int, remap: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy and top-1 hits of logits [B, Vd] whose label is the target's choice at position
    t + ahead (none past the sequence's end or outside the draft vocabulary)."""
    pos = t + ahead
    label = remap[flat.choice[pos.clamp(max=len(flat.choice) - 1)]]
    label = torch.where((pos < flat.seq_end[t]) & (label >= 0), label, torch.full_like(label, IGNORE))
    loss = F.cross_entropy(logits, label, ignore_index=IGNORE, reduction="sum")
    with torch.no_grad():
        hits = ((logits.argmax(-1) == label) & (label != IGNORE)).sum()
    return loss, hits


def _batch_loss(draft: EagleDraft, flat: FlatExamples, batch: list[tuple[int, int]], width: int, depth: int,
                remap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unrolled loss over `depth` draft steps for a batch of positions with windows of `width` entries."""
    next_tok = flat.next_tok
    t = torch.tensor([b[0] for b in batch])
    idx = t[:, None] - torch.arange(width - 1, -1, -1)[None]  # [B, width] window positions, oldest first
    states = draft.fuse(flat.feats[idx].float())
    tokens = next_tok[idx]
    mask = torch.ones(width, width, dtype=torch.bool).tril()[None].expand(len(batch), -1, -1)
    past = None
    losses, hits = [], []
    for step in range(depth):
        outs, past = draft(states, tokens, mask, past)
        out = outs[:, -1]
        loss, hit = position_loss(draft.logits(out), flat, t, 1 + step, remap)
        losses.append(loss)
        hits.append(hit)
        # the next entry: the draft's own output with the true token (teacher forcing on tokens), which sees
        # every entry before it
        states = out[:, None]
        tokens = next_tok[(t + 1 + step).clamp(max=len(next_tok) - 1)][:, None]
        mask = torch.ones(len(batch), 1, width + step + 1, dtype=torch.bool)
    return torch.stack(losses), torch.stack(hits)


def heldout_accuracy(draft: EagleDraft, held_out: FlatExamples, depth: int, remap: torch.Tensor) -> list[float]:
    """Top-1 accuracy per draft step over every held-out example (a label outside the vocabulary is a miss)."""
    with torch.no_grad():
        _, hits = _batch_loss(draft, held_out, held_out.examples, WINDOW, depth, remap)
    return [round(float(h) / max(1, len(held_out.examples)), 4) for h in hits]


def initial_draft(path: Path, model: str, layers: list[int], depth: int) -> EagleDraft:
    """A trained EAGLE file to fine-tune (--init): it must be this target's, with the same feature layers, window
    and depth, and it keeps its draft vocabulary (its LM-head rows are what its outputs were trained against)."""
    draft, _ = EagleDraft.load(path)
    cfg = draft.config
    if (cfg.model, list(cfg.feature_layers), cfg.window, cfg.depth) != (model, layers, WINDOW, depth):
        raise ValueError(f"--init {path} was trained for {cfg.model} (feature layers {cfg.feature_layers}, window "
                         f"{cfg.window}, depth {cfg.depth}); this run needs {model} ({layers}, {WINDOW}, {depth})")
    return draft.requires_grad_(True)


def train_eagle(engine: LLMEngine, opts: TrainHeadOptions, out_path: Path, resume: bool = False,
                progress: bool = True) -> dict[str, object]:
    torch.manual_seed(opts.seed)
    started = time.perf_counter()
    split = split_answers(engine, opts, progress)
    n_seqs = len(split.train) + len(split.held_out)
    cfg = engine.model_config
    layers = default_feature_layers(cfg.num_layers)
    feats = cached(features_path(engine.config.model, opts, n_seqs),
                   lambda: target_features(engine, split.train + split.held_out, layers, WINDOW, progress))
    depth = opts.num_heads
    train = flat_examples(split.train, feats[: len(split.train)], WINDOW)
    held_out = flat_examples(split.held_out, feats[len(split.train):], WINDOW)
    h = cfg.hidden_size
    model = engine.loaded.model
    init: dict[str, object] | None = None
    if opts.init:
        draft = initial_draft(Path(opts.init), engine.config.model, layers, depth)
        vocab, remap = draft.vocab, vocab_remap(draft.vocab, cfg.vocab_size)
    else:
        vocab, remap = choice_vocabulary(train, opts.draft_vocab, cfg.vocab_size)
        config = EagleConfig(h, layers, max(16, h // 4), 256, 512, WINDOW, depth, engine.config.model,
                             cfg.vocab_size)
        draft = EagleDraft(config, vocab)
    draft.attach(model.lm_head_weight.float(), model.embed.weight.float())
    if opts.init:  # what the starting point scores on this held-out set: the gain fine-tuning made
        init = {"file": Path(opts.init).name, "sha256": file_sha256(Path(opts.init)),
                "heldout_top1_accuracy": heldout_accuracy(draft, held_out, depth, remap)}
    widths = random.Random(opts.seed)

    def loss_of(batch: list[int], step: int) -> torch.Tensor:
        examples = [train.examples[j] for j in batch]
        per_step, _ = _batch_loss(draft, train, examples, widths.randint(1, WINDOW), depth, remap)
        return per_step.sum() / (len(examples) * depth)

    step, total_steps, losses, train_s = train_loop(
        draft, opts, len(train.examples), work_dir(engine.config.model) / "checkpoint-eagle.pt", resume, loss_of,
        "training eagle draft", progress)
    accuracy = heldout_accuracy(draft, held_out, depth, remap)
    t = torch.tensor([e[0] for e in held_out.examples], dtype=torch.long)
    coverage = float((remap[held_out.choice[t + 1]] >= 0).float().mean()) if len(t) else 0.0
    report = {
        "options": asdict(opts), "steps": step, "total_steps": total_steps,
        "final_loss": losses[-1] if losses else None,
        "heldout_top1_accuracy": accuracy, "draft_vocab_coverage": round(coverage, 4),
        "train_positions": len(train.examples), "eval_positions": len(held_out.examples), "prompts": n_seqs,
        "feature_layers": layers, "window": WINDOW,
        "seconds": round(time.perf_counter() - started, 1), "train_seconds": round(train_s, 1),
        "data": data_description(opts, n_seqs),
        "complete": step >= total_steps,
    }
    if init is not None:
        report["init"] = init
    draft.save(out_path, report)
    return report
