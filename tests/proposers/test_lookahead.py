"""Lookahead's bookkeeping: the window is a chain verified as a tree, one Jacobi step shifts it past what was
accepted, and the pool holds the context's and the Jacobi trajectory's n-grams. (Greedy equality with plain
decoding, preemption and the batch-invariant check are in test_spec.py and test_determinism.py.)"""

from __future__ import annotations

from types import SimpleNamespace

from turbospec.proposers.lookahead import LookaheadProposer


def _req(ids: list[int], determinism: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(request_id="r", all_token_ids=ids, num_tokens=len(ids), acceptance="exact",
                           determinism=determinism, accepts_trees=determinism is None)


def test_window_pool_and_jacobi_shift():
    la = LookaheadProposer(window=3, ngram=3, max_candidates=2)
    req = _req([5, 6, 7, 9, 5, 6, 8, 4, 5])  # "5" was followed by (6, 7) and later (6, 8)
    draft = la.propose([req], [8])[0]
    # window seeded with the last 3 tokens, first; then pool candidates for key 5, most recent first
    assert draft.tree is not None
    assert draft.tree.tokens == [8, 4, 5, 6, 8, 7] and draft.tree.parents == [-1, 0, 1, -1, 3, 3]
    # the target's argmax at the root and at each node: at window nodes 0, 1, 2 it says 11, 12, 13
    la.observe_tree(req, draft.tree, [10, 11, 12, 13, 0, 0, 0])
    assert la.states["r"].pool[5][0] == (10, 11)  # Jacobi n-gram keyed by the last token
    assert la.states["r"].pool[10][0] == (11, 12)
    la.on_verified(req, 1)  # one draft accepted, plus the emitted token: the root moved by 2
    assert la.states["r"].window == [12, 13]


def test_budget_cuts_the_tree_and_deterministic_requests_get_a_chain():
    la = LookaheadProposer(window=4, ngram=3)
    req = _req([1, 2, 3, 1, 2, 4, 1])
    small = la.propose([req], [3])[0]
    assert len(small.tokens) == 3 and small.tree is not None  # window of k // 2 = 1, then pool nodes
    chain = LookaheadProposer(window=4, ngram=3).propose([_req([1, 2, 3, 1, 2, 4, 1], "llm42")], [8])[0]
    assert chain.tree is None and chain.tokens == [2, 4]  # the most recent n-gram after "1"
    assert la.propose([req], [0])[0].tokens == []


def test_stale_observations_are_ignored():
    la = LookaheadProposer(window=2, ngram=2)
    req = _req([1, 2, 3])
    draft = la.propose([req], [4])[0]
    later = _req([1, 2, 3, 4])  # the request moved on before the observation (e.g. preempted and recomputed)
    la.observe_tree(later, draft.tree, [9, 9, 9, 9, 9])
    assert la.states["r"].next_window == []
