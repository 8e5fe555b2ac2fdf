"""Speculation around one step: how many tokens each decoding request may draft (a fixed k, or the goodput
controller's choice), the drafts themselves, and what each verification teaches the controller, the proposer and
the statistics. The engine calls it at the schedule, propose and commit stages; without a speculative_config it
is inactive and every request decodes one token a step."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from .config import EngineConfig, SpeculativeConfig
from .control.acceptance_estimators import make_estimator
from .control.controller import Candidate, GoodputController, base_step, widen_lone_request
from .control.step_time import StepFeatures, StepSample, StepTimeModel
from .draft import Draft
from .kv.block_manager import BlockManager
from .outputs import Emitted
from .proposers.base import Proposer
from .request import Request
from .runner import ModelOutput
from .scheduler import Scheduler, SchedulerOutput
from .verification.lossy import AdaptiveThresholds
from .verification.stats import SpecDecodingStats


@dataclass
class DraftCost:
    """What proposing cost this step, as the step-time model's features count it: tokens a draft model processed
    (0 for lookups), requests draft heads drafted for, and the levels their trees grew."""

    tokens: int = 0
    drafting: int = 0
    levels: int = 0


def step_features(sched: SchedulerOutput, cost: DraftCost) -> StepFeatures:
    """The step as the step-time model sees it (planned now: the sample is logged and serialised as it is)."""
    f = StepFeatures(draft_tokens=cost.tokens, drafting_requests=cost.drafting, draft_levels=cost.levels)
    for s in sched.scheduled:
        f.add(s.start, s.num_new_tokens, len(s.request.draft.tokens[: s.num_spec_tokens]) if s.samples else 0)
    f.gathered_slots()
    return f


class Speculation:
    def __init__(self, config: EngineConfig, proposer: Proposer | None, thresholds: AdaptiveThresholds,
                 scheduler: Scheduler, blocks: BlockManager, step_time_model: StepTimeModel | None = None) -> None:
        self.config = config
        self.spec: SpeculativeConfig | None = config.speculative_config
        self.proposer = proposer
        self.thresholds = thresholds  # AdaSD's, shared with a draft proposer
        self.scheduler, self.blocks = scheduler, blocks
        # 0 (off), a fixed k, or "auto" (the goodput controller); switchable at run time by set_mode
        self.mode: int | str = self.spec.num_speculative_tokens if self.spec else 0
        self.synthetic_acceptance = self.spec.synthetic_acceptance if self.spec else None
        self.rng = np.random.default_rng(config.seed)
        self.stats = SpecDecodingStats()
        self.controller: GoodputController | None = None
        if step_time_model is not None:
            self.attach_step_time_model(step_time_model)
        self._lookups: dict[str, list[int]] = {}  # auto mode with free lookups: made before the choice of k
        # requests the proposer drafted for this step: it hears how each verification went even where a grammar
        # then cut the draft to nothing (a draft model must forget the KV of what it drafted)
        self._drafted: set[str] = set()
        self.record_history = False
        self.history: list[dict[str, float | int | None]] = []
        # (request id, drafts verified, drafts accepted) per verification, when set to a list: the traces that
        # benchmarks/acceptance_estimators.py replays to choose the acceptance estimator
        self.verify_trace: list[tuple[str, int, int]] | None = None

    # --- policy ------------------------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return self.proposer is not None and self.mode != 0

    @property
    def learning(self) -> bool:
        """Whether the controller chooses k and learns from this step."""
        return self.controller is not None and self.mode == "auto"

    def attach_step_time_model(self, model: StepTimeModel) -> None:
        assert self.spec is not None and self.proposer is not None
        estimator = make_estimator(self.spec.acceptance_estimator, ranks_nodes=self.proposer.ranks_nodes)
        self.controller = GoodputController(model, estimator, tree_levels=self.proposer.tree_levels)

    def set_mode(self, value: int | str) -> None:
        """0 turns speculation off, k >= 1 fixes the draft length, "auto" hands it to the goodput controller."""
        if value != "auto" and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"speculation must be 0 (off), an integer k >= 1 or \"auto\", got {value!r}")
        if value != 0 and self.proposer is None:
            raise ValueError("this engine has no speculative_config: only 0 (no speculation) is possible")
        if value == "auto" and self.controller is None:
            raise ValueError("speculation 'auto' needs a step-time model: call turbospec.tuning.ensure_controller("
                             "engine) first (it loads the cached profile or measures one)")
        self.mode = value

    def confidence_stop(self) -> bool:
        """In auto mode a draft model's drafts end where it turns unsure (SpeculativeConfig.draft_stop)."""
        return (self.mode == "auto" and self.spec is not None and self.spec.confidence_stop
                and self.proposer is not None and self.proposer.stops_when_unsure)

    # --- schedule: the draft budget ------------------------------------------------------------------------

    def budget(self, decoding: list[Request]) -> dict[str, int]:
        """Draft tokens each decoding request may verify this step (the scheduler's callback)."""
        assert self.spec is not None and self.proposer is not None
        self._lookups = {}
        limit = self.spec.k_limit if self.mode == "auto" else int(self.mode)
        # never draft past max_tokens: the last token is always the verifier's own
        caps = [max(0, min(limit if r.speculate else 0, r.params.max_tokens - r.num_output_tokens - 1))
                for r in decoding]
        if self.mode != "auto":
            return {r.request_id: k for r, k in zip(decoding, caps)}
        if self.controller is None:
            raise RuntimeError("speculation 'auto' needs a step-time model: build the engine with "
                               "turbospec.tuning.build_engine, or call turbospec.tuning.ensure_controller(engine)")
        if self.proposer.free_lookups:  # proposals cost nothing: look first, then choose how many to verify
            found = self.proposer.propose(decoding, caps)
            self._lookups = {r.request_id: d.tokens for r, d in zip(decoding, found)}
            caps = [len(d.tokens) for d in found]
        base, spare_tokens = self._base_features(decoding)
        caps = self._guard_kv(decoding, caps)
        candidates = [Candidate(r.request_id, k, r.num_tokens, self.proposer.catch_up_tokens(r),
                                r.params.max_tokens - r.num_output_tokens) for r, k in zip(decoding, caps)]
        ks = self._cold_start_probe(candidates, self.controller.choose(candidates, base, spare_tokens))
        if self.confidence_stop():
            ks = widen_lone_request(ks, caps, spare_tokens)
        return {r.request_id: k for r, k in zip(decoding, ks)}

    def _cold_start_probe(self, candidates: list[Candidate], ks: list[int]) -> list[int]:
        """Draft once for a draft model the controller has never seen verified. Its acceptance is then only the
        prior (0.6), at which a draft costing most of a target step never looks worth starting, and without
        drafting the real acceptance is never measured (the 0.5B draft for qwen2.5-coder-1.5b accepts ~0.9 on
        HumanEval, yet `auto` would choose k = 0 on every step). One step at the cap, for the request cheapest to
        start (least catch-up); once it is verified the estimator knows the pair and the controller decides (a
        probe cut short, e.g. by an abort, is simply tried again)."""
        assert self.controller is not None and self.proposer is not None
        if self.controller.num_observations or any(ks) or not self.proposer.runs_model:
            return ks
        options = [i for i, c in enumerate(candidates) if c.k_max > 0]
        if not options:
            return ks
        i = min(options, key=lambda j: candidates[j].catch_up)
        return [candidates[j].k_max if j == i else k for j, k in enumerate(ks)]

    def _base_features(self, decoding: list[Request]) -> tuple[StepFeatures, int]:
        """This step as the scheduler will build it without drafts (decodes plus the prefill it can fit), and
        the token budget left over (control/controller.py, base_step)."""
        seats = self.config.max_num_seqs - len(self.scheduler.running)
        pending = [(r.num_computed_tokens, r.num_tokens) for r in self.scheduler.running if r.is_prefilling]
        pending += [(0, r.num_tokens) for r in list(self.scheduler.waiting)[: max(seats, 0)]]
        return base_step([r.num_tokens for r in decoding], pending, self.config.max_num_batched_tokens)

    def _guard_kv(self, decoding: list[Request], caps: list[int]) -> list[int]:
        """Keep a block of headroom per running request: when drafts would eat into it, a request may only
        draft into the free slots of its last block."""
        spare = self.blocks.num_free_blocks - len(self.scheduler.running)
        if spare * self.config.block_size >= sum(caps):
            return caps
        return [min(k, max(0, self.blocks.num_slots(r.request_id) - r.num_tokens)) for r, k in zip(decoding, caps)]

    # --- propose -----------------------------------------------------------------------------------------

    def propose(self, sched: SchedulerOutput) -> DraftCost:
        """Fill each scheduled request's draft (a draft model's cost is in its tokens and forwards, so it counts
        neither requests nor levels; a lookup costs nothing)."""
        assert self.proposer is not None  # (every request enters a step draft-free: the last commit emptied it)
        spec = [s for s in sched.scheduled if s.num_spec_tokens > 0 and not s.request.check_tokens]
        self._drafted = set()
        if not spec:
            return DraftCost()
        if self.mode == "auto" and self.proposer.free_lookups:
            for s in spec:
                s.request.draft = Draft(self._lookups.get(s.request.request_id, [])[: s.num_spec_tokens])
            self._drafted = {s.request.request_id for s in spec if s.request.draft.tokens}
            return DraftCost()
        # a draft model runs over the tokens it has not seen, then one token per further draft step (counted once
        # drafted: a confidence stop may end a draft before its k)
        catch_up = [self.proposer.catch_up_tokens(s.request) for s in spec] if self.proposer.runs_model else []
        if self.proposer.stops_when_unsure:
            self.proposer.confidence_stop = self.confidence_stop()
        drafts = self.proposer.propose([s.request for s in spec], [s.num_spec_tokens for s in spec])
        tokens = sum(c + max(len(d.tokens), 1) - 1 for c, d in zip(catch_up, drafts))
        for s, d in zip(spec, drafts):
            # a chain verifies on the linear path unless the proposer reads the tree's rows (lookahead)
            if d.tree is not None and d.tree.is_chain and not self.proposer.observes_trees:
                d.tree = None
            s.request.draft = d
        self._drafted = {s.request.request_id for s, d in zip(spec, drafts) if d.tokens}
        drafting = sum(1 for d in drafts if d.tokens) if self.proposer.needs_hidden else 0
        levels = self.proposer.draft_levels(max(s.num_spec_tokens for s in spec)) if drafting else 0
        return DraftCost(tokens, drafting, levels)

    # --- commit: what verification teaches ------------------------------------------------------------------

    def observe_hidden(self, req: Request, out: ModelOutput, index: int, emitted: Emitted,
                       emit_rows: list[int] | None) -> None:
        """Heads and EAGLE draft from the hidden states of the rows that chose this step's tokens."""
        if self.proposer is None or not self.proposer.needs_hidden or req.determinism == "llm42":
            return
        tokens = [t for t, _ in emitted]
        offsets = (emit_rows if emit_rows is not None else list(range(len(tokens))))[: len(tokens)]
        if offsets:
            source = out.features if out.features is not None else out.hidden
            rows = torch.tensor([out.row_start[index] + o for o in offsets], device=source.device)
            self.proposer.observe_hidden(req, source[rows], tokens, req.num_tokens + len(tokens))

    def observe(self, req: Request, num_drafts: int, accepted: int, decoding: bool, emitted: Emitted | None,
                tree_path: list[int] | None) -> None:
        """After the scheduler committed this request's step: statistics, the proposer, and the controller."""
        if decoding:
            self.stats.observe_choice(num_drafts)
        if self.proposer is not None and num_drafts:
            tree = req.draft.tree
            self.stats.observe(num_drafts, accepted, None if tree is None else max(tree.depth))
            if self.verify_trace is not None:
                self.verify_trace.append((req.request_id, num_drafts, accepted))
        if self.proposer is not None and req.request_id in self._drafted and not req.is_finished:
            self.proposer.on_verified(req, accepted)
        if self.learning and emitted is not None:
            self._observe_acceptance(req, num_drafts, accepted, emitted, tree_path)

    def _observe_acceptance(self, req: Request, num_drafts: int, accepted: int, emitted: Emitted,
                            path: list[int] | None) -> None:
        """Feed the controller's estimator. A free lookup is observed one position past the last verified
        draft, even at k = 0: did the lookup's next token match what the target emitted? Without this a
        request that is never given drafts could never show that it deserves some."""
        assert self.controller is not None and self.proposer is not None
        lookup = self._lookups.get(req.request_id, [])
        if accepted == num_drafts and len(lookup) > num_drafts and len(emitted) > num_drafts:
            if self.synthetic_acceptance is not None:
                hit = self.rng.random() < self.synthetic_acceptance
            else:
                hit = lookup[num_drafts] == emitted[num_drafts][0]
            num_drafts, accepted = num_drafts + 1, accepted + hit
        if self.proposer.ranks_nodes and req.accepts_trees:
            # the drafts were the proposer's most confident nodes: a tree, or a chain when they formed one (its
            # ranks are its depths); requests held to chains are a chain estimator's (NodeRank.observe)
            tree = req.draft.tree
            ranked = tree is not None and tree.ranks is not None and path is not None
            self.controller.observe_nodes(req.request_id, num_drafts,
                                          [tree.ranks[n] for n in path] if ranked else list(range(accepted)))
        elif num_drafts:
            self.controller.observe(req.request_id, num_drafts, accepted)

    def end_step(self) -> None:
        # only steps the controller chose count as steps without a verification: under a fixed k or none (a
        # policy switched at run time) it saw nothing, and ageing its evidence there made it forget a pair it had
        # measured (tests/control/test_controller.py, test_only_the_controllers_own_steps_age_its_acceptance_evidence)
        if self.learning:
            self.controller.end_step()

    def learn_step_time(self, sample: StepSample) -> None:
        assert self.controller is not None
        model = self.controller.model
        predicted = model.predict(sample.features)
        self.controller.record_step(predicted, sample.total_s)
        model.observe(sample)
        if self.record_history:
            choice = self.controller.last_choice
            self.history.append({
                "time": time.monotonic(), "num_decoding": len(choice.ks) if choice else 0,
                "mean_k": sum(choice.ks) / len(choice.ks) if choice and choice.ks else 0.0,
                "acceptance": self.controller.stats.last_acceptance,
                "predicted_s": predicted, "measured_s": sample.total_s,
            })

    def rollback(self, req: Request, num_tokens: int) -> None:
        if self.proposer is not None:
            self.proposer.rollback(req, num_tokens)

    def free(self, request_id: str) -> None:
        if self.proposer is not None:
            self.proposer.free(request_id)
        if self.controller is not None:
            self.controller.free(request_id)

    # --- statistics --------------------------------------------------------------------------------------

    def stats_dict(self) -> dict[str, object]:
        out: dict[str, object] = self.stats.as_dict()
        out["policy"] = self.mode
        if self.spec is not None:
            out["acceptance"] = self.spec.acceptance
            out["adaptive_thresholds"] = self.thresholds.as_dict()
        if self.controller is not None:
            out["controller"] = self.controller.stats.as_dict()
        return out

    def reset_stats(self) -> None:
        self.stats = SpecDecodingStats()
        if self.controller is not None:
            self.controller.stats = type(self.controller.stats)()
        self.history.clear()
