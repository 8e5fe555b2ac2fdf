"""Online acceptance estimates: for each request and draft position, the chance that the draft token there is
accepted given that every earlier one was.

A verification of k drafts that accepted m is m accepted positions followed by one rejection (if m < k).
Every estimator here sees only that, step by step, and answers ``rates(request, k)``: the conditional
acceptance at positions 1..k. A new request starts from what the estimator knows globally. Old evidence
decays, so a shift (code -> chat) moves the estimates within about 1 / (1 - decay) verifications.

Several estimators are kept on purpose. ``benchmarks/acceptance_estimators.py`` replays verification traces
recorded from real runs through each and measures how well each predicts the accepted count. The default
(``DEFAULT_ESTIMATOR``) is the one with the lowest error there, not the one that looks best on paper.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

RATE_FLOOR, RATE_CEIL = 1e-3, 0.999  # keep (1 - a^(k+1)) / (1 - a) finite and never exactly certain


def _clamp(a: float) -> float:
    return min(max(a, RATE_FLOOR), RATE_CEIL)


@dataclass
class _Counts:
    success: float = 0.0
    failure: float = 0.0

    def add(self, success: float, failure: float, decay: float) -> None:
        self.success = decay * self.success + success
        self.failure = decay * self.failure + failure

    def rate(self, prior: float, strength: float) -> float:
        return (self.success + strength * prior) / (self.success + self.failure + strength)

    def age_towards(self, rate: float, strength: float, decay: float) -> None:
        """No new evidence: drift towards `strength` pseudo-observations at `rate`, at the pace evidence decays."""
        self.add((1 - decay) * strength * rate, (1 - decay) * strength * (1 - rate), decay)


@dataclass
class _RequestEvidence:
    """One live request's accepted (success) and rejected (failure) drafts: decayed, for its estimate, and in
    total, for how sure that estimate is (RequestBeta.hopeful_level)."""

    recent: _Counts = field(default_factory=_Counts)
    total: _Counts = field(default_factory=_Counts)


class LevelSpread:
    """The mean squared deviation of finished requests' acceptance levels from the global rate when each finished
    (its own drafts included), decayed per request (recent traffic counts most), starting from `prior_weight`
    pseudo-requests at `prior_variance`: the spread a Beta prior of the estimator's strength implies. Raw levels of
    requests verified only once or twice carry sampling noise, which overstates the spread: more optimism."""

    def __init__(self, prior_variance: float, prior_weight: float = 2.0, decay: float = 0.9) -> None:
        self.decay = decay
        self._sum = prior_weight * prior_variance
        self._weight = prior_weight

    def add(self, deviation: float) -> None:
        self._sum = self.decay * self._sum + deviation * deviation
        self._weight = self.decay * self._weight + 1.0

    @property
    def variance(self) -> float:
        return self._sum / self._weight


class AcceptanceEstimator(ABC):
    name = "base"

    @abstractmethod
    def rates(self, request_id: str, k: int) -> list[float]:
        """Conditional acceptance at draft positions 1..k for this request."""

    @abstractmethod
    def observe(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        """One verification: num_draft tokens proposed, the first num_accepted of them accepted."""

    def rate(self, request_id: str) -> float:
        """A one-number summary (position 1), for statistics."""
        return self.rates(request_id, 1)[0]

    def free(self, request_id: str) -> None:
        """The request is gone: drop its state."""

    def observe_nodes(self, request_id: str, num_nodes: int, accepted_ranks: list[int]) -> None:
        """One verified tree: num_nodes candidates, of which the nodes of these ranks (the proposer's confidence
        order, TokenTree.ranks) formed the accepted path. A chain estimator sees its accepted depth."""
        self.observe(request_id, num_nodes, len(accepted_ranks))

    def end_step(self) -> None:
        """Every observation of one engine step has been made."""

    def hopeful_rates(self, request_id: str, k: int) -> list[float]:
        """The rates at one standard deviation above what the request's acceptance may plausibly be: what the
        controller tries drafting at when the estimate alone does not pay (the estimate itself where the
        estimator keeps no spread)."""
        return self.rates(request_id, k)


class GlobalEMA(AcceptanceEstimator):
    """The TurboSpec authors' fork: one number for every request and position, a <- 0.85 a + 0.15 m / k."""

    name = "global-ema"

    def __init__(self, prior: float = 0.6, alpha: float = 0.15) -> None:
        self.a = prior
        self.alpha = alpha

    def rates(self, request_id: str, k: int) -> list[float]:
        return [_clamp(self.a)] * k

    def observe(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        if num_draft > 0:
            self.a = (1 - self.alpha) * self.a + self.alpha * num_accepted / num_draft


class RequestBeta(AcceptanceEstimator):
    """One decayed Beta posterior per request on top of a slowly decayed global prior; flat over positions."""

    name = "request-beta"

    def __init__(self, prior: float = 0.6, prior_strength: float = 4.0, request_decay: float = 0.8,
                 global_decay: float = 0.98, stale_after: int = 10) -> None:
        if not 0.0 < prior < 1.0:
            raise ValueError(f"acceptance prior must be in (0, 1), got {prior}")
        self.prior = prior
        self.prior_strength = prior_strength
        self.request_decay = request_decay
        self.global_decay = global_decay
        self._global = _Counts(prior * prior_strength, (1 - prior) * prior_strength)
        self._requests: dict[str, _RequestEvidence] = {}
        # the spread of requests' levels around the global rate, from the requests that finished (hopeful_level)
        self._spread = LevelSpread(prior * (1 - prior) / (prior_strength + 1))
        # engine steps in a row without a verification: past `stale_after`, the global evidence ages (end_step)
        self.stale_after = stale_after
        self._idle_steps = 0
        self._observed = False

    @property
    def global_rate(self) -> float:
        g = self._global
        return g.success / (g.success + g.failure)

    def request_rate(self, request_id: str) -> float:
        own = self._requests.get(request_id)
        return (own.recent if own else _Counts()).rate(self.global_rate, self.prior_strength)

    def rates(self, request_id: str, k: int) -> list[float]:
        return self._rates_at(self.request_rate(request_id), k)

    def _rates_at(self, level: float, k: int) -> list[float]:
        """The rates at positions 1..k of a request at this level."""
        return [_clamp(level)] * k

    def hopeful_rates(self, request_id: str, k: int) -> list[float]:
        return self._rates_at(max(self.request_rate(request_id), self.hopeful_level(request_id)), k)

    def observe(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        if num_draft <= 0:
            return
        self._observed = True
        rejected = float(num_accepted < num_draft)
        own = self._requests.setdefault(request_id, _RequestEvidence())
        own.recent.add(num_accepted, rejected, self.request_decay)
        own.total.add(num_accepted, rejected, 1.0)
        self._global.add(num_accepted, rejected, self.global_decay)

    def end_step(self) -> None:
        """A controller that chose k = 0 for every request sees no verification, so the rate that made it stop
        would hold for good: traffic that shifts to text the draft predicts well (chat -> code) would never be
        drafted for. After `stale_after` steps without one, the global evidence ages towards the prior at the
        pace evidence decays, until the expected gain switches speculation back on and fresh verifications
        decide (a probe every hundred-odd steps where drafting does not pay; tests/control/test_goodput.py)."""
        self._idle_steps = 0 if self._observed else self._idle_steps + 1
        self._observed = False
        if self._idle_steps > self.stale_after:
            self._global.age_towards(self.prior, self.prior_strength, self.global_decay)
            self._age_unobserved()

    def _age_unobserved(self) -> None:
        """What else the estimator learnt globally ages with the global rate (PositionBeta: its positions)."""

    def hopeful_level(self, request_id: str) -> float:
        """The request's level one standard deviation above its posterior mean, in a normal model where levels
        spread around the global rate as finished requests' did (LevelSpread) and each accepted or rejected draft
        of the request (undecayed) is one observation of it; the global rate's own uncertainty (its Beta
        posterior) is added.

        A stream mixing code (the 0.5B draft accepts 0.99 for the 1.5B) and chat (~0.5) holds the global rate
        near 0.6, where one sd of the global posterior alone never lifted a new code request to the break-even:
        each new request must be tried to be known. The spread says how far a new one may stray, and a few of its
        own verifications settle it (a chat request's bound falls below its decayed estimate after about three
        rejected drafts; the controller takes the higher of the two). Each accepted draft token counts as one
        observation although acceptance runs in stretches, and the counts do not decay: a request settled below
        the break-even is not tried again while it lives, even if it starts to copy."""
        g = self._global
        n = g.success + g.failure
        m = g.success / n
        own = self._requests.get(request_id)
        accepted, seen = (own.total.success, own.total.success + own.total.failure) if own else (0.0, 0.0)
        spread = max(self._spread.variance, 1e-6)  # the prior's variance
        noise = max(m * (1.0 - m), 0.01)  # one observation's variance
        precision = 1.0 / spread + seen / noise
        mean = (m / spread + accepted / noise) / precision
        return mean + math.sqrt(1.0 / precision + m * (1.0 - m) / (n + 1.0))

    def free(self, request_id: str) -> None:
        own = self._requests.pop(request_id, None)
        if own is not None and own.total.success + own.total.failure > 0:
            self._spread.add(own.total.success / (own.total.success + own.total.failure) - self.global_rate)


class PositionBeta(RequestBeta):
    """RequestBeta's per-request level, shaped by a global per-position profile.

    Acceptance usually falls with position (REFERENCE.md section 2): a_ij = L_i x g_j / g, where g_j is the
    global conditional acceptance at position j, g the global rate and L_i the request's level. The per-position
    shape is learned from every request, the level per request, so neither needs much data.

    A position is only seen when the controller drafts that far, so evidence about the positions it stopped
    drafting ages with every verification too (decayed towards the global rate): otherwise a shift (chat ->
    code) never reaches them, and a short k chosen on chat's figures stays chosen on code (a censoring trap,
    tests/control/test_goodput.py). Valuing the level's uncertainty (E[L^j] for the j-th position rather than E[L]^j) was
    tried: in an ad hoc replay of the recorded traces (acceptance_estimators.py --replay, not committed) it
    raised this estimator's mean MAE from 2.10 to 2.19, so it is not used.
    """

    name = "position-beta"

    def __init__(self, prior: float = 0.6, prior_strength: float = 4.0, request_decay: float = 0.4,
                 global_decay: float = 0.98, max_positions: int = 16) -> None:
        # request_decay 0.4: acceptance is strongly autocorrelated (a copying stretch, then none), so the
        # recent outcome predicts best; benchmarks/results/acceptance_estimators/acceptance_estimators.md scores 0.2 .. 0.95
        super().__init__(prior, prior_strength, request_decay, global_decay)
        self._positions = [_Counts() for _ in range(max_positions)]

    def _rates_at(self, level: float, k: int) -> list[float]:
        g = self.global_rate
        out = []
        for j in range(k):
            counts = self._positions[min(j, len(self._positions) - 1)]
            out.append(_clamp(level * counts.rate(g, self.prior_strength) / g))
        return out

    def observe(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        super().observe(request_id, num_draft, num_accepted)
        if num_draft <= 0:
            return
        # position j (0-based) was reached iff the first j drafts were accepted
        for j in range(min(num_draft, num_accepted + 1, len(self._positions))):
            accepted = j < num_accepted
            self._positions[j].add(float(accepted), float(not accepted), self.global_decay)
        # positions past the draft were not tried at all (the controller's choice, not the draft's failure): their
        # evidence ages. Positions drafted but cut off by an earlier rejection keep theirs: deep positions are
        # rarely reached by nature, and aging them would wash their (low) rates out.
        for counts in self._positions[num_draft:]:
            counts.add(0.0, 0.0, self.global_decay)

    def _age_unobserved(self) -> None:
        for counts in self._positions:  # towards the global rate, as positions past the draft do
            counts.add(0.0, 0.0, self.global_decay)


class FirstPositionBeta(PositionBeta):
    """The request's own level decides only the first draft position; deeper positions take the global
    conditional rate there. Reaching position j means the first j - 1 drafts were right, which says more
    about position j (a copy stretch, an easy span) than the request's history does."""

    name = "first-position-beta"

    def _rates_at(self, level: float, k: int) -> list[float]:
        if k <= 0:
            return []
        g = self.global_rate
        first = self._positions[0].rate(g, self.prior_strength) / g
        out = [_clamp(level * first)]
        for j in range(1, k):
            out.append(_clamp(self._positions[min(j, len(self._positions) - 1)].rate(g, self.prior_strength)))
        return out


class NodeRank(AcceptanceEstimator):
    """Acceptance of a draft head's candidate tree, by node rank.

    A tree drafter's k drafts are the k most confident nodes of one candidate tree, so the tree of k + 1 nodes is
    the tree of k plus the node of rank k. The accepted path holds each node with some chance p_j, and the
    tokens a tree of k nodes emits are 1 + p_0 + ... + p_(k-1): the expected accepted depth, node by node. That
    is the gain the goodput controller weighs against k verified nodes (the issue's "number of tree nodes as
    the cost, expected accepted depth as the gain"). A chain estimator would read "8 nodes, depth 1" as one
    acceptance then a rejection, and value a 2-node tree as if it were the 8-node tree's first two levels.

    p_j is learned globally (decayed counts per rank); each request scales it by how its accepted depth
    compares with what the global profile predicted for its trees (code copies well, chat less). The answer
    is in the chain form the controller takes: rates r_j = p_j / p_(j-1), whose running products are p_j.
    Requests held to chains (deterministic modes, lossy acceptance) draft the single most probable path, whose
    positions are no ranks of a tree: they report through ``observe`` and are a PositionBeta's.

    Censoring: rank j is only seen in trees of more than j nodes. A rank no tree has held for `stale_after`
    engine steps (the controller's choice, not the draft's failure) drifts with every further step towards its
    prior scaled by the global level: accepted nodes over what the priors predict for the counts held.
    Otherwise a controller that chose small trees on chat's figures would never see that code accepts its
    deeper nodes (PositionBeta ages positions past the draft for the same trap; tests/control/test_goodput.py). Ranks
    held now and then keep their evidence as it is: aging them too biased a mix of 2-, 4- and 8-node trees.
    """

    name = "node-rank"

    def __init__(self, prior: float = 0.6, prior_strength: float = 4.0, request_decay: float = 0.8,
                 global_decay: float = 0.98, max_nodes: int = 64, stale_after: int = 10) -> None:
        if not 0.0 < prior < 1.0:
            raise ValueError(f"acceptance prior must be in (0, 1), got {prior}")
        self.prior = prior
        self._ranks = [_Counts(self._prior_rate(j) * prior_strength, (1 - self._prior_rate(j)) * prior_strength)
                       for j in range(max_nodes)]
        self.prior_strength = prior_strength
        self.request_decay = request_decay
        self.global_decay = global_decay
        # a rank no tree held for this many engine steps in a row is stale: the controller has stopped verifying
        # it (a rank held now and then, among tree sizes the controller mixes, keeps its evidence unbiased)
        self.stale_after = stale_after
        self._unverified = [0] * max_nodes  # engine steps since a tree last held the rank
        self._span = 0  # ranks any tree has held: only they have evidence that can go stale
        self._step_nodes = -1  # the largest tree of the current step (-1: no tree request yet)
        self._requests: dict[str, _Counts] = {}  # success: accepted depth, failure: depth the profile predicted
        self._chain = PositionBeta(prior=prior)
        self._chain_requests: set[str] = set()

    def profile(self, k: int) -> list[float]:
        """Global p_j for ranks 0..k-1, made non-increasing by pooling adjacent violators. A child can be
        accepted more often than a less confident sibling ranked before it. Pooling keeps their sum (what a tree
        holding both is worth, which clipping would undervalue); within a pooled block the value is spread
        evenly, i.e. the tree-value curve's concave hull, the shape the controller's greedy choice needs to
        be exact."""
        blocks: list[list[float]] = []  # [sum, count] of pooled ranks
        for j in range(k):
            c = self._ranks[min(j, len(self._ranks) - 1)]
            blocks.append([c.success / (c.success + c.failure), 1.0])
            while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] < blocks[-1][0] / blocks[-1][1]:
                total, count = blocks.pop()
                blocks[-1][0] += total
                blocks[-1][1] += count
        return [total / count for total, count in blocks for _ in range(int(count))]

    def _prior_rate(self, j: int) -> float:
        """The best node is accepted often, later ones (siblings, deep nodes) rarely."""
        return self.prior / (j + 1)

    def global_level(self) -> float:
        """Accepted nodes over what the priors predict for the counts of the ranks trees have held (1 before
        any evidence)."""
        held = self._ranks[:self._span]
        seen = sum(c.success for c in held)
        expected = sum(self._prior_rate(j) * (c.success + c.failure) for j, c in enumerate(held))
        return seen / expected if expected > 0 else 1.0

    def level(self, request_id: str) -> float:
        """The request's accepted depth over the profile's prediction for its trees (1 before any evidence)."""
        own = self._requests.get(request_id) or _Counts()
        return (own.success + self.prior_strength) / (own.failure + self.prior_strength)

    def rates(self, request_id: str, k: int) -> list[float]:
        if request_id in self._chain_requests:
            return self._chain.rates(request_id, k)
        level = self.level(request_id)
        out, previous = [], 1.0
        for p in self.profile(k):
            p = min(_clamp(level * p), previous)
            out.append(_clamp(p / previous))
            previous = p
        return out

    def observe(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        """A request held to chains (its drafts are a path, not the most confident nodes)."""
        self._chain_requests.add(request_id)
        self._chain.observe(request_id, num_draft, num_accepted)

    def observe_nodes(self, request_id: str, num_nodes: int, accepted_ranks: list[int]) -> None:
        self._step_nodes = max(self._step_nodes, num_nodes)  # a tree request's step, even one given no nodes
        if num_nodes <= 0:
            return
        predicted = sum(self.profile(num_nodes))
        self._requests.setdefault(request_id, _Counts()).add(len(accepted_ranks), predicted, self.request_decay)
        accepted = set(accepted_ranks)
        self._span = max(self._span, min(num_nodes, len(self._ranks)))
        for j in range(min(num_nodes, len(self._ranks))):
            hit = float(j in accepted)
            self._ranks[j].add(hit, 1.0 - hit, self.global_decay)

    def end_step(self) -> None:
        """Staleness counts engine steps: in a batch, one request's small tree says nothing about the ranks
        another request's larger tree held in the same step. A rank past every tree of `stale_after` steps in a
        row drifts towards its prior at the global level (ranks never verified keep their prior as it is)."""
        self._chain.end_step()
        if self._step_nodes < 0:  # no tree request this step
            return
        level = None
        for j in range(self._span):
            self._unverified[j] = 0 if j < self._step_nodes else self._unverified[j] + 1
            if self._unverified[j] > self.stale_after:
                if level is None:
                    # with rank 0 stale no tree has held a node for that long: the global level is as stale as
                    # the ranks, and aging towards the level it measured would keep them there for good (a
                    # controller that stopped drafting on chat never drafted again on code: RequestBeta.end_step)
                    level = 1.0 if self._unverified[0] > self.stale_after else self.global_level()
                self._ranks[j].age_towards(_clamp(level * self._prior_rate(j)), self.prior_strength,
                                           self.global_decay)
        self._step_nodes = -1

    def free(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._chain_requests.discard(request_id)
        self._chain.free(request_id)


# chain estimators: the config's acceptance_estimator (tree drafters always use NodeRank, see make_estimator)
ESTIMATORS: dict[str, type[AcceptanceEstimator]] = {
    e.name: e for e in (GlobalEMA, RequestBeta, PositionBeta, FirstPositionBeta)
}
DEFAULT_ESTIMATOR = "position-beta"


def make_estimator(name: str = DEFAULT_ESTIMATOR, prior: float = 0.6, ranks_nodes: bool = False
                   ) -> AcceptanceEstimator:
    """The configured chain estimator, or NodeRank when the proposer's drafts are its most confident tree
    nodes (Proposer.ranks_nodes): what a chain estimator learns does not describe a tree's gain."""
    if name not in ESTIMATORS:
        raise ValueError(f"unknown acceptance estimator {name!r}: expected one of {', '.join(ESTIMATORS)}")
    return NodeRank(prior=prior) if ranks_nodes else ESTIMATORS[name](prior=prior)


def expected_tokens(a: float | list[float], k: int) -> float:
    """Tokens emitted by verifying k drafts, the bonus token included.

    With one rate a for every position this is (1 - a^(k+1)) / (1 - a); with conditional rates per position
    it is 1 + a1 + a1 a2 + ... + a1 ... ak."""
    if isinstance(a, (int, float)):
        if a >= 1.0:
            return float(k + 1)
        return (1.0 - a ** (k + 1)) / (1.0 - a)
    total, reach = 1.0, 1.0
    for j in range(k):
        reach *= a[j]
        total += reach
    return total


def outcome_probability(rates: list[float], num_draft: int, num_accepted: int) -> float:
    """P(exactly num_accepted of num_draft drafts accepted) under conditional per-position rates."""
    p = 1.0
    for j in range(num_accepted):
        p *= rates[j]
    if num_accepted < num_draft:
        p *= 1.0 - rates[num_accepted]
    return p
