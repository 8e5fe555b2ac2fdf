"""Speculative verification: greedy agreement, exact (lossless) distributions, seeding."""

from __future__ import annotations

import math
import random

import pytest
import torch

torch.set_num_threads(1)

from turbospec.sampler import make_generator  # noqa: E402
from turbospec.verification import chain as verifier  # noqa: E402
from turbospec.verification.chain import VerifyOutput, greedy_verify, verify  # noqa: E402

V = 5
TRIALS = 20_000

try:
    from scipy.stats import chi2 as _chi2

    def chi2_critical(df: int) -> float:
        return float(_chi2.ppf(0.999, df))

except ImportError:  # scipy is optional: chi-square critical values at alpha = 0.001
    _CRITICAL = {4: 18.4668, 24: 51.1786}

    def chi2_critical(df: int) -> float:
        return _CRITICAL[df]


def chi2_stat(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of observed counts against expected probabilities."""
    expected = probs.double() * counts.sum().double()
    assert float(expected.min()) >= 5, "cells too small for a chi-square test"
    return float(((counts.double() - expected) ** 2 / expected).sum())


def random_dist(gen: torch.Generator, n: int) -> torch.Tensor:
    """Dirichlet(1) rows mixed with uniform, so every cell has mass >= 0.06."""
    d = torch.empty(n, V).exponential_(generator=gen)
    return 0.7 * d / d.sum(-1, keepdim=True) + 0.3 / V


def one_hot(tokens: list[int]) -> torch.Tensor:
    out = torch.zeros(len(tokens), V)
    out[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
    return out


def run_trials(p: torch.Tensor, q: torch.Tensor | None, k: int, seed: int, n: int = TRIALS,
               proposal: torch.Tensor | None = None) -> VerifyOutput:
    """``n`` independent requests with target rows ``p [k+1, V]`` in one verify call.

    Drafts are drawn from ``q [k, V]``; with ``q`` None (one-hot proposer) they
    are drawn from ``proposal`` and each request's q is one-hot at its draft.
    """
    gen = torch.Generator().manual_seed(seed)
    src = q if q is not None else proposal
    cols = [torch.multinomial(src[j], n, replacement=True, generator=gen).tolist() for j in range(k)]
    draft_tokens = [list(d) for d in zip(*cols)] if k else [[] for _ in range(n)]
    return verify(
        target_probs=p.repeat(n, 1),
        row_start=[i * (k + 1) for i in range(n)],
        draft_tokens=draft_tokens,
        draft_probs=[q] * n,
        generators=[gen] * n,  # one shared seeded stream: fast, still independent draws
    )


def first_token_counts(out: VerifyOutput) -> torch.Tensor:
    return torch.bincount(torch.tensor([t[0] for t in out.tokens]), minlength=V)


def pair_counts(out: VerifyOutput, p1: torch.Tensor, seed: int) -> torch.Tensor:
    """Counts of the first two tokens; sequences that stopped after one token are
    continued by a plain decode (k = 0) from p_1, as the next engine step would."""
    short = [i for i, t in enumerate(out.tokens) if len(t) == 1]
    nxt = run_trials(p1.unsqueeze(0), None, 0, seed, n=len(short))
    cont = dict(zip(short, (t[0] for t in nxt.tokens)))
    pairs = [t[0] * V + (t[1] if len(t) > 1 else cont[i]) for i, t in enumerate(out.tokens)]
    return torch.bincount(torch.tensor(pairs), minlength=V * V)


# ----------------------------------------------------------------------------- greedy


def test_greedy_hand_cases() -> None:
    # request 0: all accepted + bonus; 1: mismatch at position 1; 2: k = 0.
    targets = [[1, 2, 3], [4, 0, 2], [3]]
    drafts = [[1, 2], [4, 1], []]
    p = one_hot([t for ts in targets for t in ts])
    q = random_dist(torch.Generator().manual_seed(0), 2)
    for dp in ([None, None, None], [q, q, None]):
        out = verify(p, [0, 3, 6], drafts, dp, [None, None, None])
        assert out.tokens == [[1, 2, 3], [4, 0], [3]]
        assert out.num_accepted == [2, 1, 0]
    ref = greedy_verify(targets, drafts)
    assert ref.tokens == [[1, 2, 3], [4, 0], [3]] and ref.num_accepted == [2, 1, 0]
    assert greedy_verify([[0, 1]], [[2]]).tokens == [[0]]


def test_greedy_verify_agrees_on_random_cases() -> None:
    rng = random.Random(1)
    gen = torch.Generator().manual_seed(1)
    targets, drafts, dps = [], [], []
    for _ in range(300):
        k = rng.randint(0, 4)
        t = [rng.randrange(V) for _ in range(k + 1)]
        targets.append(t)
        drafts.append([t[j] if rng.random() < 0.75 else rng.randrange(V) for j in range(k)])
        dps.append(random_dist(gen, k) if rng.random() < 0.5 else None)
    starts = [0]
    for t in targets[:-1]:
        starts.append(starts[-1] + len(t))
    p = one_hot([x for t in targets for x in t])
    out = verify(p, starts, drafts, dps, [None] * len(targets))
    assert out == greedy_verify(targets, drafts)


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("k", [1, 3])
def test_first_token_is_distributed_as_target(k: int) -> None:
    gen = torch.Generator().manual_seed(10 + k)
    p, q = random_dist(gen, k + 1), random_dist(gen, k)
    out = run_trials(p, q, k, seed=100 + k)
    assert chi2_stat(first_token_counts(out), p[0]) < chi2_critical(V - 1)


@pytest.mark.parametrize("k", [1, 3])
def test_first_two_tokens_are_distributed_as_target(k: int) -> None:
    # p_1 does not depend on the first token here, so autoregressive sampling
    # from the target gives the pair (a, b) probability p_0(a) * p_1(b).
    gen = torch.Generator().manual_seed(20 + k)
    p, q = random_dist(gen, k + 1), random_dist(gen, k)
    out = run_trials(p, q, k, seed=200 + k)
    assert sum(len(t) > 1 for t in out.tokens) > TRIALS // 4  # the bonus / accepted path is exercised
    joint = (p[0].unsqueeze(1) * p[1].unsqueeze(0)).flatten()
    assert chi2_stat(pair_counts(out, p[1], seed=300 + k), joint) < chi2_critical(V * V - 1)


def test_plain_decode_k0_is_distributed_as_target() -> None:
    p = random_dist(torch.Generator().manual_seed(30), 1)
    out = run_trials(p, None, 0, seed=31)
    assert all(len(t) == 1 for t in out.tokens) and set(out.num_accepted) == {0}
    assert chi2_stat(first_token_counts(out), p[0]) < chi2_critical(V - 1)


def test_one_hot_proposer_is_distributed_as_target() -> None:
    gen = torch.Generator().manual_seed(40)
    p, proposal = random_dist(gen, 2), random_dist(gen, 1)
    out = run_trials(p, None, 1, seed=41, proposal=proposal)
    assert chi2_stat(first_token_counts(out), p[0]) < chi2_critical(V - 1)
    joint = (p[0].unsqueeze(1) * p[1].unsqueeze(0)).flatten()
    assert chi2_stat(pair_counts(out, p[1], seed=42), joint) < chi2_critical(V * V - 1)


@pytest.mark.parametrize("dense_q", [True, False])
def test_wrong_residual_fails_the_chi_square_test(monkeypatch: pytest.MonkeyPatch, dense_q: bool) -> None:
    """Resampling from p on rejection (instead of the residual) is biased towards
    the draft's favourites; the exactness test must detect it."""
    gen = torch.Generator().manual_seed(50)
    p, q = random_dist(gen, 2), random_dist(gen, 1)
    assert 0.5 * float((p[0] - q[0]).abs().sum()) > 0.15  # enough rejections to matter
    monkeypatch.setattr(verifier, "_residual", lambda p_rows, q_rows: p_rows)
    out = run_trials(p, q if dense_q else None, 1, seed=51, proposal=q)
    assert chi2_stat(first_token_counts(out), p[0]) > chi2_critical(V - 1)


# ----------------------------------------------------------------------------- acceptance


def test_acceptance_is_one_when_draft_equals_target() -> None:
    gen = torch.Generator().manual_seed(60)
    p = random_dist(gen, 4)
    out = run_trials(p, p[:3].clone(), 3, seed=61, n=2000)
    assert set(out.num_accepted) == {3}
    assert all(len(t) == 4 for t in out.tokens)


def test_acceptance_rate_matches_overlap() -> None:
    gen = torch.Generator().manual_seed(70)
    p, q = random_dist(gen, 2), random_dist(gen, 1)
    out = run_trials(p, q, 1, seed=71)
    expected = float(torch.minimum(p[0], q[0]).sum())
    rate = sum(out.num_accepted) / TRIALS
    sigma = math.sqrt(expected * (1 - expected) / TRIALS)
    assert abs(rate - expected) < 4 * sigma
    # One-hot proposer: x is accepted with probability p(x).
    out = run_trials(p, None, 1, seed=72, proposal=q)
    expected = float((p[0] * q[0]).sum())
    sigma = math.sqrt(expected * (1 - expected) / TRIALS)
    assert abs(sum(out.num_accepted) / TRIALS - expected) < 4 * sigma


# ----------------------------------------------------------------------------- seeding


def test_seeded_request_is_independent_of_batch() -> None:
    gen = torch.Generator().manual_seed(80)
    p, q = random_dist(gen, 4), random_dist(gen, 3)
    drafts = [1, 3, 0]
    results = set()
    for seed in range(20):
        alone = verify(p, [0], [drafts], [q], [make_generator(seed)])
        # Batch-mates before it (sampled, greedy, one-hot) shift its rows and
        # draw from their own generators.
        other = random_dist(gen, 4)
        batch_p = torch.cat([other[:3], one_hot([2, 4]), other[3:], p])
        batch = verify(
            batch_p,
            [0, 3, 5, 6],
            [[0, 1], [2], [], drafts],
            [other[:2], None, None, q],
            [make_generator(seed), None, make_generator(seed + 1), make_generator(seed)],
        )
        assert batch.tokens[3] == alone.tokens[0]
        assert batch.num_accepted[3] == alone.num_accepted[0]
        assert batch.tokens[1] == [2, 4]
        results.add(tuple(alone.tokens[0]))
    assert len(results) > 3  # the seed actually matters


def test_generator_consumption_is_fixed() -> None:
    # k uniforms then V exponentials per call, whatever the outcome, so a
    # request's stream never depends on how many drafts were accepted.
    gen = torch.Generator().manual_seed(90)
    p, q = random_dist(gen, 3), random_dist(gen, 2)
    for drafts in ([0, 1], [4, 4], [2, 0]):
        g, ref = make_generator(7), make_generator(7)
        verify(p, [0], [drafts], [q], [g])
        torch.rand(2, generator=ref)
        torch.empty(V).exponential_(generator=ref)
        assert torch.equal(g.get_state(), ref.get_state())


def test_rejects_bad_inputs() -> None:
    p = random_dist(torch.Generator().manual_seed(0), 2)
    with pytest.raises(ValueError):
        verify(p, [1], [[0]], [None], [None])  # rows 1..2 do not exist
    with pytest.raises(ValueError):
        verify(p, [0], [[0]], [torch.zeros(2, V)], [None])  # q shape
    with pytest.raises(ValueError):
        verify(p, [0, 0], [[0]], [None], [None])  # length mismatch
    with pytest.raises(ValueError):
        greedy_verify([[0]], [[0]])  # needs k + 1 target tokens
