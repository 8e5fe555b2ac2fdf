"""When the requests of a load test arrive: the `--request-rate` flag and the send times it gives (shared by
`turbospec bench serve` and the simulator)."""

from __future__ import annotations

import math

import numpy as np


def parse_rates(text: str) -> tuple[float, ...]:
    """'1,2.5,inf' -> (1.0, 2.5, inf). ValueError for anything that is not a positive number or inf."""
    rates = []
    for piece in text.split(","):
        try:
            rate = float(piece.strip())
        except ValueError:
            raise ValueError(f"--request-rate {text!r}: {piece.strip()!r} is not a number; "
                             "give comma-separated requests/s > 0, or inf (all at once)") from None
        if not rate > 0:
            raise ValueError(f"--request-rate {text!r}: {piece.strip()!r} must be > 0 requests/s, or inf")
        rates.append(rate)
    return tuple(rates)


def arrival_offsets(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Send times (s from the start) of `n` requests: the first at 0, then gaps ~ Gamma(shape=burstiness,
    scale=1/(rate*burstiness)), whose mean is 1/rate and coefficient of variation 1/sqrt(burstiness).
    rate inf: all at 0. Numpy scales one standard-gamma draw per gap, so a seed gives the same gaps at every
    rate up to scale, and rates differ only in load."""
    if math.isinf(rate):
        return np.zeros(n)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=max(n - 1, 0))
    return np.concatenate(([0.0], np.cumsum(gaps)))[:n]
