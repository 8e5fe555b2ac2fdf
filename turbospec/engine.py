"""The step loop: schedule -> run the model -> sample -> update requests. Synchronous and single-threaded;
`LLM` drives it to completion and the server's async engine drives it from a background thread."""

from __future__ import annotations

import logging
import math
import time
import uuid
from dataclasses import dataclass

import numpy as np
import torch

from .config import REQUEST_DETERMINISTIC_MODES, EngineConfig
from .control.acceptance_estimators import make_estimator
from .control.controller import Candidate, GoodputController, base_step, widen_lone_request
from .control.step_time import StepFeatures, StepSample
from .determinism.exact import COMPETITORS, ExactDecoding, PickedRows
from .kv.block_manager import BlockManager
from .kv.kv_cache import KVCache
from .models.loader import LoadedModel, load_model, parse_dtype
from .models.tokenizer import IncrementalDetokenizer
from .outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from .parallel.comm import backend_for
from .parallel.group import TensorParallelGroup
from .parallel.plan import ShardPlan
from .parallel.worker import WorkerSpec
from .request import Request
from .runner import ModelOutput, ModelRunner
from .sampler import SamplingBatch, compute_logprobs, fold_seed, make_generator, processed_probs, sample
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .verification.lossy import AdaptiveThresholds, relax_drafts
from .proposers.draft_model import DraftModelProposer
from .proposers.factory import build_proposer
from .proposers.ngram import NgramProposer
from .verification.policies import LOSSLESS_POLICIES, RELAXES_JS, check_policy
from .verification.stats import SpecDecodingStats
from .verification.tree import compaction, verify_tree_greedy, verify_tree_sampled
from .verification.chain import synthetic_verify, verify

log = logging.getLogger("turbospec.engine")

DEFAULT_KV_BUDGET_GIB = 4.0
CPU_MAX_MODEL_LEN = 4096


@dataclass
class StepStats:
    num_scheduled: int
    num_batched_tokens: int
    num_preempted: int
    seconds: float


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, progress: bool = True) -> None:
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
        # the KV heads this process holds: all of them, or rank 0's share under tensor parallelism
        self.kv_config = ShardPlan(0, tp, self.model_config).local_config() if tp > 1 else self.model_config
        self.tokenizer = self.loaded.tokenizer
        limit = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's context length {limit}")
        self.max_model_len = config.max_model_len or min(limit, CPU_MAX_MODEL_LEN)
        self.kv = KVCache.allocate(self.kv_config, self._num_blocks(), config.block_size, self.compute_dtype,
                                   config.device)
        self.blocks = BlockManager(self.kv.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len)
        self.runner = ModelRunner(self.loaded.model, self.kv, self.blocks, config.device,
                                  batch_invariant=config.deterministic == "batch-invariant",
                                  compute_dtype=self.compute_dtype if self.compute_dtype != self.dtype else None)
        self.requests: dict[str, Request] = {}
        self.last_step: StepStats | None = None
        self.spec = config.speculative_config
        self.adaptive_thresholds = AdaptiveThresholds.fresh()  # AdaSD's, shared by the draft proposer
        self.proposer = build_proposer(self.spec, self, progress) if self.spec else None
        if self.proposer is not None and self.proposer.capture_layers:  # EAGLE reads these layers' outputs
            self.loaded.model.capture_layers = self.proposer.capture_layers
        self.spec_stats = SpecDecodingStats()
        # 0 (off), a fixed k, or "auto" (the goodput controller); switchable at run time by set_speculation
        self.spec_mode: int | str = self.spec.num_speculative_tokens if self.spec else 0
        self.synthetic_acceptance = self.spec.synthetic_acceptance if self.spec else None
        self._synthetic_rng = np.random.default_rng(config.seed)
        self.controller: GoodputController | None = None
        self._ngram_drafts: dict[str, list[int]] = {}  # auto mode: lookups made before the choice
        self.last_sample: StepSample | None = None
        self.sample_steps = False  # build last_sample even without the controller (the profiler sets it)
        self.record_history = False
        self.controller_history: list[dict[str, float | int | None]] = []
        # (request id, drafts verified, drafts accepted) per verification, when set to a list: the traces that
        # benchmarks/acceptance_estimators.py replays to choose the acceptance estimator
        self.verify_trace: list[tuple[str, int, int]] | None = None
        # positional sampling, llm42 windows and margin-gate checks for requests in a deterministic mode
        self.exact = ExactDecoding(self)
        self._exact_ids: set[str] = set()  # requests this step computes on the invariant path
        self._tree_paths: dict[str, list[int]] = {}  # this step's accepted tree paths (node indices)
        self._emit_rows: dict[str, list[int]] = {}  # ... and the row offsets that chose each emitted token
        self.logit_trace: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] | None = None  # calibration only
        if config.deterministic == "margin-gate":
            _ = self.exact.threshold  # calibrate now (and cache it) rather than in the middle of a step
        # Shard last: a layer-skip search and a margin calibration above run private one-process engines over
        # the whole model (their results do not depend on the split); the profile below measures the split one.
        if tp > 1:
            self.runner.parallel = self._start_tensor_parallel()
        if config.deterministic in REQUEST_DETERMINISTIC_MODES:  # they run the invariant path: probe it now
            from .determinism.batch_invariant import probe_model

            log.info("batch-invariant linears (shape: row multiple, most rows per call, or our bf16 kernel): %s", probe_model(self.loaded.model))
        if self.spec_mode == "auto":
            self._ensure_controller(progress)

    def _start_tensor_parallel(self) -> TensorParallelGroup:
        c = self.config
        spec = WorkerSpec(model=c.model, dtype=str(self.dtype).removeprefix("torch."),
                          compute_dtype=str(self.compute_dtype).removeprefix("torch."), device=c.device,
                          threads=c.threads, world=c.tensor_parallel_size, num_blocks=self.kv.num_blocks,
                          block_size=c.block_size, store_host="127.0.0.1", store_port=0, backend=backend_for(c.device))
        return TensorParallelGroup(spec, self.loaded.model, self.kv.layers)

    def shutdown(self) -> None:
        """Release what outlives a step: the other tensor-parallel ranks (also stopped when the engine is
        garbage-collected or the process exits)."""
        if self.runner.parallel is not None:
            self.runner.parallel.close()

    def _num_blocks(self) -> int:
        c = self.config
        per_block = KVCache.bytes_per_block(self.kv_config, c.block_size, self.compute_dtype)
        per_seq = math.ceil(self.max_model_len / c.block_size)
        if c.kv_cache_memory_gib is not None:
            blocks = int(c.kv_cache_memory_gib * 2**30 // per_block)
        else:
            blocks = min(c.max_num_seqs * per_seq, int(DEFAULT_KV_BUDGET_GIB * 2**30 // per_block))
        if blocks < per_seq:
            raise ValueError(
                f"the KV cache holds {blocks} blocks of {c.block_size} tokens, fewer than one sequence of "
                f"max_model_len={self.max_model_len} needs ({per_seq}): raise kv_cache_memory_gib or lower max_model_len"
            )
        return blocks

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
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        determinism = self.request_determinism(deterministic)
        policy = self.request_acceptance(acceptance, determinism)
        text = prompt if isinstance(prompt, str) else None
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                if not prompt:
                    raise ValueError("prompt is empty: give at least one character or token")
                prompt_token_ids = self.tokenizer.encode(prompt)
            else:
                prompt_token_ids = list(prompt)
        self.check_prompt(prompt_token_ids, params)
        rid = request_id or uuid.uuid4().hex
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        req = Request(
            request_id=rid, prompt_token_ids=prompt_token_ids, params=params, prompt=text,
            detokenizer=IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
            generator=None if params.greedy else make_generator(params.seed),
            eos_token_ids=() if params.ignore_eos else self.tokenizer.eos_token_ids,
            logprobs=[] if params.logprobs is not None else None, speculate=speculate, determinism=determinism,
            noise_seed=fold_seed(params.seed) if params.seed is not None else int(torch.randint(2**31, ())),
            acceptance=policy,
        )
        if arrival_time is not None:
            req.arrival_time = arrival_time
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    def check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if this prompt cannot run (empty, unknown ids, too long). Reads nothing that steps
        change, so a server may call it from another thread before queueing the request."""
        if not ids:
            raise ValueError("prompt is empty: give at least one character or token")
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be ints in [0, {self.model_config.vocab_size}), got {bad[:3]}")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) is {len(ids) + params.max_tokens}, "
                f"beyond max_model_len={self.max_model_len}"
            )

    def request_determinism(self, value: str | None, calibrate: bool = True) -> str | None:
        """The deterministic mode a request runs in: the engine's, or one it asks for. llm42 and margin-gate
        work per request on any engine but a LayerCast one; batch-invariant changes the kernels of every row in
        a step, so only an engine started in that mode offers it (and there every request already has it).
        margin-gate needs a threshold: with calibrate=False (a server's validation, off the engine thread) a
        model without one is refused instead of calibrated."""
        mode = self.config.deterministic
        if value is None:
            return mode if mode in REQUEST_DETERMINISTIC_MODES else None
        if value not in REQUEST_DETERMINISTIC_MODES:
            raise ValueError(f"unknown deterministic mode {value!r}: a request may ask for one of "
                             f"{', '.join(REQUEST_DETERMINISTIC_MODES)}")
        if self.config.weight_format in ("int4", "int8"):
            raise ValueError(f"deterministic modes run dense kernels with a fixed reduction order; this engine keeps "
                             f"only packed weights (weight_format {self.config.weight_format!r}): start it with "
                             "weight_format auto or bf16")
        if mode == "layercast":
            raise ValueError("this engine runs LayerCast (float32 compute and KV): per-request deterministic modes "
                             "are not available on it")
        if mode == "batch-invariant":
            return mode  # every row is already computed invariantly: the strongest mode, at no extra cost
        if value == "batch-invariant":
            raise ValueError("batch-invariant changes the kernels of every request in a step, so it is engine-wide: "
                             "start the engine with deterministic='batch-invariant', or ask for llm42 or margin-gate")
        if value == "margin-gate":
            if self.runner.parallel is not None and not self.exact.has_threshold():
                raise ValueError("margin-gate needs a calibrated threshold, and a tensor-parallel engine cannot "
                                 "calibrate one while serving: run `turbospec calibrate-margin --model ...` first (one "
                                 "process; the threshold is shared by every split) or start with --margin-threshold")
            if calibrate:
                _ = self.exact.threshold  # calibrated on first use
            elif not self.exact.has_threshold():
                raise ValueError("margin-gate needs a calibrated threshold for this model: run `turbospec "
                                 "calibrate-margin --model ...` or start the server with --margin-threshold")
        return value

    def request_acceptance(self, value: str | None, determinism: str | None = None) -> str:
        """The acceptance policy a request runs with: the engine's (speculative_config "acceptance"), or one it
        asks for. Lossy policies need speculation and cannot be combined with a deterministic mode."""
        if value is None:
            return self.spec.acceptance if self.spec and not determinism else "exact"
        if value != "exact" and self.spec is None:
            raise ValueError(f"acceptance {value!r} needs speculative decoding, which this engine does not run "
                             f"(only 'exact' is accepted here)")
        check_policy(value, self.spec.method if self.spec else None)
        if determinism and value not in LOSSLESS_POLICIES:
            raise ValueError(f"acceptance {value!r} is lossy and this request is deterministic ({determinism}): "
                             f"its output must be the model's own")
        return value

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None or req.is_finished:
            return None
        self.scheduler.finish(req, "abort")
        self._release(req)
        return self._output(req, [])

    def fail_request(self, request_id: str, message: str) -> RequestOutput | None:
        """Finish one request with finish_reason "error" (its KV is freed); the others carry on."""
        req = self.requests.pop(request_id, None)
        if req is None or req.is_finished:
            return None
        self.scheduler.finish(req, "error")
        req.error = message
        self._release(req)
        out = self._output(req, [])
        out.error = message
        return out

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- speculation policy -------------------------------------------------------------------------------

    def set_speculation(self, value: int | str) -> None:
        """0 turns speculation off, k >= 1 fixes the draft length, "auto" hands it to the goodput controller."""
        if value != "auto" and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"speculation must be 0 (off), an integer k >= 1 or \"auto\", got {value!r}")
        if value != 0 and self.proposer is None:
            raise ValueError("this engine has no speculative_config: only 0 (no speculation) is possible")
        if value == "auto":
            self._ensure_controller(progress=True)
        self.spec_mode = value

    def _ensure_controller(self, progress: bool) -> None:
        if self.controller is None:
            from .tuning.profiler import load_or_profile  # imports tqdm and the registry: only when used

            assert self.spec is not None
            model = load_or_profile(self, progress)
            assert self.proposer is not None
            estimator = make_estimator(self.spec.acceptance_estimator, ranks_nodes=self.proposer.ranks_nodes)
            self.controller = GoodputController(model, estimator, tree_levels=self.proposer.tree_levels)

    def spec_stats_dict(self) -> dict[str, object]:
        out: dict[str, object] = self.spec_stats.as_dict()
        out["policy"] = self.spec_mode
        if self.spec is not None:
            out["acceptance"] = self.spec.acceptance
            out["adaptive_thresholds"] = self.adaptive_thresholds.as_dict()
        if self.controller is not None:
            out["controller"] = self.controller.stats.as_dict()
        return out

    def determinism_stats(self) -> dict[str, float | int]:
        """Verified-mode counters: margin-gate checks (trigger rate) and flips, llm42 windows and rollbacks."""
        return self.exact.stats.as_dict()

    def reset_spec_stats(self) -> None:
        self.spec_stats = SpecDecodingStats()
        if self.controller is not None:
            self.controller.stats = type(self.controller.stats)()
        self.controller_history.clear()

    # --- one step ------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        speculating = self.proposer is not None and self.spec_mode != 0
        self._ngram_drafts = {}
        sched = self.scheduler.schedule(self._spec_budget if speculating else None)
        scheduled = time.perf_counter()  # scheduling (and the controller's choice) is overhead, not drafting
        draft_tokens, drafting, levels = self._propose(sched) if speculating else (0, 0, 0)
        proposed = time.perf_counter()
        if sched.is_empty:
            self.last_step = StepStats(0, 0, len(sched.preempted), proposed - start)
            self.last_sample = None
            return []
        self._exact_ids = {s.request.request_id for s in sched.scheduled if ExactDecoding.runs_exact(s.request, s.start)}
        windows = 0
        for s in sched.scheduled:  # held tokens are this step's drafts, checked on the invariant path
            if s.request.check_tokens:
                s.request.spec_token_ids = s.request.check_tokens[: s.num_spec_tokens] if s.samples else []
                s.request.spec_draft_probs = None
                windows += s.request.determinism == "llm42"
        learn = self.controller is not None and self.spec_mode == "auto"
        # only the controller and the profiler read step samples: plain serving does not build them (before _update)
        features = self._features(sched, draft_tokens, drafting, levels) if learn or self.sample_steps else None
        model_out = self.runner.execute(sched, self._exact_ids)
        forwarded = time.perf_counter()
        if draft_tokens:  # AdaSD weighs a draft step against this (verification/lossy.py)
            self.adaptive_thresholds.observe_costs(target_step_s=forwarded - proposed)
        outputs = self._update(sched, model_out)
        end = time.perf_counter()
        self.last_step = StepStats(len(sched.scheduled), sched.num_batched_tokens, len(sched.preempted), end - start)
        if self.exact.fixed_window is None:
            self.exact.observe_step(end - start, windows)
        self.last_sample = None
        if features is not None:
            # n-gram lookups are bookkeeping-sized: they count as overhead, not as a draft model
            draft_s = proposed - scheduled if draft_tokens or drafting else 0.0
            self.last_sample = StepSample(features, forwarded - proposed, draft_s,
                                          (end - start) - (forwarded - proposed) - draft_s)
            if learn:
                self._learn_step_time(self.last_sample)
        return outputs

    @staticmethod
    def _features(sched: SchedulerOutput, draft_tokens: int, drafting: int, levels: int) -> StepFeatures:
        f = StepFeatures(draft_tokens=draft_tokens, drafting_requests=drafting, draft_levels=levels)
        for s in sched.scheduled:
            f.add(s.start, s.num_new_tokens, len(s.request.spec_token_ids[: s.num_spec_tokens]) if s.samples else 0)
        f.gathered_slots()  # planned now: the sample is logged and serialised as it is
        return f

    def _learn_step_time(self, sample: StepSample) -> None:
        assert self.controller is not None
        model = self.controller.model
        predicted = model.predict(sample.features)
        self.controller.record_step(predicted, sample.total_s)
        model.observe(sample)
        if self.record_history:
            choice = self.controller.last_choice
            self.controller_history.append({
                "time": time.monotonic(), "num_decoding": len(choice.ks) if choice else 0,
                "mean_k": sum(choice.ks) / len(choice.ks) if choice and choice.ks else 0.0,
                "acceptance": self.controller.stats.last_acceptance,
                "predicted_s": predicted, "measured_s": sample.total_s,
            })

    def _spec_budget(self, decoding: list[Request]) -> dict[str, int]:
        """Draft tokens each decoding request may verify this step: fixed k, or the goodput controller's."""
        assert self.spec is not None
        limit = self.spec.k_limit if self.spec_mode == "auto" else int(self.spec_mode)
        # never draft past max_tokens: the last token is always the verifier's own
        caps = [max(0, min(limit if r.speculate else 0, r.params.max_tokens - r.num_output_tokens - 1))
                for r in decoding]
        if self.spec_mode != "auto":
            return {r.request_id: k for r, k in zip(decoding, caps)}
        assert self.controller is not None
        if isinstance(self.proposer, NgramProposer):  # proposals are free: choose how many to verify
            self._ngram_drafts = {r.request_id: self.proposer.propose_one(r.all_token_ids, k) if k else []
                                  for r, k in zip(decoding, caps)}
            caps = [len(self._ngram_drafts[r.request_id]) for r in decoding]
        base, spare_tokens = self._base_features(decoding)
        caps = self._guard_kv(decoding, caps)
        candidates = [Candidate(r.request_id, k, r.num_tokens, self.proposer.catch_up_tokens(r),
                                r.params.max_tokens - r.num_output_tokens) for r, k in zip(decoding, caps)]
        ks = self._cold_start_probe(candidates, self.controller.choose(candidates, base, spare_tokens))
        if self._confidence_stop():
            ks = widen_lone_request(ks, caps, spare_tokens)
        return {r.request_id: k for r, k in zip(decoding, ks)}

    def _confidence_stop(self) -> bool:
        """In auto mode a draft model's drafts end where it turns unsure (SpeculativeConfig.draft_stop)."""
        return (self.spec_mode == "auto" and self.spec is not None and self.spec.confidence_stop
                and isinstance(self.proposer, DraftModelProposer))

    def _cold_start_probe(self, candidates: list[Candidate], ks: list[int]) -> list[int]:
        """Draft once for a draft model the controller has never seen verified. Its acceptance is then only the
        prior (0.6), at which a draft costing most of a target step never looks worth starting, and without
        drafting the real acceptance is never measured (the 0.5B draft for qwen2.5-coder-1.5b accepts ~0.9 on
        HumanEval, and `auto` chose k = 0 on every step before this). One step at the cap, for the request
        cheapest to start (least catch-up); once it is verified the estimator knows the pair and the controller
        decides (a probe cut short, e.g. by an abort, is simply tried again)."""
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

    def _propose(self, sched: SchedulerOutput) -> tuple[int, int, int]:
        """Fill each scheduled request's drafts; returns the tokens a draft model processed (0 for n-gram), the
        requests draft heads drafted for, and the levels their trees grew (a draft model's cost is in its tokens
        and forwards, so it counts neither)."""
        assert self.proposer is not None
        spec = [s for s in sched.scheduled if s.num_spec_tokens > 0 and not s.request.check_tokens]
        for s in sched.scheduled:
            s.request.spec_token_ids = []
        if not spec:
            return 0, 0, 0
        if self.spec_mode == "auto" and isinstance(self.proposer, NgramProposer):
            for s in spec:
                s.request.spec_token_ids = self._ngram_drafts.get(s.request.request_id, [])[: s.num_spec_tokens]
            return 0, 0, 0
        # a draft model runs over the tokens it has not seen, then one token per further draft step (counted once
        # drafted: a confidence stop may end a draft before its k)
        catch_up = [self.proposer.catch_up_tokens(s.request) for s in spec] if self.proposer.runs_model else []
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.confidence_stop = self._confidence_stop()
        drafts = self.proposer.propose([s.request for s in spec], [s.num_spec_tokens for s in spec])
        draft_tokens = sum(c + max(len(d.tokens), 1) - 1 for c, d in zip(catch_up, drafts))
        for s, d in zip(spec, drafts):
            s.request.spec_token_ids = d.tokens
            # a chain verifies on the linear path unless the proposer reads the tree's rows (lookahead)
            keep = d.tree is not None and (not d.tree.is_chain or self.proposer.observes_trees)
            s.request.spec_tree = d.tree if keep else None
            s.request.spec_draft_probs = d.probs
            s.request.spec_draft_soft, s.request.spec_draft_entropy = d.soft_probs, d.entropies or []
        drafting = sum(1 for d in drafts if d.tokens) if self.proposer.needs_hidden else 0
        levels = self.proposer.draft_levels(max(s.num_spec_tokens for s in spec)) if drafting else 0
        return draft_tokens, drafting, levels

    def _update(self, sched: SchedulerOutput, out: ModelOutput) -> list[RequestOutput]:
        checking = {s.request.request_id for s in sched.scheduled if s.request.check_tokens}  # before _verify
        self._tree_paths, self._emit_rows = {}, {}
        verified = self._verify(sched, out)
        outputs: list[RequestOutput] = []
        now = time.monotonic()
        for i, s in enumerate(sched.scheduled):
            req = s.request
            result = verified.get(req.request_id)
            num_drafts = 0 if req.request_id in checking else len(req.spec_token_ids)  # held tokens are no drafts
            accepted = result[1] if result else 0
            decoding = s.samples and s.num_new_tokens == 1  # before appending: that moves the end
            if req.request_id in self._tree_paths:  # the accepted branch's K/V moves down to its final positions
                assert req.spec_tree is not None
                src, dst = compaction(req.spec_tree, self._tree_paths[req.request_id], s.start + s.num_new_tokens - 1)
                self.runner.move_kv(req.request_id, src, dst)
            if result and self.proposer is not None and self.proposer.needs_hidden and req.determinism != "llm42":
                # heads and EAGLE draft from the hidden states of the rows that chose this step's tokens
                emitted = [t for t, _ in result[0]]
                offsets = self._emit_rows.get(req.request_id, list(range(len(emitted))))[: len(emitted)]
                if offsets:
                    source = out.features if out.features is not None else out.hidden
                    rows = torch.tensor([out.row_start[i] + o for o in offsets], device=source.device)
                    self.proposer.observe_hidden(req, source[rows], emitted, req.num_tokens + len(emitted))
            if result:  # append first: committing hashes the accepted tokens into the prefix cache
                try:
                    exact = req.request_id in self._exact_ids
                    if req.determinism == "llm42" and (req.unverified_token_ids or not exact):
                        self.exact.hold(req, [t for t, _ in result[0]])  # output once its window is checked
                    elif result[0]:  # (margin-gate may hold back every token of this step)
                        outputs.append(self._append(req, result[0], now))
                except Exception as exc:  # e.g. the tokenizer fails on this request's text: fail it alone
                    log.exception("request %s failed while appending tokens", req.request_id)
                    failed = self.fail_request(req.request_id, f"{type(exc).__name__}: {exc}")
                    if failed is not None:
                        outputs.append(failed)
                    req.spec_token_ids, req.spec_draft_probs, req.spec_tree = [], None, None
                    continue
            if req.request_id in self._exact_ids and (s.start < len(req.prompt_token_ids) or s.start <= req.num_exact_kv):
                req.num_exact_kv = s.start + s.num_new_tokens + accepted  # before commit: it reads this
            self.scheduler.commit(s, accepted)
            self.exact.rewind(req)
            if decoding:
                self.spec_stats.observe_choice(num_drafts)
            if self.proposer and num_drafts:
                tree = req.spec_tree
                self.spec_stats.observe(num_drafts, accepted, None if tree is None else max(tree.depth))
                if self.verify_trace is not None:
                    self.verify_trace.append((req.request_id, num_drafts, accepted))
                if not req.is_finished:
                    self.proposer.on_verified(req, accepted)
            if self.controller is not None and self.spec_mode == "auto" and result and req.request_id not in checking:
                self._observe_acceptance(req, num_drafts, accepted, result[0])
            req.spec_token_ids, req.spec_draft_probs, req.spec_draft_soft, req.spec_draft_entropy = [], None, None, []
            req.spec_tree = None
        if self.controller is not None:
            self.controller.end_step()
        return outputs

    def _observe_acceptance(self, req: Request, num_drafts: int, accepted: int,
                            emitted: list[tuple[int, dict[int, Logprob] | None]]) -> None:
        """Feed the controller's estimator. An n-gram proposal is free, so the position after the last verified
        draft is observed too, even at k = 0: did the lookup's next token match what the target emitted?
        Without this a request that is never given drafts could never show that it deserves some."""
        assert self.controller is not None
        lookup = self._ngram_drafts.get(req.request_id, [])
        if accepted == num_drafts and len(lookup) > num_drafts and len(emitted) > num_drafts:
            if self.synthetic_acceptance is not None:
                hit = self._synthetic_rng.random() < self.synthetic_acceptance
            else:
                hit = lookup[num_drafts] == emitted[num_drafts][0]
            num_drafts, accepted = num_drafts + 1, accepted + hit
        if self.proposer is not None and self.proposer.ranks_nodes and req.accepts_trees:
            # the drafts were the proposer's most confident nodes: a tree, or a chain when they formed one (its
            # ranks are its depths); requests held to chains are a chain estimator's (NodeRank.observe)
            tree, path = req.spec_tree, self._tree_paths.get(req.request_id)
            ranked = tree is not None and tree.ranks is not None and path is not None
            self.controller.observe_nodes(req.request_id, num_drafts,
                                          [tree.ranks[n] for n in path] if ranked else list(range(accepted)))
        elif num_drafts:
            self.controller.observe(req.request_id, num_drafts, accepted)

    def _verify(self, sched: SchedulerOutput, out: ModelOutput
                ) -> dict[str, tuple[list[tuple[int, dict[int, Logprob] | None]], int]]:
        """Sample or verify every request that reached the end of its known tokens.

        A request with k drafts owns k + 1 logit rows; with k = 0 this is plain sampling of one row. Requests in
        a deterministic mode sample by position (determinism/exact.py), the others by their generators."""
        exact: list[PickedRows] = []
        picked: list[tuple[Request, int, int]] = []
        trees: list[tuple[Request, int, int]] = []
        for i, s in enumerate(sched.scheduled):
            if out.row_start[i] < 0:
                continue
            if s.request.spec_tree is not None and out.num_rows[i] > 1 and not s.request.check_tokens:
                trees.append((s.request, out.row_start[i], out.num_rows[i]))
            elif s.request.determinism:
                invariant = self.runner.batch_invariant or s.request.request_id in self._exact_ids
                exact.append(PickedRows(s.request, out.row_start[i], out.num_rows[i], s.start + s.num_new_tokens,
                                        invariant))
            else:
                picked.append((s.request, out.row_start[i], out.num_rows[i]))
        result = self._verify_sampled(picked, out.logits) if picked else {}
        if exact:
            result.update(self.exact.verify(exact, out.logits))
        if trees:
            result.update(self._verify_trees(trees, out.logits))
        return result

    def _verify_trees(self, trees: list[tuple[Request, int, int]], logits: torch.Tensor
                      ) -> dict[str, tuple[list[tuple[int, dict[int, Logprob] | None]], int]]:
        """Exact tree acceptance (verification/tree.py) for requests whose drafts branch; records each accepted path
        (for K/V compaction) and the row that produced the last emitted token (for heads)."""
        result: dict[str, tuple[list[tuple[int, dict[int, Logprob] | None]], int]] = {}
        for req, row, n in trees:
            assert req.spec_tree is not None and len(req.spec_tree) == n - 1
            rows = logits[row: row + n]
            argmax = rows.argmax(-1).tolist()
            if self.proposer is not None:  # lookahead reads its Jacobi window's next guesses here
                self.proposer.observe_tree(req, req.spec_tree, argmax)
            if req.generator is None:
                path, emitted = verify_tree_greedy(req.spec_tree, argmax)
            else:
                batch = SamplingBatch.build([req.params] * n, [req.generator] * n, rows.shape[-1], device=rows.device)
                path, emitted = verify_tree_sampled(req.spec_tree, processed_probs(rows, batch), req.generator)
            emit_rows = [0] + [node + 1 for node in path]  # the row each emitted token was chosen from
            logprobs = self._logprobs([req] * len(emitted), rows[torch.tensor(emit_rows, device=rows.device)],
                                      torch.tensor(emitted, device=rows.device))
            self._tree_paths[req.request_id] = path
            self._emit_rows[req.request_id] = emit_rows
            result[req.request_id] = (list(zip(emitted, logprobs)), len(path))
        return result

    def _verify_sampled(self, picked: list[tuple[Request, int, int]], all_logits: torch.Tensor
                        ) -> dict[str, tuple[list[tuple[int, dict[int, Logprob] | None]], int]]:
        """Rejection sampling (or plain sampling) with each request's own generator, over its rows."""
        index = [row + j for _, row, n in picked for j in range(n)]
        logits = all_logits if len(index) == all_logits.shape[0] else all_logits[torch.tensor(index, device=all_logits.device)]
        starts = [0]
        for _, _, n in picked[:-1]:
            starts.append(starts[-1] + n)
        picked = [(r, start, n) for (r, _, n), start in zip(picked, starts)]
        row_params = [r.params for r, _, n in picked for _ in range(n)]
        row_gens = [r.generator for r, _, n in picked for _ in range(n)]
        batch = SamplingBatch.build(row_params, row_gens, logits.shape[-1], device=logits.device)
        probs = processed_probs(logits, batch)
        reqs = [r for r, _, _ in picked]
        if all(n == 1 for _, _, n in picked):  # nobody speculated: plain sampling, one row each
            emitted = [[t] for t in sample(probs, batch).tolist()]
            accepted = [0] * len(reqs)
        elif self.synthetic_acceptance is not None:
            emitted, accepted = synthetic_verify(probs, [row for _, row, _ in picked],
                                                 [r.spec_token_ids[: n - 1] for r, _, n in picked],
                                                 self.synthetic_acceptance, self._synthetic_rng)
        else:
            drafts = [r.spec_token_ids[: n - 1] for r, _, n in picked]
            starts = [row for _, row, _ in picked]
            relaxed, distances = self._relaxation(picked, drafts, logits, probs)
            result = verify(probs, starts, drafts,
                            [None if r.spec_draft_probs is None else r.spec_draft_probs[: n - 1] for r, _, n in picked],
                            [r.generator for r in reqs], relaxed)
            emitted, accepted = result.tokens, result.num_accepted
            if relaxed is not None or any(r.spec_draft_entropy for r in reqs):  # (a stop rule read entropies)
                self._observe_relaxation(reqs, drafts, accepted, result.exact_accepted, distances)
        if self.logit_trace is not None:  # calibration: each request's top scores at the token it sampled
            for r, row, n in picked:
                top = logits[row + n - 1].float().topk(COMPETITORS + 1)
                self.logit_trace.setdefault(r.request_id, []).append((top.indices, top.values))
        row_reqs = [r for r, toks in zip(reqs, emitted) for _ in toks]
        logprobs: list[dict[int, Logprob] | None] = [None] * len(row_reqs)
        if any(r.params.logprobs is not None for r in reqs):
            rows = [row + j for (_, row, _), toks in zip(picked, emitted) for j in range(len(toks))]
            flat = [t for toks in emitted for t in toks]
            logprobs = self._logprobs(row_reqs, logits[torch.tensor(rows, device=logits.device)],
                                      torch.tensor(flat, device=logits.device))
        result_map: dict[str, tuple[list[tuple[int, dict[int, Logprob] | None]], int]] = {}
        pos = 0
        for req, toks, acc in zip(reqs, emitted, accepted):
            result_map[req.request_id] = (list(zip(toks, logprobs[pos: pos + len(toks)])), acc)
            pos += len(toks)
        return result_map

    def _relaxation(self, picked: list[tuple[Request, int, int]], drafts: list[list[int]], logits: torch.Tensor,
                    probs: torch.Tensor) -> tuple[torch.Tensor | None, list[float]]:
        """Positions lossy acceptance policies keep whatever the exact rule says (verification/lossy.py), or None
        when no request of this step uses one."""
        policies = [r.acceptance for r, _, _ in picked]
        if all(p in LOSSLESS_POLICIES for p, d in zip(policies, drafts) if d):
            return None, []
        greedy = torch.tensor([r.generator is None for r, _, n in picked for _ in range(n)], device=logits.device)
        criterion = torch.where(greedy.unsqueeze(1), logits.float().softmax(dim=-1), probs)
        assert self.spec is not None
        return relax_drafts(policies, [row for _, row, _ in picked], drafts, criterion,
                            [r.spec_draft_soft for r, _, _ in picked], self.adaptive_thresholds,
                            self.spec.typical_epsilon, self.spec.typical_delta)

    def _observe_relaxation(self, reqs: list[Request], drafts: list[list[int]], accepted: list[int],
                            exact: list[bool], distances: list[float]) -> None:
        """Count relaxed tokens and feed AdaSD's thresholds from the positions verification reached."""
        pos = 0
        for req, toks, n_acc in zip(reqs, drafts, accepted):
            k = len(toks)
            reached = min(n_acc + 1, k)  # accepted drafts, plus the first rejected one
            flags = exact[pos: pos + k]
            relaxed = sum(1 for ok in flags[:n_acc] if not ok)
            req.relaxed_tokens += relaxed
            self.spec_stats.num_relaxed_tokens += relaxed
            if req.acceptance in RELAXES_JS:
                self.adaptive_thresholds.observe_verification(distances[pos: pos + reached], flags[:reached])
            if req.spec_draft_entropy:  # AdaSD's rule or the confidence stop read these: both learn from them
                self.adaptive_thresholds.observe_generation(req.spec_draft_entropy[:reached],
                                                            [j < n_acc for j in range(reached)])
            pos += k

    @staticmethod
    def _logprobs(reqs: list[Request], logits: torch.Tensor, tokens: torch.Tensor) -> list[dict[int, Logprob] | None]:
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

    def _append(self, req: Request, tokens: list[tuple[int, dict[int, Logprob] | None]], now: float) -> RequestOutput:
        """Append sampled tokens, checking stop conditions after each; returns the request's delta output."""
        if req.first_token_time is None:
            req.first_token_time = now
        added: list[int] = []
        for tok, lp in tokens:
            req.output_token_ids.append(tok)
            added.append(tok)
            if lp is not None and req.logprobs is not None:
                req.logprobs.append(lp)
                req.cumulative_logprob += lp[tok].logprob
            self._check_stop_token(req, tok)
            if req.params.stop:  # token by token, so no token after a stop string is kept (speculative == plain)
                self._check_stop_strings(req, req.detokenizer.add(self._text_ids(req, [tok])))
            if req.is_finished:
                break
        if not req.params.stop:
            req.detokenizer.add(self._text_ids(req, added))
        if req.is_finished:
            self._release(req)
        return self._output(req, added)

    @staticmethod
    def _text_ids(req: Request, ids: list[int]) -> list[int]:
        """The ids whose text is shown: never EOS, and a stop token id only if the user asked for it (as vLLM)."""
        stop_tok = req.stop_reason if isinstance(req.stop_reason, int) and not req.params.include_stop_str_in_output else None
        return [t for t in ids if t not in req.eos_token_ids and t != stop_tok]

    def _release(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        if self.proposer:
            self.proposer.free(req.request_id)
        if self.controller is not None:
            self.controller.free(req.request_id)

    def _check_stop_token(self, req: Request, tok: int) -> bool:
        p = req.params
        reason: tuple[str, str | int | None] | None = None
        if tok in req.eos_token_ids:
            reason = ("stop", None)
        elif tok in p.stop_token_ids:
            reason = ("stop", tok)
        elif len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            reason = ("length", None)
        if reason:
            self.scheduler.finish(req, *reason)
        return reason is not None

    def _check_stop_strings(self, req: Request, delta: str) -> None:
        """Cut the text at the first stop string that the new delta completes, and finish the request."""
        if not req.params.stop or not delta:
            return
        text = req.detokenizer.text
        search_from = max(0, len(text) - len(delta) - max(len(s) for s in req.params.stop) + 1)
        hits = [(text.find(s, search_from), s) for s in req.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return
        idx, stop = min(hits)
        req.detokenizer.text = text[:idx + len(stop) if req.params.include_stop_str_in_output else idx]
        if not req.is_finished:
            self.scheduler.finish(req, "stop", stop)
        else:
            req.finish_reason, req.stop_reason = "stop", stop

    def _output(self, req: Request, added: list[int]) -> RequestOutput:
        text = req.detokenizer.text
        if req.is_finished and not isinstance(req.stop_reason, str):
            # the windowed decode can hold back an incomplete character at the very end; settle it now
            text = self.tokenizer.decode(self._text_ids(req, req.output_token_ids), req.params.skip_special_tokens)
        # While a stop string could still complete, its possible start is held back: a stream must never send
        # text that the stop string later cuts away.
        hold = 0 if req.is_finished or not req.params.stop else max(len(s) for s in req.params.stop) - 1
        end = max(req.num_sent_chars, len(text) - hold)
        delta, req.num_sent_chars = text[req.num_sent_chars:end], end
        completion = CompletionOutput(
            index=0, text=text, token_ids=list(req.output_token_ids),
            cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
            logprobs=req.logprobs, finish_reason=req.finish_reason, stop_reason=req.stop_reason,
        )
        metrics = RequestMetrics(req.arrival_time, req.first_token_time,
                                 time.monotonic() if req.is_finished else None, req.num_cached_tokens,
                                 req.num_preemptions, req.first_scheduled_time)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion], req.is_finished,
                             metrics, delta, added, acceptance=req.acceptance, relaxed_tokens=req.relaxed_tokens)
