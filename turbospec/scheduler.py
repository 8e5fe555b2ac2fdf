"""Token-budget scheduling with chunked prefill, prefix caching and preemption by recompute.

There is no prefill phase and decode phase: every request has tokens whose KV is computed and tokens it
still needs computed. A step hands out up to ``max_num_batched_tokens`` of those, running requests first
(in arrival order), then waiting ones (FCFS), and each running request may additionally verify k draft
tokens. When the KV cache runs out, the most recently admitted running request is preempted: its blocks
are freed and it is recomputed later from its prompt and output so far, so nothing is lost.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .draft import Draft
from .kv.block_manager import BlockManager
from .request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    start: int  # position of the first token computed this step
    num_new_tokens: int  # known tokens computed this step (a prefill chunk, or 1 for a decode)
    num_spec_tokens: int = 0  # draft slots reserved after them for verification

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens, so the model's output is sampled."""
        return self.start + self.num_new_tokens >= self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens + s.num_spec_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


# Given the running requests that will decode this step, how many draft tokens each may verify.
SpecBudget = Callable[[list[Request]], dict[str, int]]


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int) -> None:
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # --- queues ----------------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: str, stop_reason: str | int | None = None) -> None:
        """Finish a request (stop, length, abort, error) wherever it is, and free its KV blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if self.blocks.has_seq(request.request_id):
            self.blocks.free(request.request_id)
        request.finish(reason, stop_reason)

    # --- one step --------------------------------------------------------------------------------------

    def schedule(self, spec_budget: SpecBudget | None = None) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        decoding = [r for r in self.running if not r.is_prefilling]
        spec = spec_budget(decoding) if spec_budget and decoding else {}

        # Running requests first: their blocks are already paid for, and finishing them frees memory.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            # held tokens of a deterministic request are checked as drafts (determinism/exact.py)
            want = max(spec.get(req.request_id, 0), len(req.check_tokens))
            k = min(want, budget - num_new, self.max_model_len - req.num_tokens)
            k = max(k, 0) if num_new + req.num_computed_tokens >= req.num_tokens else 0
            needed = req.num_computed_tokens + num_new + k - self.blocks.num_slots(req.request_id)
            while needed > 0 and not self.blocks.can_append(req.request_id, needed):
                if k > 0:  # drop speculation before evicting anyone
                    needed -= k
                    k = 0
                    continue
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # it preempted itself: nothing else fits either
            if needed > 0:
                self.blocks.append_slots(req.request_id, needed)
            out.scheduled.append(ScheduledRequest(req, req.num_computed_tokens, num_new, k))
            budget -= num_new + k
            i += 1

        # Then waiting requests, unless memory was short enough to preempt this step.
        while self.waiting and not out.preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            tokens = req.all_token_ids
            cached = self.blocks.num_cached_prefix_tokens(tokens, req.cache_salt)
            num_new = min(len(tokens) - cached, budget)
            if not self.blocks.can_allocate(tokens, cached + num_new, req.cache_salt):
                break
            req.num_cached_tokens = self.blocks.allocate(req.request_id, tokens, cached + num_new, req.cache_salt)
            req.num_computed_tokens = req.num_cached_tokens
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, req.num_computed_tokens, num_new))
            budget -= num_new
        return out

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.blocks.free(req.request_id)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.draft = Draft([])
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def commit(self, sched: ScheduledRequest, num_accepted_drafts: int = 0) -> None:
        """After the forward: the chunk and the accepted drafts now have final KV; drop rejected slots."""
        req = sched.request
        req.num_computed_tokens = sched.start + sched.num_new_tokens + num_accepted_drafts
        if req.is_finished:
            return
        self.blocks.truncate(req.request_id, req.num_computed_tokens)
        # only shareable KV enters the prefix cache (Request.num_cacheable_tokens); a prefix-cache hit may
        # already cover more than this request may share itself
        cacheable = max(req.num_cacheable_tokens, self.blocks.num_committed(req.request_id))
        self.blocks.commit(req.request_id, req.all_token_ids[:cacheable])
