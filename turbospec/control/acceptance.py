"""Online acceptance estimates: per request, starting from a global prior, following change within tens of
steps.

A verification of k drafts that accepted m is m Bernoulli successes followed by one failure (if m < k).
So per-token acceptance has a Beta posterior. We keep exponentially decayed success and failure counts per
request. A global pair of counts, decayed more slowly, serves as the prior a new request starts from.
The decay forgets old evidence, so a shift (code -> chat) moves the estimate within about 1 / (1 - decay)
verifications.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Counts:
    success: float = 0.0
    failure: float = 0.0

    def add(self, accepted: int, rejected: bool, decay: float) -> None:
        self.success = decay * self.success + accepted
        self.failure = decay * self.failure + rejected


class AcceptanceEstimator:
    def __init__(self, prior: float = 0.6, prior_strength: float = 4.0, request_decay: float = 0.8,
                 global_decay: float = 0.98) -> None:
        if not 0.0 < prior < 1.0:
            raise ValueError(f"acceptance prior must be in (0, 1), got {prior}")
        self.prior_strength = prior_strength
        self.request_decay = request_decay
        self.global_decay = global_decay
        self._global = _Counts(prior * prior_strength, (1 - prior) * prior_strength)
        self._requests: dict[str, _Counts] = {}

    @property
    def global_rate(self) -> float:
        g = self._global
        return g.success / (g.success + g.failure)

    def rate(self, request_id: str) -> float:
        """Per-token acceptance estimate for a request: its own evidence on top of the global prior."""
        prior = self.global_rate
        own = self._requests.get(request_id)
        s = self.prior_strength * prior + (own.success if own else 0.0)
        f = self.prior_strength * (1 - prior) + (own.failure if own else 0.0)
        return min(max(s / (s + f), 1e-3), 0.999)  # keep (1 - a^(k+1)) / (1 - a) finite

    def observe(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        if num_draft <= 0:
            return
        rejected = num_accepted < num_draft
        self._requests.setdefault(request_id, _Counts()).add(num_accepted, rejected, self.request_decay)
        self._global.add(num_accepted, rejected, self.global_decay)

    def free(self, request_id: str) -> None:
        self._requests.pop(request_id, None)


def expected_tokens(a: float, k: int) -> float:
    """Tokens emitted by verifying k drafts with per-token acceptance a, the bonus token included."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)
