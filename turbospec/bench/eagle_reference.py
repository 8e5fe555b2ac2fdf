"""The EAGLE proposer as it drafted before each tree node's entry was kept: every expanded row runs the draft layer
over its whole window and path again. The reference the incremental `EagleProposer` is tested against
(tests/proposers/test_heads.py) and timed against (benchmarks/eagle_draft_cost.py)."""

from __future__ import annotations

import torch

from ..proposers.eagle import window_mask
from ..proposers.head_proposer import EagleProposer, Rows, _Node
from ..request import Request


class RecomputingEagleProposer(EagleProposer):
    def _expand(self, requests: list[Request], rows: Rows, trees: dict[int, list[_Node]], depth: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        seqs = []
        for i, n in rows:  # the window, then the path down to this node (each node: the state that drafted it)
            path = []
            while n >= 0:
                path.append((trees[i][n].state, trees[i][n].token))
                n = trees[i][n].parent
            seqs.append(self.windows([requests[i].request_id])[0] + path[::-1])
        states, tokens, valid = self._batch(seqs)
        out = self.draft(states, tokens, window_mask(valid))[0][:, -1]
        return (*self._top(self.draft.logits(out), self.draft.vocab), out)
