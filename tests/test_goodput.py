"""The goodput choice and the acceptance estimator on synthetic step-time models and acceptance."""

from __future__ import annotations

import random

import pytest

from turbospec.control.acceptance import AcceptanceEstimator, expected_tokens
from turbospec.control.goodput import choose_lengths


def linear_cost(base: float, per_token: float):
    return lambda ks: base + per_token * (len(ks) + sum(ks))


def brute_force(acceptance, k_max, cost):
    import itertools

    best, best_ks = -1.0, None
    for ks in itertools.product(*[range(k + 1) for k in k_max]):
        g = sum(expected_tokens(a, k) for a, k in zip(acceptance, ks)) / cost(list(ks))
        if g > best + 1e-12:
            best, best_ks = g, list(ks)
    return best_ks, best


def test_expected_tokens_formula():
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(1.0, 3) == 4.0


def test_flat_cost_and_high_acceptance_speculate_deeply():
    choice = choose_lengths([0.9], [8], linear_cost(1.0, 0.001))
    assert choice.ks == [8]


def test_steep_cost_never_speculates():
    choice = choose_lengths([0.6, 0.6], [8, 8], linear_cost(0.1, 1.0))
    assert choice.ks == [0, 0]


def test_requests_with_different_acceptance_get_different_lengths():
    choice = choose_lengths([0.95, 0.3], [8, 8], linear_cost(1.0, 0.08))
    assert choice.ks[0] > choice.ks[1]


def test_greedy_allocation_matches_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 3)
        acc = [rng.uniform(0.05, 0.98) for _ in range(n)]
        kmax = [rng.randint(0, 4) for _ in range(n)]
        cost = linear_cost(rng.uniform(0.2, 2.0), rng.uniform(0.001, 0.5))
        choice = choose_lengths(acc, kmax, cost)
        _, best = brute_force(acc, kmax, cost)
        assert choice.goodput == pytest.approx(best, rel=1e-9)


def test_hysteresis_keeps_plain_decoding_for_marginal_gains():
    cost = linear_cost(1.0, 0.3)
    assert choose_lengths([0.5], [4], cost).ks != [0]
    assert choose_lengths([0.5], [4], cost, min_gain=0.5).ks == [0]


def test_estimator_follows_a_step_change_within_tens_of_verifications():
    est = AcceptanceEstimator(prior=0.5)
    rng = random.Random(1)

    def verify(rate, k=4):
        accepted = 0
        while accepted < k and rng.random() < rate:
            accepted += 1
        est.observe("r", k, accepted)

    for _ in range(60):
        verify(0.9)
    assert est.rate("r") > 0.8
    cost = linear_cost(1.0, 0.1)
    high_choice = choose_lengths([est.rate("r")], [8], cost).ks[0]
    steps = 0
    while est.rate("r") > 0.35:
        verify(0.1)
        steps += 1
        assert steps < 30, "the estimate did not follow the shift"
    assert choose_lengths([est.rate("r")], [8], cost).ks[0] < high_choice


def test_new_requests_start_from_the_global_prior():
    est = AcceptanceEstimator(prior=0.5)
    for _ in range(200):
        est.observe("old", 4, 4)
    assert est.rate("new") > 0.8
    est.free("old")
    assert est.rate("old") == est.rate("new")
