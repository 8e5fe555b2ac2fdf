"""The one place tok/s, tau and the prefill's share are computed from what a run counted.

tau is tokens emitted per verifying request-step, the bonus (or correction) token included: 1 + accepted / drafts
over an engine's spec_stats() counters for a whole set of prompts (harness.run_sets resets them at its start),
never averaged per prompt; the engine's own `mean_accepted_length` is the same formula.
"""

from __future__ import annotations

from typing import Any


def tok_s(tokens: int, seconds: float) -> float | None:
    """Generated tokens over wall time (prefill included, as every row pays it)."""
    return tokens / seconds if seconds else None


def tau(stats: dict[str, Any]) -> float | None:
    """Tokens per verifying request-step: 1 + accepted / drafts; None where nothing was verified."""
    drafts = stats.get("num_drafts", 0)
    return 1 + stats.get("num_accepted_tokens", 0) / drafts if drafts else None


def acceptance_by_position(stats: dict[str, Any]) -> list[float]:
    """Share of the verifications offering a token at each draft position (tree depth) that accepted it."""
    return [a / d if d else 0.0 for a, d in zip(stats.get("num_accepted_tokens_per_pos", []),
                                                stats.get("num_draft_tokens_per_pos", []))]


def prefill_share(first_token_seconds: float, seconds: float) -> float | None:
    """The share of a set's time spent before each prompt's first token (prefill, paid alike by every row)."""
    return first_token_seconds / seconds if seconds else None


def after_first_tok_s(tokens: int, prompts: int, seconds: float, first_token_seconds: float) -> float | None:
    """Tokens per second after each prompt's first token: the decoding that speculation speeds up."""
    rest = seconds - first_token_seconds
    return (tokens - prompts) / rest if rest > 0 else None


def matches(outputs: list[list[int]], reference: list[list[int]]) -> float:
    """The share of outputs equal, token for token, to the reference row's (e.g. plain decoding's)."""
    return sum(a == b for a, b in zip(outputs, reference)) / len(reference) if reference else 0.0
