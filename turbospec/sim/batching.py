"""One replica's scheduler: the engine's token-budget continuous batching (turbospec/scheduler.py), on
token counts instead of tensors.

Each step hands out up to ``max_num_batched_tokens``: running requests first, in admission order (a prefill
chunk, or one decode token plus the draft slots granted to it), then waiting requests FCFS while a seat
(``max_num_seqs``) and budget remain, their prompts chunked to what is left. What it leaves out: the KV cache's
capacity (no preemption: the engine's default cache holds max_num_seqs full-length sequences), and the prefix
cache (prompts are assumed not to share blocks).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .workload import SimRequest


@dataclass
class LiveRequest:
    """A request inside a replica, with the times the metrics need."""

    req: SimRequest
    computed: int = 0  # tokens whose KV is computed
    output: int = 0  # tokens emitted
    first_token_s: float | None = None
    finish_s: float | None = None
    steps: int = 0  # steps that computed something for it

    @property
    def num_tokens(self) -> int:
        return self.req.prompt_tokens + self.output

    @property
    def is_prefilling(self) -> bool:
        # the engine's definition (Request.is_prefilling): the next step samples nothing unless it reaches the end
        return self.computed < self.num_tokens - 1

    @property
    def remaining_output(self) -> int:
        return self.req.output_tokens - self.output

    @property
    def outstanding_tokens(self) -> int:
        """Tokens it still needs computed: what is left of its prompt and of its output."""
        return max(0, self.req.prompt_tokens - self.computed) + self.remaining_output


@dataclass
class Scheduled:
    live: LiveRequest
    start: int  # position of the first token computed this step
    num_new: int  # known tokens computed (a prefill chunk, or 1 for a decode)
    reserved: int = 0  # draft slots granted in the token budget

    @property
    def samples(self) -> bool:
        return self.start + self.num_new >= self.live.num_tokens


class BatchScheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs and max_num_batched_tokens must be >= 1, got {max_num_seqs} and "
                             f"{max_num_batched_tokens}")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[LiveRequest] = deque()
        self.running: list[LiveRequest] = []

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def decoding(self) -> list[LiveRequest]:
        return [r for r in self.running if not r.is_prefilling]

    def schedule(self, spec: dict[str, int]) -> list[Scheduled]:
        """This step's batch; spec: draft slots wanted per decoding request id."""
        out: list[Scheduled] = []
        budget = self.max_num_batched_tokens
        for live in self.running:
            if budget <= 0:
                break
            num_new = min(live.num_tokens - live.computed, budget)
            k = min(spec.get(live.req.request_id, 0), budget - num_new)
            k = max(k, 0) if live.computed + num_new >= live.num_tokens else 0
            out.append(Scheduled(live, live.computed, num_new, k))
            budget -= num_new + k
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            live = self.waiting.popleft()
            num_new = min(live.num_tokens - live.computed, budget)
            self.running.append(live)
            out.append(Scheduled(live, live.computed, num_new))
            budget -= num_new
        return out

    def finish(self, live: LiveRequest) -> None:
        self.running.remove(live)
