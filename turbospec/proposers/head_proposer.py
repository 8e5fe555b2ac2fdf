"""Drafting from the target's hidden states (Medusa / Hydra heads, EAGLE): a token tree per request, grown by the
draft's own probabilities.

The engine hands over, per emitted token, the target's hidden state at the row that chose it. From them the
draft scores continuations; the tree keeps the `k` most probable nodes (a node's score is the product of the
draft's probabilities along its path, times DART's n-gram term where it applies: never above its parent's, so the
best k always form a tree).
This is EAGLE-2's dynamic tree with the draft's confidence standing in for acceptance:
- depth by depth, the `beam` best nodes of the depth are expanded into their `branch` most probable children
  (Medusa's children are the same for every parent at a depth; Hydra's and EAGLE's depend on the path);
- of everything expanded, the k best nodes become the tree (k = the controller's or the fixed budget).
Requests that must verify chains (Request.accepts_trees) get the single most probable path.
Candidates are deterministic (q one-hot), so verification stays exact.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

import torch

from ..draft import Draft
from ..request import Request
from ..verification.tree import TokenTree
from .base import Proposer
from .eagle import EagleDraft, window_mask
from .heads import DraftHeads

Rows = list[tuple[int, int]]  # (request index, node index or -1 for the root) to expand at one depth


@dataclass
class _Node:
    score: float
    token: int
    parent: int  # index into the request's node list, -1 for the root
    depth: int  # 1 for the root's children
    state: torch.Tensor | None = None  # the draft's state that predicted this node (Hydra, EAGLE)
    # EAGLE: keys and values [heads, P, head dim] of the entries up to this node's own (the window, its ancestors',
    # its own), set when it is expanded: its children's expansions attend to them without computing them again
    entries: tuple[torch.Tensor, torch.Tensor] | None = None


class TreeDrafter(Proposer):
    """Grows the trees; subclasses say how one depth of nodes is expanded (`_expand`)."""

    needs_hidden = True
    ranks_nodes = True

    def __init__(self, depth: int, branch: int = 4, beam: int = 4) -> None:
        self.depth = depth
        self.branch = branch
        self.beam = beam
        self.seen: dict[str, int] = {}  # request -> its length when its hidden states were last observed

    @property
    def tree_levels(self) -> int:  # type: ignore[override]
        return self.depth

    def free(self, request_id: str) -> None:
        self.seen.pop(request_id, None)

    def rollback(self, request: Request, num_tokens: int) -> None:
        self.free(request.request_id)

    def _expand(self, requests: list[Request], rows: Rows, trees: dict[int, list[_Node]], depth: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """For each row: the `branch` best children's log-probabilities and target token ids, and the draft
        state their own expansion starts from ([rows, H], or None when expansion does not need one)."""
        raise NotImplementedError

    def _ready(self, req: Request) -> bool:
        return self.seen.get(req.request_id) == req.num_tokens  # stale after a preemption or a hold

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[Draft]:
        drafts = [Draft([]) for _ in requests]
        live = [i for i, (req, k) in enumerate(zip(requests, num_tokens)) if k > 0 and self._ready(req)]
        trees: dict[int, list[_Node]] = {i: [] for i in live}
        wide = {i: requests[i].accepts_trees for i in live}
        frontier = {i: [-1] for i in live}  # node indices to expand at the current depth (-1: the root)
        for depth in range(self.draft_levels(max((num_tokens[i] for i in live), default=0))):
            rows = [(i, n) for i in live for n in frontier[i]]
            if not rows:
                break
            top_lp, top_tok, states = self._expand(requests, rows, trees, depth)
            for r, (i, n) in enumerate(rows):
                parent_score = 0.0 if n < 0 else trees[i][n].score
                for c in range(self.branch if wide[i] else 1):
                    trees[i].append(_Node(parent_score + float(top_lp[r, c]), int(top_tok[r, c]), n, depth + 1,
                                          None if states is None else states[r]))
            for i in live:  # expand the most probable nodes of the new depth next
                fresh = [j for j, node in enumerate(trees[i]) if node.depth == depth + 1]
                frontier[i] = heapq.nlargest(self.beam if wide[i] else 1, fresh, key=lambda j, t=trees[i]: t[j].score)
        for i in live:
            drafts[i] = _best_tree(trees[i], num_tokens[i])
        return drafts

    def _top(self, logits: torch.Tensor, vocab: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The `branch` most probable draft tokens per row: (log-probabilities, target token ids)."""
        lp, ix = logits.log_softmax(-1).topk(self.branch, dim=-1)
        return lp, vocab[ix]


def _best_tree(nodes: list[_Node], k: int) -> Draft:
    # the k best by score; ties go to the shallower node, so a parent always precedes its children
    keep = set(heapq.nsmallest(k, range(len(nodes)), key=lambda j: (-nodes[j].score, nodes[j].depth, j)))
    chosen = [j for j in keep if _ancestors_kept(nodes, j, keep)]
    order = sorted(chosen, key=lambda j: (nodes[j].depth, j))
    where = {j: pos for pos, j in enumerate(order)}
    by_score = sorted(chosen, key=lambda j: (-nodes[j].score, nodes[j].depth, j))
    rank = {j: r for r, j in enumerate(by_score)}
    tree = TokenTree([nodes[j].token for j in order],
                     [-1 if nodes[j].parent < 0 else where[nodes[j].parent] for j in order],
                     [rank[j] for j in order])
    # a chain's ranks are its depths (scores only fall along a path): verified on the linear path
    return Draft(tree.tokens, tree=None if tree.is_chain else tree)


def _ancestors_kept(nodes: list[_Node], j: int, keep: set[int]) -> bool:
    p = nodes[j].parent
    while p >= 0:
        if p not in keep:
            return False
        p = nodes[p].parent
    return True


class HeadProposer(TreeDrafter):
    """Medusa / Hydra heads (heads.py) on the hidden state that chose the request's last token."""

    def __init__(self, heads: DraftHeads, branch: int = 4, beam: int = 4, depth: int | None = None) -> None:
        super().__init__(depth or heads.config.num_heads, branch, beam)
        self.heads = heads
        self.hidden: dict[str, torch.Tensor] = {}

    def observe_hidden(self, request: Request, hidden: torch.Tensor, tokens: list[int], num_tokens: int) -> None:
        self.hidden[request.request_id] = hidden[-1].detach()  # the row that chose the last token
        self.seen[request.request_id] = num_tokens

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self.hidden.pop(request_id, None)

    def _expand(self, requests: list[Request], rows: Rows, trees: dict[int, list[_Node]], depth: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        dtype = self.heads.w1[0].weight.dtype
        if not self.heads.sequential:  # Medusa: head `depth` reads h alone, whatever the parent
            h = torch.stack([self.hidden[requests[i].request_id] for i, _ in rows]).to(dtype)
            return (*self._top(self.heads.logits(self.heads.step(depth, h, h, None)), self.heads.vocab), None)
        # Hydra: each parent's own state and token (the root's: the hidden state and the last known token)
        prev = torch.tensor([requests[i].all_token_ids[-1] if n < 0 else trees[i][n].token for i, n in rows])
        z_in = torch.stack([self.hidden[requests[i].request_id].to(dtype) if n < 0 else trees[i][n].state
                            for i, n in rows])  # type: ignore[misc]
        z = self.heads.step(depth, z_in, z_in, prev)
        return (*self._top(self.heads.logits(z), self.heads.vocab), z)


class EagleProposer(TreeDrafter):
    """The EAGLE-style draft layer (eagle.py) over a window of the request's recent fused target features."""

    def __init__(self, draft: EagleDraft, branch: int = 4, beam: int = 4, depth: int | None = None) -> None:
        super().__init__(depth or draft.config.depth, branch, beam)  # deeper than trained: the layer reads itself
        self.draft = draft
        self.capture_layers = tuple(draft.config.feature_layers)
        # request -> (feature, token) entries. A feature stays the target's captured rows [(c + 1) H] until the
        # request drafts from it, then becomes the fused state [H]: a step where requests draft fuses all their
        # new entries in one call, which reads the fuse weights ((c + 1) H x H: 14 MB on a 1.5B model) once, and a
        # request at k = 0 fuses nothing. Fusing at every observation cost one read per request and step.
        self.window: dict[str, deque[tuple[torch.Tensor, int]]] = {}
        self.unfused: dict[str, int] = {}  # request -> how many of its window's last entries are still features
        # request index -> its window's keys and values [heads, T, head dim], set at each propose call's root level
        self._window_entries: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def observe_hidden(self, request: Request, hidden: torch.Tensor, tokens: list[int], num_tokens: int) -> None:
        rid = request.request_id
        entries = self.window.setdefault(rid, deque(maxlen=self.draft.config.window))
        unfused = self.unfused.get(rid, 0)
        if self.seen.get(rid) != num_tokens - len(tokens):  # a gap (preemption): start afresh
            entries.clear()
            unfused = 0
        entries.extend(zip(hidden, tokens))
        self.unfused[rid] = min(len(entries), unfused + len(tokens))
        self.seen[rid] = num_tokens

    def windows(self, request_ids: list[str]) -> list[list[tuple[torch.Tensor, int]]]:
        """These requests' windows of (fused state, token) entries, fusing the features observed since each one
        last drafted in one batched call."""
        pending = [(rid, n) for rid in request_ids if (n := self.unfused.get(rid, 0))]
        if pending:
            features = torch.stack([self.window[rid][j][0] for rid, n in pending
                                    for j in range(len(self.window[rid]) - n, len(self.window[rid]))])
            states = iter(self.draft.fuse(features.to(self.draft.qkv.weight.dtype)))
            for rid, n in pending:
                entries = self.window[rid]
                for j in range(len(entries) - n, len(entries)):
                    entries[j] = (next(states), entries[j][1])
                self.unfused[rid] = 0
        return [list(self.window[rid]) for rid in request_ids]

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self.window.pop(request_id, None)
        self.unfused.pop(request_id, None)

    def _batch(self, seqs: list[list[tuple[torch.Tensor, int]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(state, token) entry lists -> states [R, T, H], tokens [R, T] and valid [R, T], right-aligned: every
        row's last entry is the last column (padding on the left)."""
        length = max(len(s) for s in seqs)
        states = torch.zeros(len(seqs), length, self.draft.config.hidden_size, dtype=self.draft.qkv.weight.dtype)
        tokens = torch.zeros(len(seqs), length, dtype=torch.long)
        valid = torch.zeros(len(seqs), length, dtype=torch.bool)
        for r, seq in enumerate(seqs):
            pad = length - len(seq)
            states[r, pad:] = torch.stack([s for s, _ in seq])
            tokens[r, pad:] = torch.tensor([t for _, t in seq])
            valid[r, pad:] = True
        return states, tokens, valid

    def _expand(self, requests: list[Request], rows: Rows, trees: dict[int, list[_Node]], depth: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The root level runs the layer over each request's window and keeps its keys and values; every deeper
        level computes one entry per row, the expanded node's, attending to its parent's kept entries (the
        window's at depth 1). Causal attention makes that the same as running the window and the path again
        (`bench/eagle_reference.py`; benchmarks/eagle_draft_cost.py times both)."""
        if depth == 0:
            states, tokens, valid = self._batch(self.windows([requests[i].request_id for i, _ in rows]))
            outs, (keys, values) = self.draft(states, tokens, window_mask(valid))
            self._window_entries = {i: (keys[r][:, valid[r]], values[r][:, valid[r]]) for r, (i, _) in enumerate(rows)}
        else:
            nodes = [trees[i][n] for i, n in rows]
            pasts = [self._kept(trees[i], node, i) for (i, _), node in zip(rows, nodes)]
            longest = max(k.shape[1] for k, _ in pasts)
            heads, _, dim = pasts[0][0].shape
            past_k = pasts[0][0].new_zeros(len(rows), heads, longest, dim)
            past_v = torch.zeros_like(past_k)
            mask = torch.zeros(len(rows), 1, longest + 1, dtype=torch.bool)
            for r, (k, v) in enumerate(pasts):  # left padding: the new entry is every row's last key
                past_k[r, :, longest - k.shape[1]:] = k
                past_v[r, :, longest - k.shape[1]:] = v
                mask[r, 0, longest - k.shape[1]:] = True
            states = torch.stack([node.state for node in nodes])[:, None]  # type: ignore[misc]
            tokens = torch.tensor([[node.token] for node in nodes])
            outs, (keys, values) = self.draft(states, tokens, mask, (past_k, past_v))
            for r, node in enumerate(nodes):
                node.entries = (keys[r][:, mask[r, 0]], values[r][:, mask[r, 0]])
        out = outs[:, -1]
        return (*self._top(self.draft.logits(out), self.draft.vocab), out)

    def _kept(self, nodes: list[_Node], node: _Node, request: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values a node's expansion attends to: its parent's, or the window's under the root."""
        kept = self._window_entries[request] if node.parent < 0 else nodes[node.parent].entries
        assert kept is not None, "a parent is expanded before its children"
        return kept
