"""Lookahead decoding (Fu et al., 2402.02057): Jacobi iterations fill an n-gram pool, verified in the same forward.

No draft model and no training. Every step a request's token tree carries two kinds of branch:
- the lookahead branch: a window of W guesses for the next W positions, as one chain under the root. The
  target's argmax at each of its nodes is one Jacobi iteration: the prediction for the following position
  given the guesses before it. Those predictions, shifted by what the step accepted, are the next window,
  and every n-gram of them enters the pool, keyed by its first token;
- verification branches: pool n-grams whose first token is the request's last token (their continuation
  becomes candidate paths, most recent first).
Wrong guesses converge over iterations (Jacobi), and the pool remembers phrases seen along the way, so
repeated structure is drafted even when it is not in the prompt. The context's own n-grams (prompt and
output) also join the pool, as the paper's implementation does with its pool-from-prompt option. Both
kinds of branch are ordinary tree candidates, so verification is the exact tree rule, and a lookahead
branch that happens to be right is accepted like any other.
This is the paper's method with a one-dimensional window (one Jacobi trajectory, not W x N); the pool is
per request. Requests that verify chains only (Request.accepts_trees) get their best pool match.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from ..draft import Draft
from ..request import Request
from ..verification.tree import TokenTree
from .base import Proposer


@dataclass
class _State:
    window: list[int] = field(default_factory=list)  # guesses for the positions after the last token
    pool: OrderedDict[int, list[tuple[int, ...]]] = field(default_factory=OrderedDict)  # first token -> n-grams
    # the window as sent in the last tree: its node indices and the request's length then
    window_nodes: list[int] = field(default_factory=list)
    sent_at: int = -1
    next_window: list[int] = field(default_factory=list)  # the Jacobi step's output, before the shift
    indexed: int = 0  # context tokens whose n-grams are in the pool


class LookaheadProposer(Proposer):
    observes_trees = True

    def __init__(self, window: int = 4, ngram: int = 3, max_candidates: int = 3, pool_per_key: int = 8) -> None:
        self.window = window
        self.ngram = ngram  # pool entries hold ngram - 1 tokens after their key
        self.max_candidates = max_candidates
        self.pool_per_key = pool_per_key
        self.states: dict[str, _State] = {}

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[Draft]:
        drafts = []
        for req, k in zip(requests, num_tokens):
            state = self.states.setdefault(req.request_id, _State())
            state.window_nodes, state.sent_at = [], -1
            if k <= 0:
                drafts.append(Draft([]))
                continue
            self._index_context(state, req.all_token_ids)
            last = req.all_token_ids[-1]
            candidates = [list(g) for g in state.pool.get(last, [])[: self.max_candidates]]
            wide = req.accepts_trees
            if not wide:  # a chain: the most recent pool match only
                drafts.append(Draft(candidates[0][:k] if candidates else []))
                continue
            width = min(self.window, max(1, k // 2))
            if len(state.window) < width:  # a fresh request: seed the window with the context's last tokens
                state.window = (state.window + req.all_token_ids[-width:])[:width]
            window = state.window[:width]
            paths = [window] + candidates  # the window goes first so its nodes come first in the tree
            tree = _limited(TokenTree.from_paths(paths), k)
            state.window_nodes = _nodes_along(tree, window)
            state.sent_at = req.num_tokens
            drafts.append(Draft(tree.tokens, tree=tree))
        return drafts

    def observe_tree(self, request: Request, tree: TokenTree, argmax: list[int]) -> None:
        state = self.states.get(request.request_id)
        if state is None or state.sent_at != request.num_tokens or not state.window_nodes:
            return
        # one Jacobi step: the prediction after the root, then after each window guess
        guesses = [argmax[0]] + [argmax[n + 1] for n in state.window_nodes]
        state.next_window = guesses
        context = request.all_token_ids[-1:] + guesses
        for i in range(len(context) - self.ngram + 1):
            self._remember(state, context[i], tuple(context[i + 1: i + self.ngram]))

    def on_verified(self, request: Request, num_accepted: int) -> None:
        state = self.states.get(request.request_id)
        if state is None or not state.next_window:
            return
        # the root moved past the accepted tokens and the emitted one: keep the guesses for what lies beyond
        state.window = state.next_window[num_accepted + 1:]
        state.next_window = []

    def _index_context(self, state: _State, ids: list[int]) -> None:
        """The context's own n-grams join the pool as the request grows (the prompt's at its first step), as
        the paper's implementation does with its pool-from-prompt option."""
        n = self.ngram
        for i in range(max(0, state.indexed - n + 1), len(ids) - n + 1):
            self._remember(state, ids[i], tuple(ids[i + 1: i + n]))
        state.indexed = len(ids)

    def _remember(self, state: _State, key: int, gram: tuple[int, ...]) -> None:
        grams = state.pool.setdefault(key, [])
        if gram in grams:
            grams.remove(gram)
        grams.insert(0, gram)
        del grams[self.pool_per_key:]

    def rollback(self, request: Request, num_tokens: int) -> None:
        self.states.pop(request.request_id, None)

    def free(self, request_id: str) -> None:
        self.states.pop(request_id, None)


def _limited(tree: TokenTree, k: int) -> TokenTree:
    """The first k nodes (parents precede children, so a prefix of the node list is a tree)."""
    return tree if len(tree) <= k else TokenTree(tree.tokens[:k], tree.parents[:k])


def _nodes_along(tree: TokenTree, path: list[int]) -> list[int]:
    """Node indices of `path`'s tokens from the root down, as far as the (possibly cut) tree holds them."""
    kids = tree.children()
    nodes: list[int] = []
    row = 0
    for tok in path:
        nxt = next((c for c in kids[row] if tree.tokens[c] == tok), None)
        if nxt is None:
            break
        nodes.append(nxt)
        row = nxt + 1
    return nodes
