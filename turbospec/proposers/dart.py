"""A DART-style parallel draft (DART 2601.19278): one forward of a draft layer predicts several future positions.

EAGLE (eagle.py) drafts position after position, one layer pass per tree level. DART appends `depth - 1` mask
entries after the window of target features and reads every position's distribution from one pass: the last
window entry's output predicts the next token, the i-th mask entry's output the token i positions later. The
per-position distributions do not see the tokens drafted before them, so the tree is built by a search that
adds an n-gram model's opinion of each step (`NgramScorer`): a path whose tokens the draft likes one by one but
which never follow each other in text is pruned.

Ours is built on our EAGLE draft rather than a layer of its own: the layer is the trained EAGLE file's, adapted
by low-rank deltas (LoRA) on its attention and MLP matrices, and a mask entry's input is the last window entry's
plus a learned offset per mask position (our layer has no positions: a mask must start from the latest state).
The file holds only those, the n-gram table and the base file's name and hash: under 1 MB next to the base's 4
(smollm2-135m) or 16 (qwen2.5-coder-1.5b), which is what the repository's 50 MB of heads leaves room for.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from torch.func import functional_call

from .eagle import EagleDraft, window_mask
from .heads import file_sha256, read_head_file, save_head_file

ADAPTED = ("qkv", "o", "gate_up", "down")  # the layer's matrices that get a low-rank delta
CONTEXT_WEIGHT = 4.0  # a pair seen in the request's own tokens counts this many corpus pairs


@dataclass
class DartConfig:
    base: str  # the EAGLE file the layer comes from (a name next to this file, or a path)
    base_sha256: str
    depth: int  # positions predicted per forward: the next token and depth - 1 masked ones after it
    lora_rank: int
    model: str
    hidden_size: int
    vocab_size: int
    method: str = "dart"


class DartDraft(nn.Module):
    """The base EAGLE layer (frozen, not part of this module's state) with LoRA deltas and mask entries."""

    def __init__(self, config: DartConfig, base: EagleDraft, ngram: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.config = config
        object.__setattr__(self, "base", base)  # kept out of state_dict: the base file holds it
        self.merged = False
        h, r = config.hidden_size, config.lora_rank
        self.mask = nn.Parameter(torch.randn(config.depth - 1, h) * 0.1)  # offsets from the last entry's input
        self.lora_a = nn.ParameterDict()
        self.lora_b = nn.ParameterDict()
        for name in ADAPTED:
            out_dim, in_dim = getattr(base, name).weight.shape
            self.lora_a[name] = nn.Parameter(torch.randn(r, in_dim) / math.sqrt(in_dim))
            self.lora_b[name] = nn.Parameter(torch.zeros(out_dim, r))  # starts as the base layer exactly
        for key, value in (ngram or {}).items():  # the n-gram table travels in the file
            self.register_buffer(key, value)

    @property
    def vocab(self) -> torch.Tensor:
        return self.base.vocab

    def adapted_weights(self) -> dict[str, torch.Tensor]:
        return {f"{name}.weight": getattr(self.base, name).weight + self.lora_b[name] @ self.lora_a[name]
                for name in ADAPTED}

    def merge(self) -> None:
        """Fold the deltas into the base layer's weights (inference: no extra products per call)."""
        with torch.no_grad():
            for key, weight in self.adapted_weights().items():
                getattr(self.base, key.split(".")[0]).weight.copy_(weight)
            for name in ADAPTED:
                self.lora_b[name].zero_()
        self.merged = True

    def forward(self, states: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor | None = None
                ) -> torch.Tensor:
        """states [B, W, H] (fused features), tokens [B, W] -> outputs [B, depth, H]: the last entry's and the
        masks'. valid [B, W] marks real entries (rows are right-aligned; padding on the left)."""
        b, w, _ = states.shape
        real = torch.ones(b, w, dtype=torch.bool) if valid is None else valid
        mask = window_mask(torch.cat([real, torch.ones(b, self.config.depth - 1, dtype=torch.bool)], dim=1))
        masks = self.mask[None].expand(b, -1, -1)
        if self.merged:
            out, _ = self.base(states, tokens, mask, appended=masks)
        else:  # training: the base weights plus the deltas, as parameters of this call only
            out, _ = functional_call(self.base, self.adapted_weights(), (states, tokens, mask), {"appended": masks},
                                     strict=False)
        return out[:, w - 1:]

    def save(self, path: Path, extra: dict[str, object]) -> None:
        save_head_file(path, self, asdict(self.config), extra)

    @classmethod
    def load(cls, path: Path, dtype: torch.dtype = torch.float32) -> tuple[DartDraft, dict[str, object]]:
        config, tensors, extra = read_head_file(path, "dart")
        cfg = DartConfig(**config)  # type: ignore[arg-type]
        base_path = _base_file(path, cfg.base)
        if not base_path.exists():
            raise ValueError(f"{path} adapts the EAGLE draft {base_path}, which is missing")
        if file_sha256(base_path) != cfg.base_sha256:
            raise ValueError(f"{base_path} is not the EAGLE draft {path} was trained on (its hash differs): retrain "
                             "with `turbospec train-head --method dart`")
        base, _ = EagleDraft.load(base_path, torch.float32)
        if not torch.equal(tensors.pop("vocab").long(), base.vocab):
            raise ValueError(f"{path} and its base {base_path} disagree on the draft vocabulary")
        ngram = {k: tensors.pop(k) for k in list(tensors) if k.startswith("ngram_")}
        draft = cls(cfg, base, ngram)
        draft.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in {**tensors, **ngram}.items()})
        draft.merge()  # in float32, then both cast once
        base.to(dtype)
        draft.to(dtype).requires_grad_(False).eval()
        return draft, extra


def ngram_table(pairs: Counter[tuple[int, int]], vocab: torch.Tensor, successors: int = 8, min_count: int = 2
                ) -> dict[str, torch.Tensor]:
    """The corpus bigram counts a DART file keeps: for each previous token, its `successors` most frequent next
    tokens within the draft vocabulary seen at least `min_count` times (as flat sorted arrays), and each previous
    token's total count."""
    in_vocab = set(vocab.tolist())
    by_prev: dict[int, list[tuple[int, int]]] = {}
    totals: Counter[int] = Counter()
    for (p, c), n in pairs.items():
        totals[p] += n
        if c in in_vocab and n >= min_count:
            by_prev.setdefault(p, []).append((n, c))
    rows = sorted((p, c, n) for p, lst in by_prev.items() for n, c in sorted(lst, reverse=True)[:successors])
    prevs = sorted(totals)
    return {"ngram_prev": torch.tensor([r[0] for r in rows], dtype=torch.int32),
            "ngram_next": torch.tensor([r[1] for r in rows], dtype=torch.int32),
            "ngram_count": torch.tensor([r[2] for r in rows], dtype=torch.int32),
            "ngram_total_prev": torch.tensor(prevs, dtype=torch.int32),
            "ngram_total": torch.tensor([totals[p] for p in prevs], dtype=torch.int32)}


class NgramScorer:
    """log P(next | previous) from the file's corpus bigrams and the request's own tokens:
    P = (n(p, c) + 1 / V) / (n(p) + 1), n counting a context pair `CONTEXT_WEIGHT` times. An unseen previous token
    gives 1 / V (no opinion beyond uniform); an unseen pair after a frequent previous token gives much less
    (1 / (V (n(p) + 1))): a strong penalty, since the table keeps only each token's most frequent successors."""

    def __init__(self, table: dict[str, torch.Tensor], vocab_size: int) -> None:
        self.pairs = {(int(p), int(c)): int(n) for p, c, n in zip(table["ngram_prev"].tolist(),
                                                                   table["ngram_next"].tolist(),
                                                                   table["ngram_count"].tolist())}
        self.totals = dict(zip(table["ngram_total_prev"].tolist(), table["ngram_total"].tolist()))
        self.floor = 1.0 / vocab_size

    def log_prob(self, prev: int, nxt: int, context: Counter[tuple[int, int]], context_totals: Counter[int]
                 ) -> float:
        n = self.pairs.get((prev, nxt), 0) + CONTEXT_WEIGHT * context.get((prev, nxt), 0)
        total = self.totals.get(prev, 0) + CONTEXT_WEIGHT * context_totals.get(prev, 0)
        return math.log((n + self.floor) / (total + 1.0))


def _base_file(path: Path, base: str) -> Path:
    """Where a DART file's base is: a name is beside the file; an absolute path (a run whose --out was outside the
    base's folder records one) is used while it exists, else the same name beside the file, so the two files can be
    moved together (the base's hash is checked either way)."""
    recorded = Path(base)
    if not recorded.is_absolute():
        return path.parent / recorded
    return recorded if recorded.exists() else path.parent / recorded.name
