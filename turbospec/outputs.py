"""What generate() and the engine hand back, shaped like vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

from .verification.policies import LOSSLESS_POLICIES


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1-based rank in the model's distribution, when known
    decoded_token: str | None = None


# a step's tokens for one request, each with its log-probs when the request asked for them
Emitted = list[tuple[int, dict[int, Logprob] | None]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # Per generated token: {token_id: Logprob} holding the chosen token and the top-n alternatives.
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    first_scheduled_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # New text / tokens since the previous output of this request (for streaming).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_accepted_drafts: int = 0  # how many of delta_token_ids were drafts the target accepted (speculation)
    delta_proposed_drafts: int = 0  # how many drafts the step verified (0 without speculation)
    # delta_text cut into runs, True where accepted drafts produced the characters: a character split across
    # tokens belongs to the token that completes it
    delta_text_runs: list[tuple[str, bool]] = field(default_factory=list)
    error: str | None = None
    # The acceptance policy the request ran with (verification/policies.py) and the draft tokens it kept only because
    # that policy relaxed the exact rule. Anything but "exact" / "adasd-generation" is lossy.
    acceptance: str = "exact"
    relaxed_tokens: int = 0

    @property
    def lossless(self) -> bool:
        return self.acceptance in LOSSLESS_POLICIES
