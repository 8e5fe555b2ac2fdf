"""One simulated engine: each step it schedules a batch, chooses draft lengths (none, a fixed k, or the
goodput controller's choice with the engine's own ``GoodputController`` / ``choose_lengths``), predicts the
step's time from its ``StepFeatures`` and, when the step ends, applies the acceptance outcomes.

The step is split into ``start_step`` (decisions, from the state at its start) and ``finish_step`` (tokens
appear at its end), because requests that arrive in between only join the next step, as in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice

import numpy as np

from ..control.acceptance_estimators import DEFAULT_ESTIMATOR, make_estimator
from ..control.controller import Candidate, GoodputController, base_step, widen_lone_request
from ..control.step_time import StepFeatures
from .batching import BatchScheduler, LiveRequest, Scheduled
from .draft_outcomes import AcceptanceModel, Outcome
from .step_cost import StepCost
from .workload import SimRequest

SPEC_MODES = ("off", "fixed", "auto")


@dataclass(frozen=True)
class SpecPolicy:
    """mode "off": k = 0; "fixed": every decoding request verifies up to k drafts; "auto": the goodput
    controller picks 0..k per request each step. free_proposals: the proposer is a lookup (n-gram) whose
    drafts exist before the choice, so the controller chooses how many to verify and also learns whether the
    next lookup token would have matched (Speculation._observe_acceptance)."""

    mode: str = "off"
    k: int = 0
    free_proposals: bool = True
    estimator: str = DEFAULT_ESTIMATOR
    prior: float = 0.6
    # auto mode with a draft model: each draft ends where the draft turns unsure (the engine's draft_stop
    # "confidence"), read from the outcomes' recorded entropies
    confidence_stop: bool = False

    def __post_init__(self) -> None:
        if self.mode not in SPEC_MODES:
            raise ValueError(f"speculation mode must be one of {', '.join(SPEC_MODES)}, got {self.mode!r}")
        if self.confidence_stop and (self.mode != "auto" or self.free_proposals):
            raise ValueError("the confidence stop applies to a draft model (free_proposals=False) in auto mode")
        if self.mode != "off" and self.k < 1:
            what = "fixed" if self.mode == "fixed" else "most"
            raise ValueError(f"speculation {self.mode!r} needs k >= 1 (the {what} drafts per request and step), "
                             f"got {self.k}")


@dataclass
class StepRecord:
    """One simulated step, for reports and tests."""

    start_s: float
    seconds: float
    features: StepFeatures
    ks: list[int] = field(default_factory=list)  # draft lengths verified by the decoding requests


class Replica:
    def __init__(self, cost: StepCost, acceptance: AcceptanceModel | None, policy: SpecPolicy, max_num_seqs: int,
                 max_num_batched_tokens: int, seed: int = 0, record_steps: bool = False) -> None:
        if policy.mode != "off" and acceptance is None:
            raise ValueError("speculation needs an acceptance model (a trace or per-position rates)")
        self.cost = cost
        self.acceptance = acceptance
        self.policy = policy
        self.scheduler = BatchScheduler(max_num_seqs, max_num_batched_tokens)
        self.rng = np.random.default_rng(seed)
        self.controller = (GoodputController(cost.model, make_estimator(policy.estimator, policy.prior))
                           if policy.mode == "auto" else None)
        self.thresholds = None  # the confidence stop's acceptance-by-entropy table and cost ratio
        if policy.confidence_stop:
            from ..verification.lossy import AdaptiveThresholds  # (imports torch: only when used)

            self.thresholds = AdaptiveThresholds.fresh()
        self.busy_until: float | None = None  # end of the step in flight
        self.steps: list[StepRecord] | None = [] if record_steps else None
        self.num_steps = 0
        self.busy_s = 0.0
        self._batch: list[tuple[Scheduled, int]] = []  # the step in flight: (entry, drafts verified)
        self._outcomes: dict[str, Outcome] = {}  # drawn, not yet used (a request the budget left out keeps its own)
        self._outstanding = 0  # tokens left to compute over all its requests, kept up to date (routers read it)

    # --- requests ------------------------------------------------------------------------------------------

    def add(self, req: SimRequest) -> LiveRequest:
        live = LiveRequest(req)
        self.scheduler.waiting.append(live)
        self._outstanding += live.outstanding_tokens
        return live

    @property
    def outstanding_tokens(self) -> int:
        """Prompt tokens left to prefill plus output tokens left to generate, over its requests."""
        return self._outstanding

    @property
    def num_requests(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    # --- one step ------------------------------------------------------------------------------------------

    def start_step(self, now: float) -> float | None:
        """Plan the next step at `now`; returns its end time, or None when there is nothing to do."""
        if not self.scheduler.has_work():
            self.busy_until = None
            return None
        decoding = self.scheduler.decoding() if self.policy.mode != "off" else []
        spec = self._spec_budget(decoding) if decoding else {}
        batch = self.scheduler.schedule(spec)
        verified: list[tuple[Scheduled, int]] = []
        features = StepFeatures()
        ks = []
        for s in batch:
            k = 0
            outcome = self._outcomes.get(s.live.req.request_id)
            if s.samples and outcome is not None:
                k = self._stop(outcome, min(s.reserved, outcome.offered))
                ks.append(k)
            verified.append((s, k))
            features.add(s.start, s.num_new, k)
            if k and not self.policy.free_proposals:  # a draft model runs one token per draft (catch-up of 1)
                features.draft_tokens += k
        seconds = self.cost.seconds(features)
        if self.thresholds is not None and features.draft_steps:  # what the engine measures of each step
            draft_s = self.cost.model.predict_part("draft", features)
            self.thresholds.observe_costs(draft_step_s=draft_s / features.draft_steps, target_step_s=seconds - draft_s)
        self._batch = verified
        self.busy_until = now + seconds
        self.num_steps += 1
        self.busy_s += seconds
        if self.steps is not None:
            self.steps.append(StepRecord(now, seconds, features, ks))
        return self.busy_until

    def finish_step(self, now: float) -> list[LiveRequest]:
        """Apply the step in flight at its end time `now`; returns the requests it finished."""
        finished = []
        for s, k in self._batch:
            live = s.live
            live.steps += 1
            before = live.outstanding_tokens
            self._apply(s, k, now)
            self._outstanding += live.outstanding_tokens - before
            if live.remaining_output <= 0:
                live.finish_s = now
                self.scheduler.finish(live)
                rid = live.req.request_id
                if self.acceptance is not None:
                    self.acceptance.free(rid)
                if self.controller is not None:
                    self.controller.free(rid)
                finished.append(live)
        self._batch = []
        self.busy_until = None
        return finished

    def _apply(self, s: Scheduled, k: int, now: float) -> None:
        """One request's part of the step: its KV grows; if it sampled, it emits 1 + accepted tokens."""
        live = s.live
        if not s.samples:
            live.computed = s.start + s.num_new
            return
        rid = live.req.request_id
        outcome = self._outcomes.pop(rid, None)
        accepted = outcome.accepted(k) if outcome is not None else 0
        live.computed = s.start + s.num_new + accepted
        live.output += min(1 + accepted, live.remaining_output)
        if live.first_token_s is None:
            live.first_token_s = now
        if self.controller is not None and outcome is not None:
            self._observe(rid, k, accepted, outcome)
        if self.thresholds is not None and k and outcome is not None:
            reached = min(accepted + 1, k)
            self.thresholds.observe_generation(list(outcome.entropies[:reached]),
                                               [j < accepted for j in range(reached)])

    # --- speculation -------------------------------------------------------------------------------------

    def _spec_budget(self, decoding: list[LiveRequest]) -> dict[str, int]:
        """Draft slots per decoding request: the fixed k, or the controller's choice (Speculation.budget)."""
        assert self.acceptance is not None
        # never draft past the output length: the last token is always the verifier's own
        caps = [max(0, min(self.policy.k, r.remaining_output - 1)) for r in decoding]
        for r, cap in zip(decoding, caps):
            rid = r.req.request_id
            if rid not in self._outcomes:
                self._outcomes[rid] = self.acceptance.draw(rid, cap, self.rng, r.output)
        if self.controller is None:
            return {r.req.request_id: cap for r, cap in zip(decoding, caps)}
        k_max = [min(cap, self._outcomes[r.req.request_id].offered) if self.policy.free_proposals else cap
                 for r, cap in zip(decoding, caps)]
        base, spare = self._base_features(decoding)
        candidates = [Candidate(r.req.request_id, k, r.num_tokens, 0, r.remaining_output)
                      for r, k in zip(decoding, k_max)]
        ks = self.controller.choose(candidates, base, spare)
        if self.thresholds is not None:
            ks = widen_lone_request(ks, k_max, spare)
        return {r.req.request_id: k for r, k in zip(decoding, ks)}

    def _stop(self, outcome: Outcome, k: int) -> int:
        """The drafts kept of k offered: all of them, or up to where the confidence stop ends the draft."""
        if self.thresholds is None or not outcome.entropies:
            return k
        survival, expected = 1.0, 0.0
        for j, h in enumerate(outcome.entropies[:k]):
            survival, expected, more = self.thresholds.draft_more(h, j, survival, expected)
            if not more:
                return j + 1
        return k

    def _base_features(self, decoding: list[LiveRequest]) -> tuple[StepFeatures, int]:
        """The step without drafts (decodes plus the prefill it can fit) and the budget left for drafts."""
        s = self.scheduler
        seats = s.max_num_seqs - len(s.running)
        pending = [(r.computed, r.num_tokens) for r in s.running if r.is_prefilling]
        pending += [(r.computed, r.num_tokens) for r in islice(s.waiting, max(seats, 0))]
        return base_step([r.num_tokens for r in decoding], pending, s.max_num_batched_tokens)

    def _observe(self, rid: str, k: int, accepted: int, outcome: Outcome) -> None:
        """Feed the controller's estimator as the engine does: a free proposal longer than what was verified
        shows, when every verified draft was accepted, whether the next one would have been too."""
        assert self.controller is not None
        if self.policy.free_proposals and accepted == k and outcome.offered > k:
            k, accepted = k + 1, accepted + (outcome.run > k)
        if k:
            self.controller.observe(rid, k, accepted)
