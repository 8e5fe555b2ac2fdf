"""Least squares for step-time forms under the one thing physics guarantees: more work never makes a step
faster. A forward over more tokens, a longer context or a larger batch costs at least as much, so every
column's coefficient is at least zero, and a hinge form's slope after each knot is too (the knots' own
coefficients may be negative: a slope that flattens where a kernel saturates).

Why: unconstrained fits of noisy profiles drew curves that dip. The brief profile of qwen2.5-coder-1.5b with
its EAGLE draft (AMD EPYC, 2 threads) fitted 0.091 s - 2.5 ms x tokens up to a knot at 6, so a 6-token step read
12 ms cheaper than a 1-token one; it measured 85-90 ms for 1 to 7 tokens at batch 1. The controller then verified
5-node trees where 8 nodes cost the same, and trailed fixed 8-node EAGLE on HumanEval
(benchmarks/results/proposer_zoo/archive/2026-12-03-proposer_zoo_qwen_zen5_eagle8_controller.md: 0.97x).
"""

from __future__ import annotations

import numpy as np


def is_free(column: str) -> bool:
    """Columns left unconstrained: the intercept "one", and "drafting" (a draft pass at all, whose fitted offset
    may be negative next to a per-level slope). Every other column is work, jumps included: the measured jump
    where packed linears turn dense was a step up (tests/control/test_goodput.py), and a step down is the dip this
    module exists to forbid (left free, a noisy re-profile fitted one at 9 tokens: ad hoc, that profile was not
    kept)."""
    return column in ("one", "drafting")


def slope_basis(columns: tuple[str, ...]) -> np.ndarray:
    """T with coef = T @ s, where s holds the slopes of the tokens-then-hinges segments (and every other column's
    coefficient) so that s >= 0 is the monotone constraint. Hinges are increments: tokens' slope is s0, the
    first hinge's coefficient s1 - s0, the next s2 - s1, in knot order."""
    t = np.eye(len(columns))
    if "tokens" not in columns:
        return t
    hinges = sorted((i for i, c in enumerate(columns) if c.startswith("hinge")), key=lambda i: int(columns[i][5:]))
    chain = [columns.index("tokens"), *hinges]
    for prev, cur in zip(chain, chain[1:]):
        t[cur, prev] = -1.0
    return t


def nonnegative_lstsq(a: np.ndarray, b: np.ndarray, free: np.ndarray, max_iter: int = 100) -> np.ndarray:
    """argmin |a x - b| subject to x[~free] >= 0: Lawson and Hanson's active set method, with the free
    columns always in the passive set. Forms have at most six columns, so it ends in a few iterations."""
    n = a.shape[1]
    passive = free.copy()

    def solve(on: np.ndarray) -> np.ndarray:
        z = np.zeros(n)
        if on.any():
            z[on] = np.linalg.lstsq(a[:, on], b, rcond=None)[0]
        return z

    x = solve(passive)
    for _ in range(max_iter):
        gradient = a.T @ (b - a @ x)
        entering = ~passive
        tol = 1e-10 * max(1.0, float(np.abs(gradient).max()))
        if not entering.any() or gradient[entering].max() <= tol:
            break
        passive[np.flatnonzero(entering)[np.argmax(gradient[entering])]] = True
        for _ in range(max_iter):
            z = solve(passive)
            infeasible = passive & ~free & (z <= 0)
            if not infeasible.any():
                x = z
                break
            # move from x toward z until the first constrained coefficient reaches zero; it leaves the set
            step = float(np.min(x[infeasible] / (x[infeasible] - z[infeasible])))
            x = x + step * (z - x)
            passive &= free | (x > 1e-15)
            x[~passive] = 0.0
    return x


def monotone_lstsq(x: np.ndarray, y: np.ndarray, columns: tuple[str, ...]) -> np.ndarray:
    """Coefficients for `columns` minimising |x coef - y| with the form's time non-decreasing in its work."""
    basis = slope_basis(columns)
    free = np.array([is_free(c) for c in columns])
    return basis @ nonnegative_lstsq(x @ basis, y, free)
