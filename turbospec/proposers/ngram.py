"""Prompt lookup decoding: the n-gram proposer's core.

The proposer guesses the next tokens of a request by finding an earlier place
in its own sequence (prompt + generated so far) that ends with the same n
tokens as the sequence does now, and copying what followed there. It needs no
model, so it runs every engine step for every request; the search is
vectorised with numpy and costs O(L * n_max) array work with only a python loop
over n, never over positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..draft import Draft
from ..request import Request
from .base import Proposer

__all__ = ["NgramProposer", "ngram_propose"]


def ngram_propose(tokens: np.ndarray | Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Propose up to ``k`` draft tokens by matching the sequence's suffix earlier on.

    Finds the longest ``n`` in ``[n_min, n_max]`` such that the last ``n`` tokens
    also occur as a window ending at or before index ``len - 2`` (so at least
    one token follows it; the suffix never matches itself). Among windows of
    that length the most recent one wins. Returns the up to ``k`` tokens that
    follow it; they may run into the suffix itself and stop at the end of the
    sequence.

    Returns ``[]`` when ``k <= 0``, when ``len(tokens) < n_min + 1``, when the
    range is empty, or when no ``n`` in the range matches.

    Raises:
        ValueError: if ``n_min < 1`` (an empty suffix would match anywhere).
    """
    if n_min < 1:
        raise ValueError(f"n_min ({n_min}) must be >= 1")
    arr = np.asarray(tokens, dtype=np.int64)  # no copy if already int64
    length = arr.shape[0]
    if k <= 0 or length < n_min + 1 or n_max < n_min:
        return []
    # A window of n tokens ending at <= length - 2 must start at >= 0.
    n_max = min(n_max, length - 1)

    # End positions of candidate windows: every earlier copy of the last token.
    # Sorted ascending, so the last survivor is always the most recent one.
    cand = np.flatnonzero(arr[:-1] == arr[-1])
    if cand.size == 0:
        return []
    matched = 1
    # Extend all candidates backwards one token at a time; each round keeps
    # only those that still match, so after round i the survivors are exactly
    # the windows matching the last i + 1 tokens.
    for i in range(1, n_max):
        nxt = cand[cand >= i]  # window must not start before index 0
        nxt = nxt[arr[nxt - i] == arr[length - 1 - i]]
        if nxt.size == 0:
            break
        cand = nxt
        matched = i + 1
    if matched < n_min:
        return []
    end = int(cand[-1])
    return arr[end + 1 : end + 1 + k].tolist()


class NgramProposer(Proposer):
    """Prompt lookup with n-gram sizes ``n_min..n_max``: free proposals, so the controller only chooses how
    many of them to verify."""

    free_lookups = True

    def __init__(self, n_min: int, n_max: int) -> None:
        # Reported with the user-facing option names, since that is what they set.
        if n_min < 1:
            raise ValueError(f"prompt_lookup_min ({n_min}) must be >= 1")
        if n_max < n_min:
            raise ValueError(f"prompt_lookup_min ({n_min}) must be <= prompt_lookup_max ({n_max})")
        self.n_min = n_min
        self.n_max = n_max

    def propose_one(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Return up to ``k`` draft tokens for a request whose known tokens are ``token_ids``."""
        return ngram_propose(token_ids, k, self.n_min, self.n_max)

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[Draft]:
        return [Draft(self.propose_one(r.all_token_ids, k) if k > 0 else []) for r, k in zip(requests, num_tokens)]
