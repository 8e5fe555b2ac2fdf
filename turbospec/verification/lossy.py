"""Acceptance policies: which draft tokens the verifier keeps (``speculative_config={"acceptance": ...}``).

- ``exact`` (default): rejection sampling (chain.py). Lossless: output is distributed exactly as the target's.
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
- entropy threshold: the verifier's outcomes give an acceptance estimate per draft-entropy bin, and the engine
  measures a draft step's and a target step's time. A draft token is kept only while its expected accepted
  tokens per unit of time (survival so far x acceptance at its entropy, over one draft step) beat those of the
  draft so far, so the cut-off entropy falls where drafting stops paying on this hardware. (A cut midway between the
  mean entropies of accepted and rejected tokens would ignore cost, which matters on a CPU where a verified token
  is nearly free.) The first draft token is always kept: whether to draft at all is the goodput
  controller's choice.
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


# Resolution of the acceptance-by-entropy table (a resolution, not a cut-off). A cut draft vocabulary makes the
# draft confident: most of its tokens sit below 1 nat, where acceptance falls from 0.99 to 0.8 (HumanEval,
# qwen2.5-coder-0.5b drafting for the 1.5b). With 0.1-nat bins the confidence stop replays at 1.042x of the best
# fixed k on HumanEval (benchmarks/results/adaptive_replay/adaptive_replay.md); an ad hoc replay of the same runs with 0.5-nat bins
# (not committed) read 1.018x, MT-Bench 1.060x either way. AdaSD's numbers in
# benchmarks/results/adaptive_acceptance/adaptive_acceptance.md were measured with 0.5.
ENTROPY_BIN_NATS = 0.1


@dataclass
class AdaptiveThresholds:
    """AdaSD's two run-time thresholds (see the module docstring for the rules)."""

    js_agree: _RunningMean
    accepted_by_entropy: list[int]  # per entropy bin: reached draft tokens that were accepted
    seen_by_entropy: list[int]  # per entropy bin: reached draft tokens
    draft_step_s: _RunningMean  # one draft-model forward
    target_step_s: _RunningMean  # one target forward that verified drafts

    @classmethod
    def fresh(cls) -> AdaptiveThresholds:
        return cls(_RunningMean(), [], [], _RunningMean(), _RunningMean())

    @property
    def js_threshold(self) -> float:
        return self.js_agree.mean or 0.0

    @property
    def cost_ratio(self) -> float | None:
        """A draft step's time over a target step's, both measured; None until both were seen."""
        d, t = self.draft_step_s.mean, self.target_step_s.mean
        return d / t if d is not None and t else None

    def acceptance_at(self, entropy_nats: float) -> float:
        """Estimated probability that a draft token whose draft entropy is this is accepted (Beta(1, 1) prior
        per bin, so an unseen bin says 0.5)."""
        b = min(int(entropy_nats / ENTROPY_BIN_NATS), len(self.seen_by_entropy) - 1) if self.seen_by_entropy else -1
        if b < 0:
            return 0.5
        return (self.accepted_by_entropy[b] + 1) / (self.seen_by_entropy[b] + 2)

    def keep_drafting(self, entropy_nats: float, drafted: int, survival: float, expected: float) -> float | None:
        """AdaSD's generation rule, made aware of cost: draft another token only if its expected accepted tokens
        per unit of time beat the draft so far. ``survival`` is the estimated chance that the ``drafted``
        tokens before it are all accepted, ``expected`` their expected accepted count. Returns the new survival,
        or None to stop. The first draft token is always kept (k = 0 is the goodput controller's choice), so
        the estimates keep being fed."""
        p = survival * self.acceptance_at(entropy_nats)
        r = self.cost_ratio
        if drafted == 0 or r is None or r <= 0:  # (r = 0: a draft step too quick to measure costs nothing)
            return p
        # tokens per target-step time: the draft so far gives (1 + expected) / (1 + drafted * r); one more
        # draft token adds p tokens for r more time
        return p if p / r >= (1.0 + expected) / (1.0 + drafted * r) else None

    def draft_more(self, entropy_nats: float, drafted: int, survival: float, expected: float
                   ) -> tuple[float, float, bool]:
        """The confidence stop (lossless; a draft model in auto mode, DraftModelProposer.confidence_stop).

        Unlike AdaSD's rule above it never drops the token just drafted (the ``drafted``-th, 0-based): that
        forward is paid, and verifying one more row costs the target about 1% of a step on a CPU (the step-time
        profiles' per-token slope), so an unsure token is still worth its verification. It decides whether the
        *next* draft forward pays: its expected gain (the chance every draft so far survives, times an
        acceptance for the next token taken to be this one's, since the draft's confidence runs in stretches)
        per draft step must beat the tokens per unit of time of the draft so far. Returns the survival and the
        expected accepted count with this token, and whether to draft another.

        With the 0.5B draft for qwen2.5-coder-1.5b, auto mode with this stop replays at 1.060x / 1.042x of the best
        fixed k on MT-Bench / HumanEval (benchmarks/results/adaptive_replay/adaptive_replay.md, batch 1) and ran at 1.12x / 1.08x
        of fixed k = 4 live (benchmarks/results/adaptive_estimators/adaptive_confidence_stop.md). AdaSD's rule, which drops the token,
        lost 1-6% to the best fixed k on the same runs in an ad hoc replay (not committed)."""
        a = self.acceptance_at(entropy_nats)
        survival *= a
        expected += survival
        r = self.cost_ratio
        if r is None or r <= 0:  # nothing measured yet, or a draft step too quick to measure: draft to the cap
            return survival, expected, True
        return survival, expected, survival * a / r >= (1.0 + expected) / (1.0 + (drafted + 1) * r)

    @property
    def entropy_threshold(self) -> float:
        """For reports: the lowest entropy at which a second draft token would be cut after a sure first one."""
        r = self.cost_ratio
        if r is None:
            return math.inf
        for b in range(len(self.seen_by_entropy)):
            h = (b + 0.5) * ENTROPY_BIN_NATS
            if self.keep_drafting(h, 1, 1.0, 1.0) is None:
                return b * ENTROPY_BIN_NATS
        return math.inf

    def observe_verification(self, distances: list[float], exact_accepted: list[bool]) -> None:
        self.js_agree.add([d for d, ok in zip(distances, exact_accepted) if ok])

    def observe_generation(self, entropies: list[float], accepted: list[bool]) -> None:
        for h, ok in zip(entropies, accepted):
            b = int(h / ENTROPY_BIN_NATS)
            if b >= len(self.seen_by_entropy):
                grow = b + 1 - len(self.seen_by_entropy)
                self.seen_by_entropy += [0] * grow
                self.accepted_by_entropy += [0] * grow
            self.seen_by_entropy[b] += 1
            self.accepted_by_entropy[b] += ok

    def observe_costs(self, draft_step_s: float | None = None, target_step_s: float | None = None) -> None:
        if draft_step_s is not None:
            self.draft_step_s.add([draft_step_s])
        if target_step_s is not None:
            self.target_step_s.add([target_step_s])

    def as_dict(self) -> dict[str, float | int | None]:
        cut = self.entropy_threshold
        return {"js_threshold": self.js_threshold, "entropy_threshold": cut if math.isfinite(cut) else None,
                "cost_ratio": self.cost_ratio, "js_observations": self.js_agree.count,
                "entropy_observations": sum(self.seen_by_entropy)}


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
