"""Monotone step-time fits: the constrained least squares against brute force, and the dip it removes."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from turbospec.control.monotone_fit import monotone_lstsq, nonnegative_lstsq, slope_basis
from turbospec.control.step_time import StepFeatures, StepTimeModel


def brute_force_nnls(a: np.ndarray, b: np.ndarray, free: np.ndarray) -> np.ndarray:
    """The best feasible unconstrained solution over every support of the constrained columns: the optimum."""
    best, best_x = np.inf, None
    constrained = np.flatnonzero(~free)
    for r in range(len(constrained) + 1):
        for chosen in itertools.combinations(constrained, r):
            on = free.copy()
            on[list(chosen)] = True
            x = np.zeros(a.shape[1])
            if on.any():
                x[on] = np.linalg.lstsq(a[:, on], b, rcond=None)[0]
            if (x[~free] >= -1e-12).all() and (err := float(np.sum((a @ x - b) ** 2))) < best - 1e-12:
                best, best_x = err, x
    return best_x


@pytest.mark.parametrize("seed", range(20))
def test_active_set_solution_equals_the_brute_force_optimum(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 7))
    a = rng.normal(size=(30, n))
    b = rng.normal(size=30)
    free = rng.random(n) < 0.3
    x = nonnegative_lstsq(a, b, free)
    assert (x[~free] >= 0).all()
    np.testing.assert_allclose(x, brute_force_nnls(a, b, free), atol=1e-8)


def test_slope_basis_turns_hinge_increments_into_segment_slopes():
    columns = ("one", "hinge64", "tokens", "hinge8", "kv")
    slopes = np.array([0.09, 0.5, 0.1, 2.0, 0.3])  # in column order: hinge64's entry is the slope after 64
    coef = slope_basis(columns) @ slopes
    # tokens' slope 0.1, after 8: 2.0 (increment 1.9), after 64: 0.5 (increment -1.5, a flattening)
    np.testing.assert_allclose(coef, [0.09, -1.5, 0.1, 1.9, 0.3])


def test_a_monotone_truth_is_recovered_exactly_flattening_knots_included():
    columns = ("one", "tokens", "hinge8", "hinge64", "kv")
    truth = np.array([0.09, 0.0002, 0.007, -0.004, 1e-6])  # the slope falls after 64 but stays positive
    rows = [(1.0, t, max(0, t - 8), max(0, t - 64), kv) for t in (1, 2, 5, 9, 13, 40, 80, 128, 512)
            for kv in (150, 600, 1800)]
    x = np.array(rows)
    np.testing.assert_allclose(monotone_lstsq(x, x @ truth, columns), truth, rtol=1e-6, atol=1e-12)


PROFILES = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "profiles"


@pytest.mark.parametrize("name", sorted(p.name for p in PROFILES.glob("*.json")))
def test_committed_profiles_refit_to_times_that_never_fall_as_tokens_or_context_grow(name):
    """Refit each committed profile's own samples. The EAGLE one (qwen2.5-coder-1.5b, AMD EPYC, 2 threads)
    measured 85-90 ms for 1 to 7 tokens at batch 1 and 95 at 9; its batch-4 plain steps ran faster than single
    ones (drift between grid points). Fitted without constraints it fell 2.5 ms per token up to a knot at 6
    tokens, and the controller verified 5-node trees where 8 nodes cost the same."""
    saved = StepTimeModel.load(PROFILES / name)
    assert saved is not None
    model = StepTimeModel.fit(saved.samples, saved.key)
    for batch in (1, 4, 12):
        for ctx in (150, 600):
            times = []
            for k in range(0, 17):
                f = StepFeatures()
                for i in range(batch):
                    f.add(ctx + 10 * i, 1, k)
                times.append(model.predict(f))
            assert all(b >= a - 1e-9 for a, b in zip(times, times[1:])), (batch, ctx, times)
        longer = []
        for ctx in (100, 400, 1600):
            f = StepFeatures()
            for i in range(batch):
                f.add(ctx, 1, 2)
            longer.append(model.predict(f))
        assert longer == sorted(longer)


def test_the_eagle_profile_prices_a_single_streams_9_token_verify_near_what_it_measured():
    saved = StepTimeModel.load(PROFILES / "qwen2.5-coder-1.5b-eagle-bf16-t2-zen5.json")
    assert saved is not None
    model = StepTimeModel.fit(saved.samples, saved.key)
    measured = {}
    for s in saved.samples:
        f = s.features
        if f.batch == 1 and f.tokens <= 9:
            measured.setdefault(f.tokens, []).append(s.target_s)
    for tokens, times in measured.items():
        f = StepFeatures()
        f.add(145, 1, tokens - 1)
        assert model.predict_part("target", f) == pytest.approx(sum(times) / len(times), rel=0.08), tokens
