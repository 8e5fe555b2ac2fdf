"""The step loop: schedule -> propose -> execute -> verify -> commit, each stage a call into its own module; the
commit appends each request's tokens (emitting its output) before its KV is committed to the prefix cache.
Synchronous and single-threaded; `LLM` drives it to completion and the server's async engine drives it from a
background thread. What is measured once per machine and model (the step-time model, the margin-gate threshold,
the layer-skip plan) reaches the engine as inputs: turbospec.tuning.build_engine loads or measures them."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

import torch

from .admission import Admission
from .config import REQUEST_DETERMINISTIC_MODES, EngineConfig
from .control.step_time import StepSample, StepTimeModel
from .determinism.exact import ExactDecoding
from .draft import Draft
from .kv.block_manager import BlockManager
from .kv.kv_cache import KVCache
from .kv.sizing import max_model_len, num_kv_blocks
from .models.loader import LoadedModel, load_model, parse_dtype
from .output_assembly import OutputAssembler
from .outputs import RequestOutput
from .parallel.group import start_tensor_parallel
from .parallel.plan import ShardPlan
from .proposers.factory import ProposerTarget, build_proposer
from .request import Request
from .runner import ModelOutput, ModelRunner
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .speculation import DraftCost, Speculation, step_features
from .structured.constraints import Constraints
from .verification.lossy import AdaptiveThresholds
from .verification.step import StepVerifier, Verified
from .verification.tree import compaction

log = logging.getLogger("turbospec.engine")


@dataclass
class StepStats:
    num_scheduled: int
    num_batched_tokens: int
    num_preempted: int
    seconds: float


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, progress: bool = True,
                 step_time_model: StepTimeModel | None = None) -> None:
        self.config = config
        torch.set_num_threads(config.threads)
        self.dtype = parse_dtype(config.dtype)
        # LayerCast keeps the weights in bf16 but computes, and keeps the KV cache, in float32
        self.compute_dtype = torch.float32 if config.deterministic == "layercast" else self.dtype
        tp = config.tensor_parallel_size
        # tensor parallelism shards dense weights: "auto" means dense there (packed formats are refused)
        weight_format = "bf16" if tp > 1 and config.weight_format == "auto" else config.weight_format
        self.loaded = loaded or load_model(config.model, self.dtype, config.device, progress=progress,
                                          weight_format=weight_format)
        self.model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        # the KV heads this process holds: all of them, or rank 0's share under tensor parallelism
        self.kv_config = ShardPlan(0, tp, self.model_config).local_config() if tp > 1 else self.model_config
        self.max_model_len = max_model_len(config, self.model_config)
        blocks = num_kv_blocks(config, self.kv_config, self.max_model_len, self.compute_dtype)
        self.kv = KVCache.allocate(self.kv_config, blocks, config.block_size, self.compute_dtype, config.device)
        self.blocks = BlockManager(self.kv.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len)
        self.runner = ModelRunner(self.loaded.model, self.kv, self.blocks, config.device,
                                  batch_invariant=config.deterministic == "batch-invariant",
                                  compute_dtype=self.compute_dtype if self.compute_dtype != self.dtype else None)
        self.requests: dict[str, Request] = {}
        self.last_step: StepStats | None = None
        self.last_sample: StepSample | None = None
        self.sample_steps = False  # build last_sample even without the controller (the profiler sets it)
        self.spec = config.speculative_config
        thresholds = AdaptiveThresholds.fresh()  # AdaSD's, shared by a draft proposer
        target = ProposerTarget(config, self.loaded, self.runner, self.dtype, self.kv.num_blocks, thresholds)
        proposer = build_proposer(self.spec, target, progress) if self.spec else None
        if proposer is not None and proposer.capture_layers:  # EAGLE reads these layers' outputs
            self.loaded.model.capture_layers = proposer.capture_layers
        self.speculation = Speculation(config, proposer, thresholds, self.scheduler, self.blocks, step_time_model)
        self.constraints = Constraints(self.speculation)  # structured outputs: grammars over drafts and rows
        # positional sampling, llm42 windows and margin-gate checks for requests in a deterministic mode
        self.exact = ExactDecoding(config, self.tokenizer, self.max_model_len, self.speculation.rollback)
        self.admission = Admission(config, self.model_config, self.tokenizer, self.max_model_len, self.exact)
        self.verifier = StepVerifier(self.speculation, self.exact, self.runner.batch_invariant)
        self.emitter = OutputAssembler(self.tokenizer, self.scheduler, self.max_model_len, self._release)
        if tp > 1:
            self.runner.parallel = start_tensor_parallel(config, self.loaded.model, self.kv.layers,
                                                         self.kv.num_blocks, self.dtype, self.compute_dtype)
        if config.deterministic in REQUEST_DETERMINISTIC_MODES:  # they run the invariant path: probe it now
            from .determinism.batch_invariant import probe_model  # (loads our kernels' shape probe)

            log.info("batch-invariant linears (shape: row multiple, most rows per call, or our bf16 kernel): %s",
                     probe_model(self.loaded.model))

    def shutdown(self) -> None:
        """Release what outlives a step: the other tensor-parallel ranks (also stopped when the engine is
        garbage-collected or the process exits)."""
        if self.runner.parallel is not None:
            self.runner.parallel.close()

    # --- requests ----------------------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    prompt_token_ids: list[int] | None = None, *, speculate: bool = True,
                    arrival_time: float | None = None, deterministic: str | None = None,
                    acceptance: str | None = None) -> str:
        """Validate and queue one request (one completion; n > 1 is fanned out by the caller).

        speculate=False keeps this request at k = 0 whatever the policy; arrival_time (time.monotonic) lets a
        server count the time a request spent before it reached the engine; deterministic asks for a
        deterministic mode for this request only (see request_determinism); acceptance picks this request's
        acceptance policy (see request_acceptance)."""
        rid = request_id or uuid.uuid4().hex
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        req = self.admission.new_request(rid, prompt, params, prompt_token_ids, speculate, deterministic, acceptance)
        if arrival_time is not None:
            req.arrival_time = arrival_time
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    def check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        self.admission.check_prompt(ids, params)

    def check_structured(self, params: SamplingParams, deterministic: str | None = None) -> None:
        """Raise ValueError (GrammarError) if this request's structured-output ask cannot run."""
        self.admission.start_grammar(params, deterministic)

    def request_determinism(self, value: str | None) -> str | None:
        return self.admission.request_determinism(value)

    def request_acceptance(self, value: str | None, determinism: str | None = None) -> str:
        return self.admission.request_acceptance(value, determinism)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None or req.is_finished:
            return None
        self.scheduler.finish(req, "abort")
        self._release(req)
        return self.emitter.output(req, [])

    def fail_request(self, request_id: str, message: str) -> RequestOutput | None:
        """Finish one request with finish_reason "error" (its KV is freed); the others carry on."""
        req = self.requests.pop(request_id, None)
        if req is None or req.is_finished:
            return None
        self.scheduler.finish(req, "error")
        req.error = message
        self._release(req)
        out = self.emitter.output(req, [])
        out.error = message
        return out

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def _release(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        self.speculation.free(req.request_id)

    # --- speculation policy and statistics -----------------------------------------------------------------

    def set_speculation(self, value: int | str) -> None:
        """0 turns speculation off, k >= 1 fixes the draft length, "auto" hands it to the goodput controller
        (which needs a step-time model: turbospec.tuning.ensure_controller)."""
        self.speculation.set_mode(value)

    def spec_stats_dict(self) -> dict[str, object]:
        return self.speculation.stats_dict()

    def reset_spec_stats(self) -> None:
        self.speculation.reset_stats()

    def determinism_stats(self) -> dict[str, float | int]:
        """Verified-mode counters: margin-gate checks (trigger rate) and flips, llm42 windows and rollbacks."""
        return self.exact.stats.as_dict()

    # --- one step ------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        spec = self.speculation
        sched = self.scheduler.schedule(spec.budget if spec.active else None)
        scheduled = time.perf_counter()  # scheduling (and the controller's choice) is overhead, not drafting
        cost = spec.propose(sched) if spec.active else DraftCost()
        self.constraints.cut_drafts(sched)
        proposed = time.perf_counter()
        if sched.is_empty:
            self.last_step = StepStats(0, 0, len(sched.preempted), proposed - start)
            self.last_sample = None
            return []
        windows = self.exact.begin_step(sched)  # held tokens ride along as this step's drafts
        # only the controller and the profiler read step samples: plain serving does not build them
        features = step_features(sched, cost) if spec.learning or self.sample_steps else None
        model_out = self.runner.execute(sched, self.exact.exact_ids)
        forwarded = time.perf_counter()
        self.constraints.mask(sched, model_out)
        if cost.tokens:  # AdaSD weighs a draft step against this (verification/lossy.py)
            spec.thresholds.observe_costs(target_step_s=forwarded - proposed)
        verified = self.verifier.verify(sched, model_out)
        outputs = self._commit(sched, model_out, verified)
        end = time.perf_counter()
        self.last_step = StepStats(len(sched.scheduled), sched.num_batched_tokens, len(sched.preempted), end - start)
        if self.exact.fixed_window is None:
            self.exact.observe_step(end - start, windows)
        self.last_sample = None
        if features is not None:
            # lookups are bookkeeping-sized: they count as overhead, not as drafting
            draft_s = proposed - scheduled if cost.tokens or cost.drafting else 0.0
            self.last_sample = StepSample(features, forwarded - proposed, draft_s,
                                          (end - start) - (forwarded - proposed) - draft_s)
            if spec.learning:
                spec.learn_step_time(self.last_sample)
        return outputs

    def _commit(self, sched: SchedulerOutput, out: ModelOutput, verified: Verified) -> list[RequestOutput]:
        """Append each request's verified tokens (emitting its output), roll its KV forward to what was accepted,
        and tell speculation what verification found."""
        outputs: list[RequestOutput] = []
        now = time.monotonic()
        for i, s in enumerate(sched.scheduled):
            req = s.request
            rid = req.request_id
            result = verified.results.get(rid)
            num_drafts = 0 if rid in verified.checked else len(req.draft.tokens)  # held tokens are no drafts
            accepted = result[1] if result else 0
            decoding = s.samples and s.num_new_tokens == 1  # before appending: that moves the end
            if rid in verified.tree_paths:  # the accepted branch's K/V moves down to its final positions
                assert req.draft.tree is not None
                src, dst = compaction(req.draft.tree, verified.tree_paths[rid], s.start + s.num_new_tokens - 1)
                self.runner.move_kv(rid, src, dst)
            if result:  # append first: committing hashes the accepted tokens into the prefix cache
                self.speculation.observe_hidden(req, out, i, result[0], verified.emit_rows.get(rid))
                try:
                    if req.determinism == "llm42" and (req.unverified_token_ids or rid not in self.exact.exact_ids):
                        self.exact.hold(req, [t for t, _ in result[0]])  # output once its window is checked
                    elif result[0]:  # (margin-gate may hold back every token of this step)
                        drafts_kept = 0 if rid in verified.checked else accepted  # (held tokens are no drafts)
                        # what a grammar forces next rides along, without log-probs; its KV is the next step's
                        forced = self.constraints.extend(req, [t for t, _ in result[0]], self.max_model_len)
                        tokens = result[0] + [(t, None) for t in forced]
                        outputs.append(self.emitter.append(req, tokens, now, drafts_kept, num_drafts))
                except Exception as exc:  # e.g. the tokenizer fails on this request's text: fail it alone
                    log.exception("request %s failed while appending tokens", rid)
                    failed = self.fail_request(rid, f"{type(exc).__name__}: {exc}")
                    if failed is not None:
                        outputs.append(failed)
                    req.draft = Draft([])
                    continue
            self.exact.before_commit(s, accepted)
            self.scheduler.commit(s, accepted)
            self.exact.rewind(req)
            self.speculation.observe(req, num_drafts, accepted, decoding,
                                     result[0] if result and rid not in verified.checked else None,
                                     verified.tree_paths.get(rid))
            req.draft = Draft([])
        self.speculation.end_step()
        return outputs
