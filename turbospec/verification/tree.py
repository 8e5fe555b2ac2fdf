"""Token trees: several candidate continuations of one request verified in one forward (SpecInfer, Medusa).

A tree hangs under the request's last known token (the root). Its nodes are flattened so that every parent
comes before its children; node i holds ``tokens[i]`` and ``parents[i]`` (-1 for a child of the root). In the
forward the root and the nodes are the request's new tokens: node i sits at position ``root + depth(i)`` and
attends to the context, the root and its own ancestors only (``attention_mask``), so every root-to-node path
computes exactly what a plain sequence with those tokens would. Its K/V is written to the slot after the root
at its flat index; after verification the accepted path is copied down to consecutive slots (``compaction``).

Acceptance (REFERENCE.md section 3), per request, walking down from the root:
- greedy: move to the child whose token is the target's argmax at the current node; stop at the first node
  with no such child and emit the argmax there (at a leaf: the bonus token);
- sampled, with deterministic candidates: try the current node's children in order; accept child c with
  probability p(c) under what is left of p, else set p(c) = 0, renormalise and try the next; when none is
  accepted, sample the emitted token from what is left. Each child's chance is its share of the remaining
  mass, and a rejected child's mass is removed before anything else is drawn, so each emitted token has
  exactly the target's distribution (the argument for one-hot drafts, applied once per sibling).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class TokenTree:
    tokens: list[int]
    parents: list[int]  # -1: a child of the root; otherwise the index of an earlier node
    # node i's place in the proposer's confidence order (0: its most probable node), when it ranks them: the
    # goodput controller learns how often the node of each rank is accepted (control/acceptance_estimators.py, NodeRank)
    ranks: list[int] | None = None
    depth: list[int] = field(init=False)  # 1 for the root's children

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"a tree needs one parent per token: {len(self.tokens)} tokens, {len(self.parents)} "
                             f"parents")
        if self.ranks is not None and sorted(self.ranks) != list(range(len(self.tokens))):
            raise ValueError(f"a tree's ranks must order its {len(self.tokens)} nodes, got {self.ranks}")
        self.depth = []
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"node {i}'s parent {p} must be -1 (the root) or an earlier node")
            self.depth.append(1 if p < 0 else self.depth[p] + 1)

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> TokenTree:
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> TokenTree:
        """Merge token paths into a trie; node order follows the paths' order (earlier paths are tried first)."""
        index: dict[tuple[int, ...], int] = {}
        tokens: list[int] = []
        parents: list[int] = []
        for path in paths:
            for d in range(len(path)):
                key = tuple(path[: d + 1])
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(int(path[d]))
                    parents.append(index[key[:-1]] if d else -1)
        return cls(tokens, parents)

    @property
    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self.tokens) - 1))

    def children(self) -> list[list[int]]:
        """children()[0] are the root's, children()[i + 1] node i's, each in node order."""
        kids: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
        for i, p in enumerate(self.parents):
            kids[p + 1].append(i)
        return kids

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node`."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def attention_mask(self, num_known: int = 1) -> torch.Tensor:
        """[q, q] bool over the request's new tokens: `num_known` known tokens (the last is the root) attend
        causally, and each node attends to all of them, its ancestors and itself."""
        n = len(self.tokens)
        q = num_known + n
        mask = torch.zeros(q, q, dtype=torch.bool)
        mask[:num_known, :num_known] = torch.ones(num_known, num_known, dtype=torch.bool).tril()
        mask[num_known:, :num_known] = True
        for i, p in enumerate(self.parents):
            row = num_known + i
            if p >= 0:
                mask[row, num_known: num_known + n] = mask[num_known + p, num_known: num_known + n]
            mask[row, row] = True
        return mask

    def positions(self, root_position: int, num_known: int = 1) -> list[int]:
        """Positions of the new tokens: the known ones in order, then each node at root + depth."""
        first = root_position - num_known + 1
        return list(range(first, root_position + 1)) + [root_position + d for d in self.depth]


def verify_tree_greedy(tree: TokenTree, argmax: Sequence[int]) -> tuple[list[int], list[int]]:
    """argmax[0] is the target's choice at the root, argmax[i + 1] at node i. Returns (accepted path of node
    indices, emitted tokens: the path's tokens and then the target's token after it)."""
    kids = tree.children()
    path: list[int] = []
    row = 0
    while True:
        want = int(argmax[row])
        nxt = next((c for c in kids[row] if tree.tokens[c] == want), None)
        if nxt is None:
            return path, [tree.tokens[i] for i in path] + [want]
        path.append(nxt)
        row = nxt + 1


def verify_tree_sampled(tree: TokenTree, probs: torch.Tensor, generator: torch.Generator | None
                        ) -> tuple[list[int], list[int]]:
    """probs: [1 + len(tree), V] target distributions (root row first). Same result shape as the greedy rule.

    Randomness: one uniform per child tried and one final draw, from the request's generator."""
    kids = tree.children()
    path: list[int] = []
    row = 0
    while True:
        p = probs[row].double().clone()
        accepted = None
        for c in kids[row]:
            tok = tree.tokens[c]
            total = float(p.sum())
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if total > 0 and u * total < float(p[tok]):
                accepted = c
                break
            p[tok] = 0.0
        if accepted is None:
            if not float(p.sum()) > 0:  # float noise ate every other token: fall back on the row itself
                p = probs[row].double()
            tok = int(torch.multinomial(p, 1, generator=generator))
            return path, [tree.tokens[i] for i in path] + [tok]
        path.append(accepted)
        row = accepted + 1


def compaction(tree: TokenTree, path: Sequence[int], root_slot_index: int) -> tuple[list[int], list[int]]:
    """Where the accepted nodes' K/V is (flat index after the root) and where it belongs (consecutive after
    the root), as indices into the request's slot table; only pairs that differ."""
    src = [root_slot_index + 1 + node for node in path]
    dst = [root_slot_index + 1 + d for d in range(len(path))]
    moves = [(s, d) for s, d in zip(src, dst) if s != d]
    return [s for s, _ in moves], [d for _, d in moves]
