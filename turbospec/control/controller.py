"""The goodput controller, between the scheduler and the proposer: each step it turns the step-time model and
the acceptance estimates into a draft length per decoding request.

It is asked before the scheduler hands out tokens (``choose``), learns from every verification (``observe``)
and from every measured step (``record_step``; the step-time model rescales itself to measured steps too).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from .acceptance_estimators import AcceptanceEstimator, expected_tokens
from .goodput import Choice, StepCost, choose_lengths
from .step_time import StepFeatures, StepTimeModel

log = logging.getLogger("turbospec.control")

# Speculation is switched on only when it beats plain decoding by this factor, and switched off as soon as
# it stops beating it: a Schmitt trigger against flapping on estimation noise (the authors' fork uses 10%).
SWITCH_ON_GAIN = 0.10


@dataclass
class Candidate:
    """One decoding request as the controller sees it."""

    request_id: str
    k_max: int  # the most drafts it may verify: the cap, the tokens left, or the n-gram match length
    context: int  # its context length
    catch_up: int = 0  # tokens a draft model must run over before drafting (its prompt, the first time)
    remaining: int = 0  # tokens it may still generate


@dataclass
class ControllerStats:
    num_choices: int = 0  # steps with at least one decoding request
    controller_s: float = 0.0  # time spent choosing
    measured_s: float = 0.0  # measured time of those steps
    predicted_s: float = 0.0  # the model's prediction for the same steps, from what they actually ran
    abs_error_s: float = 0.0
    last_acceptance: float | None = None  # mean estimate over the requests of the last choice

    def as_dict(self) -> dict[str, float | None]:
        n = max(self.num_choices, 1)
        return {
            "controller_overhead": self.controller_s / self.measured_s if self.measured_s else 0.0,
            "mean_predicted_step_s": self.predicted_s / n,
            "mean_measured_step_s": self.measured_s / n,
            "step_time_mean_relative_error": self.abs_error_s / self.measured_s if self.measured_s else 0.0,
            "acceptance_estimate": self.last_acceptance,
        }


def base_step(decode_contexts: list[int], pending: list[tuple[int, int]], budget: int) -> tuple[StepFeatures, int]:
    """The step as the scheduler will build it without drafts, and the token budget left for drafts.

    decode_contexts: each decoding request's tokens (one decode each); pending: (tokens computed, tokens known)
    of the prompts that may be prefilled, in the order the scheduler takes them. Drafts only use leftover
    budget: they never delay a waiting prompt."""
    f = StepFeatures()
    for ctx in decode_contexts:
        f.add(ctx - 1, 1)
    budget -= len(decode_contexts)
    for done, total in pending:
        if budget <= 0:
            break
        q = min(total - done, budget)
        f.add(done, q)
        budget -= q
    return f, max(budget, 0)


def without_prefill(cost: StepCost, decodes_s: float) -> StepCost:
    """The step's cost less its prefill chunks' share, so that drafts are weighed against the decodes' own time.

    A prompt's chunk runs this step whatever the drafts: counted in the time that the decodes' tokens are divided
    by, it made drafting look cheap beside it. The drafts keep their marginal cost in the real step (past a knot,
    a verified token costs what a prefill token does). With qwen2.5-coder-1.5b and its 0.5B draft at saturation,
    adaptive ran 1.20x no speculation's latency before (benchmarks/results/goodput_sweep/archive/
    2026-11-30-goodput_saturation.md), 1.007x after (goodput_sweep/archive/
    2026-12-06-2251-goodput_sweep_zen4_b.md): beside a 256-token chunk it had drafted for every decoding request,
    and the draft model first ran over all their prompts."""
    prefill_s = cost(0, 0, 0) - decodes_s
    if prefill_s <= 0:
        return cost
    return lambda sum_k, max_k, sum_kctx: cost(sum_k, max_k, sum_kctx) - prefill_s


def widen_lone_request(ks: list[int], caps: list[int], budget: int) -> list[int]:
    """Draft lengths for a proposer that ends each draft where it turns unsure (the confidence stop,
    SpeculativeConfig.draft_stop). When a single request decodes and the controller lets it draft, it may draft up
    to its cap (within the step's spare tokens): how far is then the draft's own call, which sees each token's
    confidence where the controller sees only averages per position. With several requests the controller's ks
    stay the caps (the stop may only cut them): the stop weighs one request's next draft forward against its own
    tokens, not the longer batched draft and verification every other request of the step would wait for.

    At batch 1 widening is what makes the stop pay: benchmarks/results/adaptive_replay/adaptive_replay.md has auto with the stop at
    1.060x / 1.042x of the best fixed k (MT-Bench / HumanEval), where ad hoc replays of the same runs (not
    committed) read 1.025x / 0.989x with the controller's ks as caps, and widening every request lost up to 25% of
    the best fixed k's speed at batch 4."""
    if len(ks) != 1 or ks[0] == 0:
        return ks
    return [max(ks[0], min(caps[0], budget))]


class GoodputController:
    def __init__(self, model: StepTimeModel, estimator: AcceptanceEstimator, switch_on_gain: float = SWITCH_ON_GAIN,
                 tree_levels: int = 0) -> None:
        self.model = model
        self.tree_levels = tree_levels  # a tree drafter's depth: its draft passes are min(this, the largest k)
        self.estimator = estimator
        self.switch_on_gain = switch_on_gain
        self.speculating = False
        self.num_observations = 0  # verifications seen: none means the acceptance estimate is only its prior
        self.stats = ControllerStats()
        self.last_choice: Choice | None = None
        self._profiled_batch = model.max_profiled_batch
        self._warned_extrapolation = False
        # a per-draft-forward cost makes the longest draft matter: search over depth caps (see choose_lengths)
        draft = model.parts.get("draft")
        self._depth_costs = draft is not None and any(c in ("draft_steps", "drafting", "draft_levels")
                                                      for c in draft.columns)

    def choose(self, candidates: list[Candidate], base: StepFeatures, max_total: int | None = None) -> list[int]:
        """Draft lengths for this step's decoding requests; `base` is the step without any drafts (base_step),
        max_total the token budget the drafts may use."""
        start = time.perf_counter()
        if len(candidates) > self._profiled_batch and self._profiled_batch and not self._warned_extrapolation:
            self._warned_extrapolation = True
            log.warning("%d requests decode, but the step-time profile only measured batches up to %d: its costs "
                        "are extrapolated. Run `turbospec profile --batch-sizes ...` with larger batches.",
                        len(candidates), self._profiled_batch)
        rates = [self.estimator.rates(c.request_id, c.k_max) if c.k_max > 0 else [0.0] for c in candidates]
        per_request = self.model.per_drafting_request_s()  # refitted online: read once per step
        catch_ups = [self._catch_up_s(c) for c in candidates]  # model evaluations: once, whatever the passes
        cost = self.model.spec_cost(base, self.tree_levels)
        if base.tokens > len(candidates):  # prefill chunks beside the decodes
            decodes = base_step([c.context for c in candidates], [], len(candidates))[0]
            cost = without_prefill(cost, self.model.spec_cost(decodes, self.tree_levels)(0, 0, 0))
        min_gain = 0.0 if self.speculating else self.switch_on_gain
        choice = self._best(candidates, rates, catch_ups, cost, per_request, max_total, min_gain)
        hopeful = [self.estimator.hopeful_rates(c.request_id, c.k_max) if k == 0 and c.k_max > 0 else r
                   for c, k, r in zip(candidates, choice.ks, rates)]
        if hopeful != rates:
            # Optimism under uncertainty: a request whose drafting does not pay at its estimated acceptance is
            # still drafted for while it would pay (by the margin) at one standard deviation above it. Without
            # this an estimate held below the break-even is never tested: the 0.5B draft accepts 0.99 of HumanEval
            # for the 1.5B, yet after one probe of 4 accepted drafts the estimate stayed below what k = 4 needs on
            # an AMX Xeon (an ad hoc trace, not committed), and `auto` stayed at k = 0, 1.35x slower than k = 4
            # (goodput_sweep_amx_light.md). The sd includes how far requests' levels spread, so in a stream of
            # chat and code each new request is tried (RequestBeta.hopeful_level). Each verification narrows it,
            # so tries stop where drafting is clearly worse; where it is close, a try loses little (the gap
            # between two goodputs). Switching on from nothing on hope alone needs the switch-on margin.
            choice = self._best(candidates, hopeful, catch_ups, cost, per_request, max_total,
                                min_gain if any(choice.ks) else self.switch_on_gain)
        self.speculating = any(choice.ks)
        self.last_choice = choice
        drafting = [r[0] for r, c in zip(rates, candidates) if c.k_max > 0]
        self.stats.last_acceptance = sum(drafting) / len(drafting) if drafting else self.stats.last_acceptance
        self.stats.controller_s += time.perf_counter() - start
        return choice.ks

    def _best(self, candidates: list[Candidate], rates: list[list[float]], catch_ups: list[float], cost: StepCost,
              per_request: float, max_total: int | None, min_gain: float) -> Choice:
        activation = [self._activation_cost(c, r, per_request, s) for c, r, s in zip(candidates, rates, catch_ups)]
        return choose_lengths(rates, [c.k_max for c in candidates], cost, [c.context for c in candidates],
                              min_gain=min_gain, max_total=max_total, search_depth=self._depth_costs,
                              activation=activation if any(activation) else None)

    def _catch_up_s(self, c: Candidate) -> float:
        """The draft model's predicted time to run over the tokens of the request it has not seen (0 for the usual
        one or two, which are part of the step's draft cost).

        Priced as the engine's steps count it (speculation.step_features), which is how the model was fitted:
        catch-up tokens are draft tokens, and draft_kv holds only the drafts' own k x context. So priced, the draft
        part of the catch-up steps of qwen2.5-coder-1.5b's 0.5B draft came to 1.278 s predicted against 1.279 s
        measured (benchmarks/results/step_pricing/step_pricing_amx_b.md). Charging each catch-up token a decode's
        draft_kv as well priced catch-ups far above that and kept the code requests of a chat + code stream from
        ever drafting (an ad hoc trace, not committed; goodput_sweep_amx_d.md is the stream after the mend)."""
        if c.k_max <= 0 or c.catch_up <= 2:
            return 0.0
        return self.model.predict_part("draft", StepFeatures(draft_tokens=c.catch_up))

    def _activation_cost(self, c: Candidate, rates: list[float], per_request: float, catch_up_s: float) -> float:
        """Seconds a request adds by drafting at all, whatever its k.

        - Draft heads grow one candidate tree per request (k picks how many of its nodes are verified; the
          levels it needs are priced by spec_cost): the step-time model's per-drafting-request cost.
        - A draft model drafts for a request only after running over every token it has not seen: the whole
          prompt the first time. That cost is paid once and buys speculation for the rest of the request, so
          the choice charges each step its share: catch-up time / the steps left at full speculation."""
        if c.k_max <= 0:
            return 0.0
        if catch_up_s <= 0:
            return per_request
        return per_request + catch_up_s / max(1.0, c.remaining / expected_tokens(rates, c.k_max))

    def observe(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        self.estimator.observe(request_id, num_draft, num_accepted)
        self.num_observations += 1

    def observe_nodes(self, request_id: str, num_nodes: int, accepted_ranks: list[int]) -> None:
        self.estimator.observe_nodes(request_id, num_nodes, accepted_ranks)
        self.num_observations += 1

    def end_step(self) -> None:
        self.estimator.end_step()

    def free(self, request_id: str) -> None:
        self.estimator.free(request_id)

    def record_step(self, predicted_s: float, measured_s: float) -> None:
        s = self.stats
        s.num_choices += 1
        s.predicted_s += predicted_s
        s.measured_s += measured_s
        s.abs_error_s += abs(predicted_s - measured_s)
