"""Speculative decoding statistics, cumulative over the engine's life and per step (vLLM-like names)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class SpecDecodingStats:
    num_drafts: int = 0  # request-steps that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # per draft position (per depth for token trees): verifications that offered / accepted a token there
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)
    # how often each draft length was verified, over every decoding request-step (k = 0 included)
    k_histogram: list[int] = field(default_factory=list)
    # draft tokens kept only because a lossy acceptance policy relaxed the exact rule (verification/lossy.py)
    num_relaxed_tokens: int = 0
    # structured outputs (structured/constraints.py): drafts the grammar cut short and the tokens cut, tokens the
    # grammar forced (appended without sampling), and the time spent in grammars (masks, draft checks, advancing)
    num_grammar_cuts: int = 0
    num_grammar_cut_tokens: int = 0
    num_forced_tokens: int = 0
    grammar_seconds: float = 0.0

    def observe_choice(self, k: int) -> None:
        if k >= len(self.k_histogram):
            self.k_histogram += [0] * (k + 1 - len(self.k_histogram))
        self.k_histogram[k] += 1

    @property
    def mean_k(self) -> float:
        n = sum(self.k_histogram)
        return sum(k * c for k, c in enumerate(self.k_histogram)) / n if n else 0.0

    def observe(self, num_draft: int, num_accepted: int, depth: int | None = None) -> None:
        """One request's verification: num_draft proposed tokens, the first num_accepted of them accepted. For a
        token tree, num_draft is its node count (what verification paid for), num_accepted the accepted path's
        length and `depth` the tree's depth: the per-position counts are then per depth (position d offered when
        the tree reached depth d + 1, accepted when the path did), so acceptance_by_position reads the same for
        chains and trees."""
        if num_draft == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        positions = num_draft if depth is None else depth
        grow = positions - len(self.num_draft_tokens_per_pos)
        if grow > 0:
            self.num_draft_tokens_per_pos += [0] * grow
            self.num_accepted_tokens_per_pos += [0] * grow
        for pos in range(positions):
            self.num_draft_tokens_per_pos[pos] += 1
            self.num_accepted_tokens_per_pos[pos] += pos < num_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """tau: tokens emitted per verifying request-step, counting the bonus / correction token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["acceptance_rate"] = self.acceptance_rate
        out["mean_accepted_length"] = self.mean_accepted_length
        out["mean_k"] = self.mean_k
        out["acceptance_by_position"] = [
            a / d if d else 0.0 for a, d in zip(self.num_accepted_tokens_per_pos, self.num_draft_tokens_per_pos)
        ]
        return out
