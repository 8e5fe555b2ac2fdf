"""Prompt lookup (n-gram) proposer: match choice, continuation, edge cases."""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest

from turbospec.proposers.ngram import NgramProposer, ngram_propose


def brute_force(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Obviously-correct reference: try every n (longest first) and every window (latest first)."""
    t = list(tokens)
    if k <= 0:
        return []
    for n in range(n_max, n_min - 1, -1):
        if n > len(t) - 1:
            continue
        suffix = t[len(t) - n :]
        for start in range(len(t) - n - 1, -1, -1):
            if t[start : start + n] == suffix:
                return t[start + n : start + n + k]
    return []


def test_longest_match_beats_shorter_more_recent_one() -> None:
    # Suffix [1, 2, 3]: a full 3-gram match at 0 (followed by 9, 8), and a
    # more recent lone 3 at index 6 (followed by 7, 1).
    tokens = [1, 2, 3, 9, 8, 5, 3, 7, 1, 2, 3]
    assert ngram_propose(tokens, 2, 1, 3) == [9, 8]
    # Capping n at 1 makes the recent single-token match the answer.
    assert ngram_propose(tokens, 2, 1, 1) == [7, 1]


def test_most_recent_wins_among_equal_lengths() -> None:
    tokens = [1, 2, 7, 1, 2, 8, 1, 2]
    assert ngram_propose(tokens, 2, 1, 2) == [8, 1]
    assert ngram_propose(tokens, 2, 2, 2) == [8, 1]


def test_k_truncates() -> None:
    tokens = [1, 2, 7, 1, 2, 8, 1, 2]
    assert ngram_propose(tokens, 1, 1, 2) == [8]
    assert ngram_propose(tokens, 3, 1, 2) == [8, 1, 2]


def test_continuation_runs_into_suffix_and_stops_at_end() -> None:
    # The only earlier 5 is at 0; its continuation is the rest of the sequence.
    assert ngram_propose([5, 6, 5], 10, 1, 3) == [6, 5]
    # Longest usable window in [4, 4, 4, 4] is the 3-gram at 0: one token follows.
    assert ngram_propose([4, 4, 4, 4], 5, 1, 3) == [4]
    assert ngram_propose([4, 4, 4, 4], 5, 1, 10) == [4]


def test_no_match_returns_empty() -> None:
    assert ngram_propose([1, 2, 3, 4], 3, 1, 3) == []
    # A lone earlier 3 does not count when n_min asks for at least 2 tokens.
    assert ngram_propose([1, 2, 3, 9, 5, 3], 3, 2, 4) == []


def test_suffix_never_matches_itself() -> None:
    assert ngram_propose([1, 2, 3], 3, 1, 3) == []
    assert ngram_propose([3], 3, 1, 3) == []
    assert ngram_propose([], 3, 1, 3) == []


def test_too_short_for_n_min() -> None:
    assert ngram_propose([1, 1], 3, 2, 4) == []
    assert ngram_propose([1, 1, 1], 3, 2, 4) == [1]


def test_non_positive_k_and_empty_range() -> None:
    assert ngram_propose([1, 2, 1], 0, 1, 2) == []
    assert ngram_propose([1, 2, 1], -1, 1, 2) == []
    assert ngram_propose([1, 2, 1], 3, 2, 1) == []


def test_accepts_numpy_and_returns_python_ints() -> None:
    tokens = [1, 2, 7, 1, 2, 8, 1, 2]
    for arr in (np.array(tokens, dtype=np.int64), np.array(tokens, dtype=np.int32)):
        out = ngram_propose(arr, 2, 1, 2)
        assert out == [8, 1]
        assert all(type(x) is int for x in out)


def test_matches_brute_force_on_random_sequences() -> None:
    rng = random.Random(1234)
    for _ in range(500):
        length = rng.randint(1, 60)
        tokens = [rng.randint(0, rng.choice([1, 2, 3])) for _ in range(length)]
        k = rng.randint(0, 7)
        n_min = rng.randint(1, 5)
        n_max = rng.randint(n_min, n_min + 5)
        expected = brute_force(tokens, k, n_min, n_max)
        assert ngram_propose(tokens, k, n_min, n_max) == expected, (tokens, k, n_min, n_max)
        assert NgramProposer(n_min, n_max).propose_one(tokens, k) == expected


@pytest.mark.parametrize("alphabet", [4, 1000])
def test_long_sequence_matches_brute_force(alphabet: int) -> None:
    rng = np.random.default_rng(alphabet)
    tokens = rng.integers(0, alphabet, size=4096).tolist()
    # Plant an older 6-token copy of the suffix, so a large alphabet still has a match.
    tokens[1000:1006] = tokens[-6:]
    for n_min, n_max in ((1, 8), (2, 5), (3, 3)):
        expected = brute_force(tokens, 5, n_min, n_max)
        assert expected
        assert ngram_propose(np.asarray(tokens), 5, n_min, n_max) == expected


def test_proposer_validation() -> None:
    with pytest.raises(ValueError, match=r"prompt_lookup_min \(0\) must be >= 1"):
        NgramProposer(0, 3)
    with pytest.raises(ValueError, match=r"prompt_lookup_min \(4\) must be <= prompt_lookup_max \(2\)"):
        NgramProposer(4, 2)
    with pytest.raises(ValueError, match="n_min"):
        ngram_propose([1, 2, 1], 2, 0, 2)
    proposer = NgramProposer(2, 2)
    assert (proposer.n_min, proposer.n_max) == (2, 2)
