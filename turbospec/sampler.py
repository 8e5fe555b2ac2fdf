"""Batched, per-row sampling over a ``[N, V]`` logits tensor.

Every row carries its own :class:`~turbospec.sampling_params.SamplingParams`.
The functions here are pure (apart from advancing the per-row generators in
:func:`sample`) so that speculative rejection sampling can reuse
:func:`processed_probs` for both the target (p) and draft (q) distributions.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from turbospec.outputs import Logprob
from turbospec.request import Request
from turbospec.sampling_params import SamplingParams

# Tokens whose preceding cumulative mass is within this of top_p count as
# having reached it: softmax(log(p)) is only float32-exact, and without the
# slack top_p=0.8 over [0.5, 0.3, ...] would flip between keeping 2 and 3.
_TOP_P_TOL = 1e-6

# torch's CPU generator (mt19937) only uses the low 32 bits of its seed.
_SEED_SPACE = 1 << 32

# Unseeded generators: random base + counter, so streams in one process are
# guaranteed distinct (for 2**32 requests) and differ between processes.
_UNSEEDED_BASE = int.from_bytes(os.urandom(4), "little")
_UNSEEDED_COUNTER = itertools.count()


@dataclass
class SamplingBatch:
    """Per-row sampling parameters packed into tensors once per step.

    Rows with top-k disabled hold ``top_k == V``; greedy rows hold
    ``temperature == 1`` (their temperature is never used, and 1 keeps the
    vectorised division finite) and a ``None`` generator.
    """

    temperature: torch.Tensor  # [N] float32
    top_k: torch.Tensor  # [N] int64
    top_p: torch.Tensor  # [N] float32
    min_p: torch.Tensor  # [N] float32
    greedy: torch.Tensor  # [N] bool
    generators: list[torch.Generator | None]
    # Host-side summaries filled by build() so the per-step hot path needs no
    # device->host syncs; None (direct construction) means "derive from the
    # tensors".
    sampled_rows: list[int] | None = field(default=None, repr=False)
    truncates: bool | None = field(default=None, repr=False)
    uses_min_p: bool | None = field(default=None, repr=False)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> SamplingBatch:
        """Pack one ``SamplingParams`` (and generator) per logits row.

        Several rows may share the same params object and generator (e.g. the
        verification rows of one speculative request); a shared generator is
        advanced once per row, in row order.
        """
        if len(params) != len(generators):
            raise ValueError(
                f"need one generator per row: {len(params)} params, {len(generators)} generators"
            )
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        greedy = [p.greedy for p in params]
        for i, (g, is_greedy) in enumerate(zip(generators, greedy)):
            if g is None and not is_greedy:
                raise ValueError(f"row {i} samples (temperature > 0) but has no generator")
        return cls(
            temperature=torch.tensor(
                [1.0 if gr else p.temperature for p, gr in zip(params, greedy)],
                dtype=torch.float32,
                device=device,
            ),
            top_k=torch.tensor(
                [vocab_size if p.top_k < 1 else min(p.top_k, vocab_size) for p in params],
                dtype=torch.int64,
                device=device,
            ),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            generators=list(generators),
            sampled_rows=[i for i, gr in enumerate(greedy) if not gr],
            truncates=any(0 < p.top_k < vocab_size or p.top_p < 1.0 for p in params),
            uses_min_p=any(p.min_p > 0 for p in params),
        )

    @property
    def num_rows(self) -> int:
        """Number of logits rows N."""
        return self.greedy.shape[0]

    @property
    def all_greedy(self) -> bool:
        """True when every row is greedy, so no filtering or noise is needed."""
        return len(self.rows_to_sample()) == 0

    def rows_to_sample(self) -> list[int]:
        """Indices of the non-greedy rows, in row order."""
        if self.sampled_rows is None:
            self.sampled_rows = (~self.greedy).nonzero().flatten().tolist()
        return self.sampled_rows

    def needs_sort(self, vocab_size: int) -> bool:
        """Whether any row uses top-k or top-p (the only steps that sort)."""
        if self.truncates is None:
            self.truncates = bool((self.top_k < vocab_size).any() or (self.top_p < 1.0).any())
        return self.truncates

    def needs_min_p(self) -> bool:
        """Whether any row uses min-p."""
        if self.uses_min_p is None:
            self.uses_min_p = bool((self.min_p > 0).any())
        return self.uses_min_p


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(logits)
    out.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return out


def _apply_top_k_top_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and then its nucleus."""
    num_rows, vocab = logits.shape
    # Stable sort: ties are broken towards the lower token id, so top-k keeps
    # exactly k tokens deterministically.
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=logits.device).expand(num_rows, vocab)
    sorted_logits = sorted_logits.masked_fill(rank >= batch.top_k.unsqueeze(1), float("-inf"))

    uses_top_p = batch.top_p < 1.0
    if bool(uses_top_p.any()):
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = mass_before >= (batch.top_p - _TOP_P_TOL).unsqueeze(1)
        drop[:, 0] = False  # the most likely token always survives
        # Rows with top_p == 1 are left untouched: the tolerance must not
        # trim their far tail, the distribution has to stay exact.
        drop &= uses_top_p.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))

    return torch.empty_like(logits).scatter_(-1, sorted_ids, sorted_logits)


def processed_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Return the exact distribution each row samples from, ``[N, V]`` float32.

    Order: ``logits / temperature`` -> top-k -> top-p (smallest set of most
    likely tokens whose mass >= top_p, at least one) -> min-p (drop tokens
    with prob < min_p * max prob) -> softmax. Greedy rows are one-hot at the
    argmax of the raw logits.
    """
    logits = logits.float()
    if batch.all_greedy:
        return _one_hot_argmax(logits)

    scaled = logits / batch.temperature.unsqueeze(1)
    # Sorting is the expensive part; skip it when no row truncates.
    if batch.needs_sort(logits.shape[-1]):
        scaled = _apply_top_k_top_p(scaled, batch)

    probs = scaled.softmax(dim=-1)
    if batch.needs_min_p():
        max_prob = probs.max(dim=-1, keepdim=True).values
        keep = probs >= batch.min_p.unsqueeze(1) * max_prob
        probs = probs * keep
        probs = probs / probs.sum(dim=-1, keepdim=True)

    if len(batch.rows_to_sample()) < batch.num_rows:
        probs = torch.where(batch.greedy.unsqueeze(1), _one_hot_argmax(logits), probs)
    return probs


def sample(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Draw one token per row from ``probs`` (as returned by :func:`processed_probs`).

    Greedy rows take the argmax. Other rows use the exponential race
    ``argmax(probs / E)``, ``E ~ Exp(1)`` drawn from the row's own generator,
    which yields exactly ``probs`` and makes a seeded row's token independent
    of its batch-mates and row index. Each sampled row consumes V exponentials
    from its generator per call.
    """
    vocab = probs.shape[-1]
    tokens = probs.argmax(dim=-1)
    if batch.all_greedy:
        return tokens

    rows = batch.rows_to_sample()
    # Noise is drawn on CPU generators (then moved) so a seed gives the same
    # tokens whatever device the logits live on.
    noise = torch.stack(
        [torch.empty(vocab).exponential_(generator=batch.generators[i]) for i in rows]
    ).to(probs.device)
    # An exact-zero draw would turn a zero-probability token into 0/0 = NaN,
    # which argmax would happily pick.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    row_ids = torch.tensor(rows, dtype=torch.int64, device=probs.device)
    tokens[row_ids] = (probs[row_ids].float() / noise).argmax(dim=-1)
    return tokens


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probs of the raw logits (before temperature / filters, as vLLM).

    Returns ``(chosen [N], top_values [N, num_top], top_ids [N, num_top])``
    with the top entries sorted descending; ``num_top == 0`` gives empty
    ``[N, 0]`` tensors.
    """
    vocab = logits.shape[-1]
    if not 0 <= num_top <= vocab:
        raise ValueError(f"num_top must be in [0, {vocab}], got {num_top}")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)
    top_values, top_ids = logprobs.topk(num_top, dim=-1, largest=True, sorted=True)
    return chosen, top_values, top_ids


def fold_seed(seed: int) -> int:
    if 0 <= seed < _SEED_SPACE:
        return seed  # identical to torch.Generator().manual_seed(seed)
    # torch would silently drop the high bits (or overflow); hash instead so
    # big / negative seeds still give distinct, reproducible streams.
    digest = hashlib.blake2b(str(seed).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def make_generator(seed: int | None) -> torch.Generator:
    """CPU generator for one request: reproducible if seeded, unique otherwise.

    Seeds in ``[0, 2**32)`` behave exactly like
    ``torch.Generator().manual_seed(seed)``; other ints are hashed into that
    range because torch's CPU generator ignores the high bits.
    """
    if seed is None:
        folded = (_UNSEEDED_BASE + next(_UNSEEDED_COUNTER)) % _SEED_SPACE
    else:
        folded = fold_seed(seed)
    return torch.Generator().manual_seed(folded)


def position_generator(noise_seed: int, position: int) -> torch.Generator:
    """The generator for one token position of one request (deterministic modes): a token's noise then
    depends on nothing but the request's seed and where the token sits, not on how many tokens the step that
    produced it computed (speculation, verified-window replays)."""
    digest = hashlib.blake2b(f"{noise_seed}:{position}".encode(), digest_size=4).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little"))


def positional_sample(logits: torch.Tensor, probs: torch.Tensor,
                      noise: Sequence[tuple[int, int] | None]) -> tuple[list[int], torch.Tensor]:
    """Sample every row with position-keyed noise; also return each row's margin (float32 [N], nats).

    noise[i] is (noise_seed, position) for a sampled row, None for a greedy one. A row's score is its raw
    logit (greedy) or ``log p - log E`` with ``E ~ Exp(1)`` from the row's position generator (the exponential
    race of :func:`sample` in log space, exactly distributed as ``probs``). The token is the top score and the
    margin is top-1 minus top-2 score: how far the row's numbers would have to move to change the token.
    """
    scores = logits.float().clone()
    rows = [i for i, key in enumerate(noise) if key is not None]
    if rows:
        vocab = probs.shape[-1]
        draws = torch.stack([torch.empty(vocab).exponential_(generator=position_generator(*noise[i]))
                             for i in rows]).to(probs.device).clamp_(min=torch.finfo(torch.float32).tiny)
        row_ids = torch.tensor(rows, dtype=torch.int64, device=probs.device)
        scores[row_ids] = probs[row_ids].float().log() - draws.log()
    top = scores.topk(2, dim=-1)
    margins = top.values[:, 0] - top.values[:, 1]
    return top.indices[:, 0].tolist(), margins


def token_logprobs(reqs: list[Request], logits: torch.Tensor, tokens: torch.Tensor) -> list[dict[int, Logprob] | None]:
    """Each row's sampled token with its log-prob and the request's top-n alternatives (None: not asked for)."""
    wanted = [r.params.logprobs for r in reqs if r.params.logprobs is not None]
    if not wanted:
        return [None] * len(reqs)
    chosen, top_vals, top_ids = compute_logprobs(logits, tokens, max(wanted))
    result: list[dict[int, Logprob] | None] = []
    for i, req in enumerate(reqs):
        n = req.params.logprobs
        if n is None:
            result.append(None)
            continue
        tok = int(tokens[i])
        entry = {tok: Logprob(chosen[i].item())}
        for rank, (value, alt) in enumerate(zip(top_vals[i, :n].tolist(), top_ids[i, :n].tolist()), start=1):
            entry.setdefault(alt, Logprob(value, rank))
            if alt == tok:
                entry[tok].rank = rank
        result.append(entry)
    return result
