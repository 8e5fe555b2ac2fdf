"""Lossless speculative verification (Leviathan et al. 2211.17192, Chen et al. 2302.01318).

For request ``i`` with drafts ``x_0..x_{k-1}`` sampled from ``q_0..q_{k-1}`` and
target distributions ``p_0..p_k`` (one verified row per draft plus a bonus row):

* for ``j = 0..k-1`` accept ``x_j`` with probability ``min(1, p_j(x_j) / q_j(x_j))``;
* at the first rejection emit a token from ``normalize(max(0, p_j - q_j))`` and stop;
* if every draft is accepted emit a bonus token from ``p_k``.

Why it is lossless: the probability of emitting ``x`` at position ``j`` is
``q(x) min(1, p(x)/q(x)) = min(p(x), q(x))`` through acceptance plus
``(1 - sum_y min(p(y), q(y))) * max(0, p(x) - q(x)) / sum_y max(0, p(y) - q(y))``
through the residual; both normalisers equal ``sum_y max(0, p(y) - q(y))``, so
the total is ``min(p, q) + max(0, p - q) = p(x)``. By induction over positions
the emitted tokens are distributed exactly as sampling from the target one
token at a time. A deterministic proposer (n-gram) has one-hot ``q``: the
acceptance probability becomes ``p_j(x_j)`` and the residual ``p_j`` with
``x_j`` removed. Greedy requests have one-hot ``p``, so they accept exactly the
drafts that equal the target's argmax and use no randomness.

Randomness: a sampled request draws ``k_i`` uniforms and then ``V``
exponentials (for its final token) from its own generator on every call,
whatever the outcome, so a seeded request's result and generator state never
depend on its batch-mates or its row position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

# A residual with less mass than this is float noise from p == q: rejection
# there has probability < _RESIDUAL_EPS, and its normalised shape would be
# meaningless, so we fall back to sampling from p itself.
_RESIDUAL_EPS = 1e-6


@dataclass
class VerifyOutput:
    """Result of verifying one batch of speculative requests."""

    tokens: list[list[int]]  # per request: accepted drafts + one correction/bonus token
    num_accepted: list[int]  # per request: accepted draft tokens (0..k_i)
    # per draft position of every request, flat: what the exact (lossless) rule decided, before any relaxation
    exact_accepted: list[bool] = field(default_factory=list)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Unnormalised ``max(0, p - q)`` per row, or ``p`` where that is ~0.

    No normalisation is needed: the exponential race ``argmax(w / E)`` samples
    proportionally to ``w`` whatever its sum. Bonus rows pass ``q = 0``.
    """
    res = (p - q).clamp_(min=0.0)
    return torch.where(res.sum(dim=-1, keepdim=True) > _RESIDUAL_EPS, res, p)


def _check_inputs(
    target_probs: torch.Tensor,
    row_start: list[int],
    draft_tokens: list[list[int]],
    draft_probs: list[torch.Tensor | None],
    generators: list[torch.Generator | None],
) -> None:
    n = len(draft_tokens)
    if not len(row_start) == len(draft_probs) == len(generators) == n:
        raise ValueError("row_start, draft_tokens, draft_probs and generators need one entry per request")
    num_rows, vocab = target_probs.shape
    for i, (start, drafts, dp) in enumerate(zip(row_start, draft_tokens, draft_probs)):
        if start < 0 or start + len(drafts) >= num_rows:
            raise ValueError(f"request {i}: rows {start}..{start + len(drafts)} outside [0, {num_rows})")
        if dp is not None and tuple(dp.shape) != (len(drafts), vocab):
            raise ValueError(f"request {i}: draft_probs shape {tuple(dp.shape)} != {(len(drafts), vocab)}")


def verify(
    target_probs: torch.Tensor,
    row_start: list[int],
    draft_tokens: list[list[int]],
    draft_probs: list[torch.Tensor | None],
    generators: list[torch.Generator | None],
    relaxed: torch.Tensor | None = None,
) -> VerifyOutput:
    """Accept/reject every request's drafts and emit one extra token each.

    ``target_probs`` holds processed target distributions (see
    :func:`turbospec.sampler.processed_probs`); request ``i`` owns rows
    ``row_start[i] .. row_start[i] + k_i``. ``draft_probs[i]`` is ``[k_i, V]``
    or ``None`` for a deterministic proposer (one-hot ``q``). A ``None``
    generator marks a greedy request. See the module docstring for the rule.

    ``relaxed`` (bool, one per draft position, flat over requests) marks positions a lossy acceptance policy
    accepts whatever the exact rule says (verification/lossy.py); the result is then no longer lossless.
    """
    _check_inputs(target_probs, row_start, draft_tokens, draft_probs, generators)
    device = target_probs.device
    num_req, vocab = len(draft_tokens), target_probs.shape[1]
    ks = [len(d) for d in draft_tokens]

    # --- acceptance of every draft position of every request at once ---
    rows = [row_start[i] + j for i in range(num_req) for j in range(ks[i])]
    accept_flat: list[bool] = []
    exact_flat: list[bool] = []
    if rows:
        row_t = torch.tensor(rows, dtype=torch.int64, device=device)
        tok_t = torch.tensor([t for d in draft_tokens for t in d], dtype=torch.int64, device=device)
        p_rows = target_probs[row_t].float()
        p_x = p_rows.gather(1, tok_t.unsqueeze(1)).squeeze(1)
        # One-hot q (None) means q(x) = 1; real q(x) gathered in one op.
        q_x = torch.ones_like(p_x)
        with_q = [i for i in range(num_req) if draft_probs[i] is not None and ks[i] > 0]
        if with_q:
            offsets = [0]
            for k in ks:
                offsets.append(offsets[-1] + k)
            flat_idx = torch.tensor(
                [offsets[i] + j for i in with_q for j in range(ks[i])], dtype=torch.int64, device=device
            )
            q_all = torch.cat([draft_probs[i].to(device).float() for i in with_q])
            q_x[flat_idx] = q_all.gather(1, tok_t[flat_idx].unsqueeze(1)).squeeze(1)
        # Uniforms come from each request's own (CPU) generator, so seeded
        # results do not depend on the device or on batch-mates; greedy
        # requests draw none.
        uniforms = [
            torch.rand(ks[i], generator=g) if g is not None else torch.zeros(ks[i])
            for i, g in enumerate(generators)
        ]
        u = torch.cat(uniforms).to(device)
        greedy = torch.tensor(
            [generators[i] is None for i in range(num_req) for _ in range(ks[i])], device=device
        )
        # u in [0, 1) so P(u < ratio) = min(1, ratio); greedy compares with the
        # target argmax (== "p(x) == 1" on one-hot p, robust to rounding).
        sampled_accept = u < p_x / q_x
        greedy_accept = tok_t == p_rows.argmax(dim=-1)
        accept = torch.where(greedy, greedy_accept, sampled_accept)
        exact_flat = accept.tolist()
        if relaxed is not None:
            accept = accept | relaxed.to(device)
        accept_flat = accept.tolist() if relaxed is not None else exact_flat

    # --- first rejection per request ---
    num_accepted: list[int] = []
    pos = 0
    for k in ks:
        n_acc = 0
        while n_acc < k and accept_flat[pos + n_acc]:
            n_acc += 1
        num_accepted.append(n_acc)
        pos += k

    # --- final token: residual at the rejected row, or p at the bonus row ---
    final_rows = torch.tensor(
        [row_start[i] + num_accepted[i] for i in range(num_req)], dtype=torch.int64, device=device
    )
    p_final = target_probs[final_rows].float()
    q_final = torch.zeros_like(p_final)  # bonus rows: residual of p against 0 is p
    dense = [i for i in range(num_req) if num_accepted[i] < ks[i] and draft_probs[i] is not None]
    if dense:
        q_final[dense] = torch.stack([draft_probs[i][num_accepted[i]].to(device).float() for i in dense])
    one_hot = [i for i in range(num_req) if num_accepted[i] < ks[i] and draft_probs[i] is None]
    if one_hot:
        q_final[one_hot, [draft_tokens[i][num_accepted[i]] for i in one_hot]] = 1.0
    final = p_final.argmax(dim=-1)  # greedy requests: the target's own token
    sampled = [i for i in range(num_req) if generators[i] is not None]
    if sampled:
        dist = _residual(p_final[sampled], q_final[sampled])
        # Same exponential race as sampler.sample: exact, and exact argmax on one-hot rows.
        noise = torch.stack([torch.empty(vocab).exponential_(generator=generators[i]) for i in sampled])
        noise = noise.to(device).clamp_(min=torch.finfo(noise.dtype).tiny)
        final[sampled] = (dist / noise).argmax(dim=-1)
    final_list = final.tolist()

    tokens = [list(draft_tokens[i][: num_accepted[i]]) + [final_list[i]] for i in range(num_req)]
    return VerifyOutput(tokens=tokens, num_accepted=num_accepted, exact_accepted=exact_flat)


def greedy_verify(target_argmax: list[list[int]], draft_tokens: list[list[int]]) -> VerifyOutput:
    """Greedy verification from the target's argmax tokens (``k_i + 1`` per request).

    Accept the longest prefix of drafts equal to the target's tokens, then emit
    the target's token at the first mismatch (or its bonus token).
    """
    if len(target_argmax) != len(draft_tokens):
        raise ValueError("need one target_argmax list per request")
    tokens: list[list[int]] = []
    num_accepted: list[int] = []
    exact: list[bool] = []
    for target, drafts in zip(target_argmax, draft_tokens):
        if len(target) != len(drafts) + 1:
            raise ValueError(f"need k + 1 = {len(drafts) + 1} target tokens, got {len(target)}")
        n = 0
        while n < len(drafts) and drafts[n] == target[n]:
            n += 1
        tokens.append(list(drafts[:n]) + [target[n]])
        num_accepted.append(n)
        exact += [d == t for d, t in zip(drafts, target)]
    return VerifyOutput(tokens=tokens, num_accepted=num_accepted, exact_accepted=exact)


def synthetic_verify(probs: torch.Tensor, row_start: list[int], draft_tokens: list[list[int]], rate: float,
                     rng: np.random.Generator) -> tuple[list[list[int]], list[int]]:
    """For studies (TurboSpec's microbenchmarks): accept each draft with probability `rate`, whatever it is.

    The first rejected position (or the bonus row) emits the target's argmax there. The KV of the accepted
    drafts was computed for exactly those tokens, so the cache stays consistent; only the text is not the
    model's.
    """
    accepted = []
    for drafts in draft_tokens:
        m = 0
        while m < len(drafts) and rng.random() < rate:
            m += 1
        accepted.append(m)
    rows = torch.tensor([row + m for row, m in zip(row_start, accepted)], device=probs.device)
    final = probs[rows].argmax(dim=-1).tolist()
    return [list(d[:m]) + [t] for d, m, t in zip(draft_tokens, accepted, final)], accepted
