"""The goodput choice: each step, give every decoding request the draft length k_i that maximises the batch's
expected emitted tokens per second of predicted step time (TurboSpec, arXiv 2406.14066).

Request i emits 1 + a_i1 + a_i1 a_i2 + ... tokens for k_i drafts (conditional acceptance a_ij per position).
Lengthening its draft from k to k+1 adds a_i1 ... a_i(k+1) expected tokens, a gain that only shrinks as k
grows. So a greedy pass visits the draft tokens in order of decreasing gain (one sort), and the best prefix of
that order is the allocation. The pass does not stop at the first token that fails to pay: a draft model's
cost jumps when the longest draft grows (one more draft forward for the whole batch), so a prefix that loses
at first can win a few tokens later. k = 0 for every request is always a candidate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# Predicted step time (s) from the speculative part of the step: (sum of k_i, max k_i, sum of k_i x context_i).
# The caller closes over everything else in the step (prefill chunks, decodes, KV). Besides ints, it must take
# numpy int arrays of one shape and price each entry (choose_lengths prices many allocations in one call).
StepCost = Callable[[int, int, int], float]

# Allocations (draft tokens x depth caps) up to which choose_lengths prices them one at a time (_greedy): below
# this numpy's fixed cost per call outweighs a short scan (a lone request; ad hoc timings, not committed). Above
# it, pricing on arrays (_best_prefix) took the choice at batch 32 on Zen 4 from 0.81% to 0.44% of a decode-only
# step (benchmarks/results/auto_path_cost/auto_path_cost_zen4.md and its archived scalar run).
SCALAR_PRICES = 64


@dataclass
class Choice:
    ks: list[int]
    expected_tokens: float
    predicted_time: float

    @property
    def goodput(self) -> float:
        return self.expected_tokens / self.predicted_time if self.predicted_time > 0 else float("inf")


def choose_lengths(rates: list[list[float]], k_max: list[int], cost: StepCost,
                   contexts: list[int] | None = None, min_gain: float = 0.0, max_total: int | None = None,
                   search_depth: bool = False, activation: list[float] | None = None) -> Choice:
    """Draft lengths for one step.

    rates[i][j] is request i's conditional acceptance at position j + 1 (len >= k_max[i]); contexts[i] its
    context length; max_total caps the sum of k_i (the step's spare token budget). Speculation must beat plain
    decoding by a factor (1 + min_gain) to be used at all.

    activation[i]: seconds added once request i drafts at all (k_i >= 1): a draft model that has not yet seen
    the request's prompt must first run over it (its share of that one-time cost; see the controller).

    search_depth: the cost jumps with the longest draft (a draft model's forwards). Then one greedy pass per
    depth cap K = 1..max(k_max) is run, each with k_i <= K, and the best is kept: within a cap the cost is
    linear again, so the greedy order is right.
    """
    n = len(rates)
    contexts = contexts or [0] * n
    plain = Choice([0] * n, float(n), float(cost(0, 0, 0)))
    best = plain
    caps = range(1, max(k_max, default=0) + 1) if search_depth else [max(k_max, default=0)]
    # An activation cost sits on a request's first draft token, so the greedy order's prefixes would rarely
    # skip past it: also try without the requests that carry more than the least (a draft model's catch-up on
    # top of the per-request cost every drafting request pays).
    limits = [k_max]
    if activation is not None and any(activation):
        least = min((a for a, k in zip(activation, k_max) if k > 0), default=0.0)
        cheapest = [0 if activation[i] > least else k for i, k in enumerate(k_max)]
        if cheapest != k_max:  # (draft heads: every drafting request pays the same, nothing to leave out)
            limits.append(cheapest)
    for limit in limits:
        order = _draft_order(rates, limit)
        if len(order) * len(caps) <= SCALAR_PRICES:
            candidates = [_greedy(order, n, cap, cost, contexts, max_total, activation) for cap in caps]
        else:
            candidates = [_best_prefix(order, n, list(caps), cost, contexts, max_total, activation)]
        for candidate in candidates:
            if candidate.goodput > best.goodput:
                best = candidate
    if best.goodput < plain.goodput * (1.0 + min_gain):
        return plain
    return best


def _draft_order(rates: list[list[float]], k_max: list[int]) -> list[tuple[float, int, int]]:
    """Every draft token the requests may verify as (-expected gain, request, position), in the order a greedy pass
    takes them: decreasing gain, ties to the lower request, then the lower position. A request's gains never rise
    with position as long as its rates are at most 1 (the estimators clamp them to 0.999), so its positions come in
    order, and one sort serves every depth cap."""
    order = []
    for i, (r, k) in enumerate(zip(rates, k_max)):
        reach = 1.0
        for j in range(k):
            reach *= r[j]
            order.append((-reach, i, j + 1))
    order.sort()
    return order


def _greedy(order: list[tuple[float, int, int]], n: int, cap: int, cost: StepCost, contexts: list[int],
            max_total: int | None, activation: list[float] | None) -> Choice:
    """The best prefix of the draft tokens in `order` (_draft_order) at positions up to `cap`, one price at a time:
    for a few requests this is cheaper than setting up _best_prefix's arrays."""
    best = Choice([0] * n, float(n), cost(0, 0, 0))
    best_goodput, best_end = best.goodput, 0
    tokens, sum_k, max_k, sum_kctx, extra = float(n), 0, 0, 0, 0.0
    for end, (neg_gain, i, j) in enumerate(order, 1):
        if j > cap:
            continue
        if max_total is not None and sum_k >= max_total:
            break
        tokens -= neg_gain
        sum_k += 1
        max_k = max(max_k, j)
        sum_kctx += contexts[i]
        if activation is not None and j == 1:
            extra += activation[i]
        t = cost(sum_k, max_k, sum_kctx) + extra
        if t > 0 and tokens / t > best_goodput:
            best_goodput, best_end = tokens / t, end
            best = Choice([], tokens, t)
    ks = [0] * n
    for _, i, j in order[:best_end]:
        if j <= cap:
            ks[i] = j  # a request's positions come in order: its last one taken is its k
    best.ks = ks
    return best


def _best_prefix(order: list[tuple[float, int, int]], n: int, caps: list[int], cost: StepCost,
                 contexts: list[int], max_total: int | None, activation: list[float] | None) -> Choice:
    """What _greedy finds for each cap in `caps`, the first of the highest goodput (caps in turn, the shortest
    prefix), with every (cap, prefix) pair priced in one call of `cost` on arrays (a row per cap). At batch 32 with
    eight depth caps and two search orders a step prices thousands of allocations: one at a time, the choice took
    1.25% of a decode step on an AMX Xeon (benchmarks/results/auto_path_cost/auto_path_cost_amx.md). The sums run
    in _greedy's order, so both give the same bits (test_pricing_every_allocation_at_once_...)."""
    plain = Choice([0] * n, float(n), cost(0, 0, 0))
    if not order:
        return plain
    columns = np.array(order).T
    gain, request, position = -columns[0], columns[1].astype(np.int64), columns[2].astype(np.int64)
    taken = position[None, :] <= np.array(caps)[:, None]  # [caps, tokens]
    sum_k = np.cumsum(taken, axis=1)
    if max_total is not None:
        taken = taken & (sum_k <= max_total)  # drafts use only the step's spare tokens
    # each prefix's sums are those of its taken tokens (a 0 where one is not taken), added in _greedy's order
    gains = np.where(taken, gain, 0.0)
    tokens = np.cumsum(np.concatenate([np.full((len(caps), 1), float(n)), gains], axis=1), axis=1)[:, 1:]
    max_k = np.maximum.accumulate(np.where(taken, position, 0), axis=1)
    sum_kctx = np.cumsum(np.where(taken, np.asarray(contexts, dtype=np.int64)[request], 0), axis=1)
    t = cost(sum_k, max_k, sum_kctx)
    if activation is not None:
        first = taken & (position == 1)
        t = t + np.cumsum(np.where(first, np.asarray(activation, dtype=np.float64)[request], 0.0), axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        goodput = np.where(taken & (t > 0), tokens / t, -np.inf)
    at = int(np.argmax(goodput))  # the first maximum: caps in turn, the shortest prefix
    row, end = divmod(at, goodput.shape[1])
    if not taken[row, end]:
        return plain
    ks = np.zeros(n, dtype=np.int64)
    chosen = taken[row, : end + 1]
    np.maximum.at(ks, request[: end + 1][chosen], position[: end + 1][chosen])
    return Choice([int(k) for k in ks], float(tokens[row, end]), float(t[row, end]))
