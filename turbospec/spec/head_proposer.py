"""Drafting with Medusa / Hydra heads (heads.py): a token tree per request, grown by the heads' probabilities.

The engine hands over the target's hidden state at the row that chose each request's last token. From it the
heads score continuations; the tree keeps the `k` most probable nodes (a node's score is the product of the
heads' probabilities along its path, which never exceeds its parent's, so the best k always form a tree).
This is the "dynamic tree" of EAGLE-2 with the heads' confidence standing in for acceptance:
- depth by depth, the `beam` best nodes of the depth are expanded into their `branch` most probable children
  (Medusa's children are the same for every parent at a depth, Hydra's depend on the path);
- of everything expanded, the k best nodes become the tree (k = the controller's or the fixed budget).
Requests that must verify chains (spec/tree.py accepts_trees) get the single most probable path.
Candidates are deterministic (q one-hot), so verification stays exact.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from ..request import Request
from .heads import DraftHeads
from .proposer import Draft, Proposer
from .tree import TokenTree, accepts_trees


@dataclass
class _Node:
    score: float
    token: int
    parent: int  # index into the request's node list, -1 for the root
    depth: int  # 1 for the root's children
    state: torch.Tensor | None = None  # Hydra: z at this node


class HeadProposer(Proposer):
    needs_hidden = True

    def __init__(self, heads: DraftHeads, branch: int = 4, beam: int = 4) -> None:
        self.heads = heads
        self.branch = branch
        self.beam = beam
        self.hidden: dict[str, tuple[int, torch.Tensor]] = {}  # request -> (its length then, hidden state)

    def observe_hidden(self, request: Request, hidden: torch.Tensor, num_tokens: int) -> None:
        self.hidden[request.request_id] = (num_tokens, hidden.detach())

    def free(self, request_id: str) -> None:
        self.hidden.pop(request_id, None)

    def rollback(self, request: Request, num_tokens: int) -> None:
        self.hidden.pop(request.request_id, None)

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[Draft]:
        drafts = [Draft([]) for _ in requests]
        live = []
        for i, (req, k) in enumerate(zip(requests, num_tokens)):
            seen = self.hidden.get(req.request_id)
            if k > 0 and seen is not None and seen[0] == req.num_tokens:  # stale after a preemption or a hold
                live.append(i)
        if not live:
            return drafts
        dtype = self.heads.w1[0].weight.dtype
        h = torch.stack([self.hidden[requests[i].request_id][1] for i in live]).to(dtype)
        row_of = {i: r for r, i in enumerate(live)}
        trees: dict[int, list[_Node]] = {i: [] for i in live}
        wide = {i: accepts_trees(requests[i]) for i in live}
        if not self.heads.sequential:  # Medusa: every head reads h alone, so all depths in one go
            medusa = [self._top(self.heads.step(d, h, h, None)) for d in range(self.heads.config.num_heads)]
        frontier = {i: [-1] for i in live}  # node indices to expand at the current depth (-1: the root)
        for depth in range(self.heads.config.num_heads):
            rows = [(i, n) for i in live for n in frontier[i]]
            if not rows:
                break
            if self.heads.sequential:  # Hydra: each parent's own state and token
                prev = torch.tensor([requests[i].all_token_ids[-1] if n < 0 else trees[i][n].token for i, n in rows])
                z_in = torch.stack([h[row_of[i]] if n < 0 else trees[i][n].state for i, n in rows])  # type: ignore[misc]
                z = self.heads.step(depth, z_in, z_in, prev)
                top_lp, top_tok = self._top(z)
            else:
                pick = torch.tensor([row_of[i] for i, _ in rows])
                top_lp, top_tok = medusa[depth][0][pick], medusa[depth][1][pick]
            for r, (i, n) in enumerate(rows):
                parent_score = 0.0 if n < 0 else trees[i][n].score
                for c in range(self.branch if wide[i] else 1):
                    trees[i].append(_Node(parent_score + float(top_lp[r, c]), int(top_tok[r, c]), n, depth + 1,
                                          z[r] if self.heads.sequential else None))
            for i in live:  # expand the most probable nodes of the new depth next
                fresh = [j for j, node in enumerate(trees[i]) if node.depth == depth + 1]
                frontier[i] = heapq.nlargest(self.beam if wide[i] else 1, fresh, key=lambda j, t=trees[i]: t[j].score)
        for i in live:
            k = num_tokens[i]
            nodes = trees[i]
            # the k best by score; ties go to the shallower node, so a parent always precedes its children
            chosen = heapq.nsmallest(k, range(len(nodes)), key=lambda j: (-nodes[j].score, nodes[j].depth))
            keep = set(chosen)
            chosen = [j for j in chosen if self._ancestors_kept(nodes, j, keep)]
            order = sorted(chosen, key=lambda j: (nodes[j].depth, j))
            where = {j: pos for pos, j in enumerate(order)}
            tree = TokenTree([nodes[j].token for j in order],
                             [-1 if nodes[j].parent < 0 else where[nodes[j].parent] for j in order])
            drafts[i] = Draft(tree.tokens, tree=None if tree.is_chain else tree)
        return drafts

    def _top(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The `branch` most probable draft tokens per row: (log-probabilities, target token ids)."""
        lp, ix = self.heads.logits(z).log_softmax(-1).topk(self.branch, dim=-1)
        return lp, self.heads.vocab[ix]

    @staticmethod
    def _ancestors_kept(nodes: list[_Node], j: int, keep: set[int]) -> bool:
        p = nodes[j].parent
        while p >= 0:
            if p not in keep:
                return False
            p = nodes[p].parent
        return True
