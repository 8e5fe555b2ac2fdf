"""Drafting with a DART-style parallel draft (dart.py): one forward per step, then an n-gram-guided tree search.

The request's window of fused target features is kept as for EAGLE (`EagleProposer.observe_hidden`). At the
first tree level one pass of the draft gives, for every live request, the `candidates` most probable draft tokens
at each of the `depth` positions ahead. The tree then grows level by level as TreeDrafter grows every tree (beam
of the best nodes, their `branch` best children, the k best nodes kept), a child's score adding to its parent's
the draft's log-probability of the token at that position plus `ngram_weight` x the n-gram log-probability of
the token after its parent's (DART's n-gram-enforced continuity): the draft cannot tell which position-wise
choices fit together, the n-gram can. Candidates stay deterministic (q one-hot), so verification is exact.
"""

from __future__ import annotations

from collections import Counter

import torch

from ..draft import Draft
from ..request import Request
from .dart import DartDraft, NgramScorer
from .head_proposer import EagleProposer, Rows, _Node


class DartProposer(EagleProposer):
    def __init__(self, draft: DartDraft, branch: int = 4, beam: int = 4, depth: int | None = None,
                 candidates: int = 8, ngram_weight: float = 0.5) -> None:
        if depth is not None and not 1 <= depth <= draft.config.depth:
            raise ValueError(f"a DART draft predicting {draft.config.depth} positions grows trees 1 to "
                             f"{draft.config.depth} deep, not {depth}")
        super().__init__(draft.base, branch, beam, depth or draft.config.depth)
        self.dart = draft
        self.candidates = max(candidates, branch)
        self.ngram_weight = ngram_weight
        self.ngram = NgramScorer(dict(draft.named_buffers()), len(draft.vocab))  # its only buffers: the table
        # request -> (pair counts, previous-token counts, tokens counted) of its own tokens
        self.context: dict[str, tuple[Counter[tuple[int, int]], Counter[int], int]] = {}
        self.position_top: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # request index -> (log p, ids) [d, c]

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self.context.pop(request_id, None)

    def _count_context(self, req: Request) -> Counter[tuple[int, int]]:
        """Add the request's pairs not counted yet; its pair counts."""
        pairs, totals, counted = self.context.get(req.request_id, (Counter(), Counter(), 0))
        ids = req.all_token_ids
        if counted > len(ids):  # tokens were taken back without a rollback notice: count afresh
            pairs, totals, counted = Counter(), Counter(), 0
        for p, c in zip(ids[max(0, counted - 1):-1], ids[max(1, counted):]):
            pairs[(p, c)] += 1
            totals[p] += 1
        self.context[req.request_id] = (pairs, totals, len(ids))
        return pairs

    def _draft_positions(self, requests: list[Request], live: list[int]) -> None:
        """One draft pass for these requests: the best `candidates` tokens at every position ahead."""
        states, tokens, valid = self._batch(self.windows([requests[i].request_id for i in live]))
        log_p = self.draft.logits(self.dart(states, tokens, valid)).float().log_softmax(-1)  # [R, d, Vd]
        top_lp, top_ix = log_p.topk(min(self.candidates, log_p.shape[-1]), dim=-1)
        self.position_top = {i: (top_lp[r], self.draft.vocab[top_ix[r]]) for r, i in enumerate(live)}

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[Draft]:
        try:
            return super().propose(requests, num_tokens)
        finally:
            self.position_top = {}  # this call's only

    def _expand(self, requests: list[Request], rows: Rows, trees: dict[int, list[_Node]], depth: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if depth == 0:  # the root level: every live request's tree starts here
            live = sorted({i for i, _ in rows})
            self._draft_positions(requests, live)
            for i in live:
                self._count_context(requests[i])
        lps, toks = [], []
        for i, n in rows:
            pairs, totals, _ = self.context[requests[i].request_id]
            prev = requests[i].all_token_ids[-1] if n < 0 else trees[i][n].token
            cand_lp, cand_tok = self.position_top[i][0][depth], self.position_top[i][1][depth]
            bonus = torch.tensor([self.ngram.log_prob(prev, t, pairs, totals) for t in cand_tok.tolist()])
            score, order = (cand_lp + self.ngram_weight * bonus).topk(self.branch)
            lps.append(score)
            toks.append(cand_tok[order])
        return torch.stack(lps), torch.stack(toks), None
