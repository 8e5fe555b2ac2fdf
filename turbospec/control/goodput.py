"""The goodput choice: each step, give every decoding request the draft length k_i that maximises the batch's
expected emitted tokens per second of predicted step time (TurboSpec, arXiv 2406.14066).

The expected tokens of request i are (1 - a_i^(k_i+1)) / (1 - a_i). Lengthening one draft from k to k+1
adds a_i^(k+1) expected tokens, and that gain shrinks as k grows. Step time rises with every verified and
drafted token. So a greedy marginal allocation finds the optimum: repeatedly lengthen the draft whose next
token has the best chance of being accepted, and stop once goodput no longer improves. k = 0 for every
request is a valid answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

from .acceptance import expected_tokens

# Predicted step time (seconds) for draft lengths ks; the caller closes over the step's other contents.
StepCost = Callable[[list[int]], float]


@dataclass
class Choice:
    ks: list[int]
    expected_tokens: float
    predicted_time: float

    @property
    def goodput(self) -> float:
        return self.expected_tokens / self.predicted_time


def choose_lengths(acceptance: list[float], k_max: list[int], cost: StepCost, min_gain: float = 0.0) -> Choice:
    """Draft lengths for one step.

    Speculation must beat plain decoding by a factor (1 + min_gain) to be used at all (hysteresis against
    flapping on noise).
    """
    ks = [0] * len(acceptance)
    tokens = float(len(acceptance))
    plain = Choice(list(ks), tokens, cost(ks))
    best = plain
    while True:
        open_ = [i for i in range(len(ks)) if ks[i] < k_max[i]]
        if not open_:
            break
        i = max(open_, key=lambda j: acceptance[j] ** (ks[j] + 1))
        trial = list(ks)
        trial[i] += 1
        gain = expected_tokens(acceptance[i], trial[i]) - expected_tokens(acceptance[i], ks[i])
        candidate = Choice(trial, tokens + gain, cost(trial))
        if candidate.goodput <= best.goodput:
            break
        ks, tokens, best = trial, tokens + gain, candidate
    if best.goodput < plain.goodput * (1.0 + min_gain):
        return plain
    return best
