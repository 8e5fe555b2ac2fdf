"""Acceptance policies: which draft tokens the verifier keeps (``speculative_config={"acceptance": ...}``).

- ``exact`` (default): rejection sampling (verifier.py). Lossless: output is distributed exactly as the target's.
- ``typical`` (Medusa, lossy): also accept a draft token x when the target gives it
  ``p(x) > min(eps, delta * exp(-H(p)))``.
- ``adasd-verification`` (lossy): also accept x when the Jensen-Shannon distance between the target's and the
  draft's distributions at that position is below an adaptive threshold.
- ``adasd-generation`` (lossless): exact acceptance, but the draft model stops drafting as soon as the entropy of
  its own distribution exceeds an adaptive threshold (short drafts where it is unsure).
- ``adasd`` (lossy): both halves (AdaSD, arXiv 2512.11280).

Relaxed acceptance only *adds* accepted positions: a token the exact rule accepts is always accepted, and at the
first position neither rule accepts, the exact rule's correction token is emitted (the target's argmax for greedy
requests, the residual sample otherwise). For greedy requests the criteria use the untempered softmax of the
target's (and draft's) logits: the one-hot distribution a greedy request samples from has no entropy to use.

The adaptive thresholds (our reading of AdaSD, whose text gives no formula we could use; nothing is set by hand):
- JS threshold = the running mean of the JS distance at positions where the draft token was accepted by the
  exact rule. A disagreement whose distributions are as close as a typical agreement's is taken to be a near-tie
  the target does not care about. Starts at 0 (nothing relaxed) until agreements have been seen.
- entropy threshold = midway between the running mean draft entropy of accepted and of rejected draft tokens,
  once both have been seen and rejected tokens are the less certain ones; until then drafting never stops early.
Both are kept per engine (they describe the draft/target pair, not a request) and only ever read positions the
verifier actually reached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .policies import RELAXES_JS, TYPICAL_DELTA, TYPICAL_EPSILON


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats of each row of ``probs`` ``[N, V]``."""
    p = probs.float()
    return -(p * p.clamp_min(1e-30).log()).sum(dim=-1)


def js_distance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon distance (square root of the divergence in bits, so in [0, 1]) between rows of p and q."""
    p, q = p.float(), q.float()
    m = 0.5 * (p + q)
    log_m = m.clamp_min(1e-30).log()

    def kl_to_m(x: torch.Tensor) -> torch.Tensor:
        return (x * (x.clamp_min(1e-30).log() - log_m)).sum(dim=-1)

    divergence = 0.5 * (kl_to_m(p) + kl_to_m(q)) / math.log(2.0)
    return divergence.clamp(0.0, 1.0).sqrt()


def typical_accepts(p: torch.Tensor, tokens: torch.Tensor, eps: float = TYPICAL_EPSILON,
                    delta: float = TYPICAL_DELTA) -> torch.Tensor:
    """Medusa's typical acceptance: ``p(x) > min(eps, delta * exp(-H(p)))`` per row."""
    p_x = p.float().gather(1, tokens.unsqueeze(1)).squeeze(1)
    threshold = torch.clamp(delta * torch.exp(-entropy(p)), max=eps)
    return p_x > threshold


@dataclass
class _RunningMean:
    total: float = 0.0
    count: int = 0

    def add(self, values: list[float]) -> None:
        self.total += sum(values)
        self.count += len(values)

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


@dataclass
class AdaptiveThresholds:
    """AdaSD's two run-time thresholds (see the module docstring for the rules)."""

    js_agree: _RunningMean
    entropy_accepted: _RunningMean
    entropy_rejected: _RunningMean

    @classmethod
    def fresh(cls) -> AdaptiveThresholds:
        return cls(_RunningMean(), _RunningMean(), _RunningMean())

    @property
    def js_threshold(self) -> float:
        return self.js_agree.mean or 0.0

    @property
    def entropy_threshold(self) -> float:
        acc, rej = self.entropy_accepted.mean, self.entropy_rejected.mean
        if acc is None or rej is None or rej <= acc:
            return math.inf
        return 0.5 * (acc + rej)

    def observe_verification(self, distances: list[float], exact_accepted: list[bool]) -> None:
        self.js_agree.add([d for d, ok in zip(distances, exact_accepted) if ok])

    def observe_generation(self, entropies: list[float], accepted: list[bool]) -> None:
        self.entropy_accepted.add([h for h, ok in zip(entropies, accepted) if ok])
        self.entropy_rejected.add([h for h, ok in zip(entropies, accepted) if not ok])

    def as_dict(self) -> dict[str, float | int]:
        return {"js_threshold": self.js_threshold, "entropy_threshold": self.entropy_threshold,
                "js_observations": self.js_agree.count,
                "entropy_observations": self.entropy_accepted.count + self.entropy_rejected.count}


def relax_drafts(policies: list[str], row_start: list[int], drafts: list[list[int]], criterion_probs: torch.Tensor,
                 draft_soft: list[torch.Tensor | None], thresholds: AdaptiveThresholds,
                 eps: float = TYPICAL_EPSILON, delta: float = TYPICAL_DELTA) -> tuple[torch.Tensor, list[float]]:
    """Which draft positions a lossy policy accepts on its own, flat over requests (the order verify() uses),
    and the JS distance at each position (nan where the policy does not read it).

    ``criterion_probs`` holds the target distribution the criteria read at every row (the untempered softmax
    for greedy requests); request i owns rows ``row_start[i] ..``. ``draft_soft[i]`` is the draft model's
    distribution per draft position (for the AdaSD policies)."""
    device = criterion_probs.device
    relaxed: list[torch.Tensor] = []
    distances: list[float] = []
    for policy, start, toks, soft in zip(policies, row_start, drafts, draft_soft):
        k = len(toks)
        if k == 0:
            continue
        p = criterion_probs[start: start + k]
        tok_t = torch.tensor(toks, dtype=torch.int64, device=device)
        flags = torch.zeros(k, dtype=torch.bool, device=device)
        dist = [math.nan] * k
        if policy == "typical":
            flags = typical_accepts(p, tok_t, eps, delta)
        elif policy in RELAXES_JS and soft is not None:
            d = js_distance(p, soft[:k].to(device))
            flags = d < thresholds.js_threshold
            dist = d.tolist()
        relaxed.append(flags)
        distances += dist
    flat = torch.cat(relaxed) if relaxed else torch.zeros(0, dtype=torch.bool, device=device)
    return flat, distances
