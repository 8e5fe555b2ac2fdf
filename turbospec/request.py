"""A request's life inside the engine: its tokens, how many have KV computed, and why it finished."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .draft import Draft
from .models.tokenizer import IncrementalDetokenizer
from .outputs import Logprob
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .structured.matcher import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens (prompt + output) whose KV is in the cache and final. The last sampled token never is:
    # its KV is computed by the next step that feeds it.
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at the last admission
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None
    error: str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    first_token_time: float | None = None
    num_sent_chars: int = 0  # output text already handed out as deltas
    # [start, end) character spans of the output text that accepted drafts produced and no delta has sent yet
    drafted_chars: list[tuple[int, int]] = field(default_factory=list)
    first_scheduled_time: float | None = None  # when it first left the waiting queue (queue time ends)
    speculate: bool = True  # False: never given draft tokens (a per-request opt-out)
    # None, or how this request is made deterministic (config.DETERMINISTIC_MODES); see determinism/
    determinism: str | None = None
    # Deterministic modes sample position n with noise seeded by (noise_seed, n), so a token never depends on
    # how many tokens one step produced (speculation, replays)
    noise_seed: int = 0
    # llm42: tokens decoded on the fast path and not yet replayed by the invariant verifier. They are part of
    # the sequence the model sees, but not of the output: no text, log-probs or stop checks until verified.
    unverified_token_ids: list[int] = field(default_factory=list)
    # llm42 / margin-gate: held tokens that the next step checks on the invariant path, fed as its drafts
    check_tokens: list[int] = field(default_factory=list)
    # margin-gate: leading positions whose KV the invariant path computed (prefill, and each check)
    num_exact_kv: int = 0
    # What a proposer drafted (or, in the verified modes, the held tokens to check) for the next step to verify
    draft: Draft = field(default_factory=lambda: Draft([]))
    # Acceptance policy (verification/policies.py): "exact" (lossless) unless the request or the engine asks for another.
    acceptance: str = "exact"
    relaxed_tokens: int = 0  # draft tokens kept only because a lossy policy relaxed the exact rule
    # structured outputs: the grammar its tokens must match, advanced by every committed token (structured/)
    grammar: GrammarState | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids + self.unverified_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + len(self.unverified_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens generated so far, verified or not (what max_tokens counts)."""
        return len(self.output_token_ids) + len(self.unverified_token_ids) + len(self.check_tokens)

    @property
    def num_cacheable_tokens(self) -> int:
        """Leading tokens whose KV may enter the prefix cache: all computed ones, except in the verified
        modes, where only KV computed by the invariant path is shared (llm42: everything before the last
        verified token; margin-gate: up to its last re-check)."""
        if self.determinism == "llm42":
            return min(self.num_computed_tokens, len(self.prompt_token_ids) + len(self.output_token_ids) - 1)
        if self.determinism == "margin-gate":
            return min(self.num_computed_tokens, self.num_exact_kv)
        return self.num_computed_tokens

    @property
    def cache_salt(self) -> str | None:
        """Prefix-cache namespace: verified-mode requests only share KV computed by the invariant path."""
        return "invariant" if self.determinism in ("llm42", "margin-gate") else None

    @property
    def samples_by_position(self) -> bool:
        """Whether the token at position n is sampled with noise keyed by (noise_seed, n), and drafts are accepted
        by equality with that sample: deterministic modes, and seeded sampled requests under exact acceptance.
        The tokens then depend on neither k nor the proposer (nor, for a seed, on the batch's generators)."""
        if self.determinism is not None:
            return True
        return self.params.seed is not None and not self.params.greedy and self.acceptance == "exact"

    @property
    def accepts_trees(self) -> bool:
        """Whether a request's drafts may branch: exact acceptance and no positional sampling. Proposers give the
        others their most probable path. Why not the deterministic modes: the invariant attention sums keys in
        fixed blocks, and a node's ancestors sit at other offsets in a tree than in the final sequence (decoys in
        between), so its rows would not be bitwise those of plain decoding; positional sampling and held-token
        checks also verify chains only."""
        return self.acceptance == "exact" and not self.samples_by_position

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        """Still computing known tokens: the next step yields no sampled token unless it reaches the end."""
        return self.num_computed_tokens < self.num_tokens - 1

    def finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
