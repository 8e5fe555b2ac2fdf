"""The step loop: schedule -> run the model -> sample -> update requests. Synchronous and single-threaded;
`LLM` drives it to completion and the server's async engine drives it from a background thread."""

from __future__ import annotations

import logging
import math
import time
import uuid
from dataclasses import dataclass

import torch

from .config import EngineConfig
from .kv.block_manager import BlockManager
from .kv.kv_cache import KVCache
from .models.loader import LoadedModel, load_model, parse_dtype
from .models.tokenizer import IncrementalDetokenizer
from .outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from .request import Request
from .runner import ModelOutput, ModelRunner
from .sampler import SamplingBatch, compute_logprobs, make_generator, processed_probs, sample
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .spec.factory import build_proposer
from .spec.stats import SpecDecodingStats
from .spec.verifier import verify

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
        self.loaded = loaded or load_model(config.model, self.dtype, config.device, progress=progress)
        self.model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        limit = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's context length {limit}")
        self.max_model_len = config.max_model_len or min(limit, CPU_MAX_MODEL_LEN)
        self.kv = KVCache.allocate(self.model_config, self._num_blocks(), config.block_size, self.dtype, config.device)
        self.blocks = BlockManager(self.kv.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len)
        self.runner = ModelRunner(self.loaded.model, self.kv, self.blocks, config.device)
        self.requests: dict[str, Request] = {}
        self.last_step: StepStats | None = None
        self.spec = config.speculative_config
        self.proposer = build_proposer(self.spec, self, progress) if self.spec else None
        self.spec_stats = SpecDecodingStats()

    def _num_blocks(self) -> int:
        c = self.config
        per_block = KVCache.bytes_per_block(self.model_config, c.block_size, self.dtype)
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
                    prompt_token_ids: list[int] | None = None) -> str:
        """Validate and queue one request (one completion; n > 1 is fanned out by the caller)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        text = prompt if isinstance(prompt, str) else None
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                if not prompt:
                    raise ValueError("prompt is empty: give at least one character or token")
                prompt_token_ids = self.tokenizer.encode(prompt)
            else:
                prompt_token_ids = list(prompt)
        self._check_prompt(prompt_token_ids, params)
        rid = request_id or uuid.uuid4().hex
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        req = Request(
            request_id=rid, prompt_token_ids=prompt_token_ids, params=params, prompt=text,
            detokenizer=IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
            generator=None if params.greedy else make_generator(params.seed),
            eos_token_ids=() if params.ignore_eos else self.tokenizer.eos_token_ids,
            logprobs=[] if params.logprobs is not None else None,
        )
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    def _check_prompt(self, ids: list[int], params: SamplingParams) -> None:
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

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None or req.is_finished:
            return None
        self.scheduler.finish(req, "abort")
        self._release(req)
        return self._output(req, [], "")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- one step ------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        sched = self.scheduler.schedule(self._spec_budget if self.proposer else None)
        if self.proposer:
            self._propose(sched)
        if sched.is_empty:
            self.last_step = StepStats(0, 0, len(sched.preempted), time.perf_counter() - start)
            return []
        model_out = self.runner.execute(sched)
        outputs = self._update(sched, model_out)
        self.last_step = StepStats(len(sched.scheduled), sched.num_batched_tokens, len(sched.preempted),
                                   time.perf_counter() - start)
        return outputs

    def _spec_budget(self, decoding: list[Request]) -> dict[str, int]:
        assert self.spec is not None
        # never draft past max_tokens: the last token is always the verifier's own
        return {r.request_id: min(self.spec.num_speculative_tokens, r.params.max_tokens - len(r.output_token_ids) - 1)
                for r in decoding}

    def _propose(self, sched: SchedulerOutput) -> None:
        assert self.proposer is not None
        spec = [s for s in sched.scheduled if s.num_spec_tokens > 0]
        for s in sched.scheduled:
            s.request.spec_token_ids = []
        if not spec:
            return
        drafts = self.proposer.propose([s.request for s in spec], [s.num_spec_tokens for s in spec])
        for s, d in zip(spec, drafts):
            s.request.spec_token_ids = d.tokens
            s.request.spec_draft_probs = d.probs

    def _update(self, sched: SchedulerOutput, out: ModelOutput) -> list[RequestOutput]:
        verified = self._verify(sched, out)
        outputs: list[RequestOutput] = []
        now = time.monotonic()
        for s in sched.scheduled:
            req = s.request
            result = verified.get(req.request_id)
            num_drafts = len(req.spec_token_ids)
            accepted = result[1] if result else 0
            if result:  # append first: committing hashes the accepted tokens into the prefix cache
                outputs.append(self._append(req, result[0], now))
            self.scheduler.commit(s, accepted)
            if self.proposer and num_drafts:
                self.spec_stats.observe(num_drafts, accepted)
                if not req.is_finished:
                    self.proposer.on_verified(req, accepted)
            req.spec_token_ids, req.spec_draft_probs = [], None
        return outputs

    def _verify(self, sched: SchedulerOutput, out: ModelOutput
                ) -> dict[str, tuple[list[tuple[int, dict[int, Logprob] | None]], int]]:
        """Sample or verify every request that reached the end of its known tokens.

        A request with k drafts owns k + 1 logit rows; with k = 0 this is plain sampling of one row."""
        picked = [(s.request, out.row_start[i], out.num_rows[i])
                  for i, s in enumerate(sched.scheduled) if out.row_start[i] >= 0]
        if not picked:
            return {}
        row_params = [r.params for r, _, n in picked for _ in range(n)]
        row_gens = [r.generator for r, _, n in picked for _ in range(n)]
        batch = SamplingBatch.build(row_params, row_gens, out.logits.shape[-1], device=out.logits.device)
        probs = processed_probs(out.logits, batch)
        reqs = [r for r, _, _ in picked]
        if all(n == 1 for _, _, n in picked):  # nobody speculated: plain sampling, one row each
            emitted = [[t] for t in sample(probs, batch).tolist()]
            accepted = [0] * len(reqs)
        else:
            result = verify(probs, [row for _, row, _ in picked], [r.spec_token_ids[: n - 1] for r, _, n in picked],
                            [None if r.spec_draft_probs is None else r.spec_draft_probs[: n - 1] for r, _, n in picked],
                            [r.generator for r in reqs])
            emitted, accepted = result.tokens, result.num_accepted
        row_reqs = [r for r, toks in zip(reqs, emitted) for _ in toks]
        logprobs: list[dict[int, Logprob] | None] = [None] * len(row_reqs)
        if any(r.params.logprobs is not None for r in reqs):
            rows = [row + j for (_, row, _), toks in zip(picked, emitted) for j in range(len(toks))]
            flat = [t for toks in emitted for t in toks]
            logprobs = self._logprobs(row_reqs, out.logits[torch.tensor(rows, device=out.logits.device)],
                                      torch.tensor(flat, device=out.logits.device))
        result_map: dict[str, tuple[list[tuple[int, dict[int, Logprob] | None]], int]] = {}
        pos = 0
        for req, toks, acc in zip(reqs, emitted, accepted):
            result_map[req.request_id] = (list(zip(toks, logprobs[pos: pos + len(toks)])), acc)
            pos += len(toks)
        return result_map

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
            if self._check_stop_token(req, tok):
                break
        delta = req.detokenizer.add(self._text_ids(req, added))
        delta = self._check_stop_strings(req, delta)
        if req.is_finished:
            self._release(req)
        return self._output(req, added, delta)

    @staticmethod
    def _text_ids(req: Request, ids: list[int]) -> list[int]:
        """The ids whose text is shown: never EOS, and a stop token id only if the user asked for it (as vLLM)."""
        stop_tok = req.stop_reason if isinstance(req.stop_reason, int) and not req.params.include_stop_str_in_output else None
        return [t for t in ids if t not in req.eos_token_ids and t != stop_tok]

    def _release(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        if self.proposer:
            self.proposer.free(req.request_id)

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

    def _check_stop_strings(self, req: Request, delta: str) -> str:
        """Cut the text at the first stop string that the new delta completes, and finish the request."""
        if not req.params.stop or not delta:
            return delta
        text = req.detokenizer.text
        search_from = max(0, len(text) - len(delta) - max(len(s) for s in req.params.stop) + 1)
        hits = [(text.find(s, search_from), s) for s in req.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return delta
        idx, stop = min(hits)
        cut = idx + len(stop) if req.params.include_stop_str_in_output else idx
        old_len = len(text) - len(delta)
        req.detokenizer.text = text[:cut]
        if not req.is_finished:
            self.scheduler.finish(req, "stop", stop)
        else:
            req.finish_reason, req.stop_reason = "stop", stop
        return text[old_len:cut] if cut > old_len else ""

    def _output(self, req: Request, added: list[int], delta: str) -> RequestOutput:
        text = req.detokenizer.text
        if req.is_finished and not isinstance(req.stop_reason, str):
            # the windowed decode can hold back an incomplete character at the very end; settle it now
            full = self.tokenizer.decode(self._text_ids(req, req.output_token_ids), req.params.skip_special_tokens)
            delta += full[len(text):] if full.startswith(text) else ""
            text = full
        completion = CompletionOutput(
            index=0, text=text, token_ids=list(req.output_token_ids),
            cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
            logprobs=req.logprobs, finish_reason=req.finish_reason, stop_reason=req.stop_reason,
        )
        metrics = RequestMetrics(req.arrival_time, req.first_token_time,
                                 time.monotonic() if req.is_finished else None, req.num_cached_tokens,
                                 req.num_preemptions)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion], req.is_finished,
                             metrics, delta, added)
