"""The verify stage of a step: every request whose rows reach the end of its known tokens gets its tokens for this
step. A request with k drafts owns k + 1 logit rows: rejection sampling over a chain (chain.py), exact tree
acceptance when its drafts branch (tree.py), positional sampling for deterministic requests
(determinism/exact.py), and the lossy policies' relaxation (lossy.py); with k = 0 it is plain sampling."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..determinism.exact import COMPETITORS, ExactDecoding, PickedRows
from ..outputs import Emitted, Logprob
from ..request import Request
from ..runner import ModelOutput
from ..sampler import SamplingBatch, processed_probs, sample, token_logprobs
from ..scheduler import SchedulerOutput
from ..speculation import Speculation
from .chain import synthetic_verify, verify
from .lossy import relax_drafts
from .policies import LOSSLESS_POLICIES, RELAXES_JS
from .tree import verify_tree_greedy, verify_tree_sampled

Results = dict[str, tuple[Emitted, int]]  # request id -> (tokens with their log-probs, drafts accepted)


@dataclass
class Verified:
    results: Results = field(default_factory=dict)
    checked: set[str] = field(default_factory=set)  # requests whose drafts were held tokens to check, not drafts
    tree_paths: dict[str, list[int]] = field(default_factory=dict)  # accepted tree paths (node indices)
    emit_rows: dict[str, list[int]] = field(default_factory=dict)  # ... and the row that chose each emitted token


class StepVerifier:
    def __init__(self, speculation: Speculation, exact: ExactDecoding, batch_invariant: bool) -> None:
        self.speculation = speculation
        self.exact = exact
        self.batch_invariant = batch_invariant
        # calibration only (tuning/margin_calibration.py): each request's top scores at every token it sampled
        self.logit_trace: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] | None = None

    def verify(self, sched: SchedulerOutput, out: ModelOutput) -> Verified:
        """Sample or verify every request that reached the end of its known tokens.

        A request with k drafts owns k + 1 logit rows; with k = 0 this is plain sampling of one row. Requests in
        a deterministic mode sample by position (determinism/exact.py), the others by their generators."""
        verified = Verified(checked={s.request.request_id for s in sched.scheduled if s.request.check_tokens})
        exact: list[PickedRows] = []
        picked: list[tuple[Request, int, int]] = []
        trees: list[tuple[Request, int, int]] = []
        for i, s in enumerate(sched.scheduled):
            if out.row_start[i] < 0:
                continue
            if s.request.draft.tree is not None and out.num_rows[i] > 1 and not s.request.check_tokens:
                trees.append((s.request, out.row_start[i], out.num_rows[i]))
            elif s.request.samples_by_position:
                invariant = self.batch_invariant or s.request.request_id in self.exact.exact_ids
                exact.append(PickedRows(s.request, out.row_start[i], out.num_rows[i], s.start + s.num_new_tokens,
                                        invariant))
            else:
                picked.append((s.request, out.row_start[i], out.num_rows[i]))
        if picked:
            verified.results.update(self._verify_sampled(picked, out.logits))
        if exact:
            verified.results.update(self.exact.verify(exact, out.logits))
        if trees:
            verified.results.update(self._verify_trees(trees, out.logits, verified))
        return verified

    def _verify_trees(self, trees: list[tuple[Request, int, int]], logits: torch.Tensor,
                      verified: Verified) -> Results:
        """Exact tree acceptance (verification/tree.py) for requests whose drafts branch; records each accepted path
        (for K/V compaction) and the row that produced the last emitted token (for heads)."""
        result: Results = {}
        for req, row, n in trees:
            assert req.draft.tree is not None and len(req.draft.tree) == n - 1
            rows = logits[row: row + n]
            argmax = rows.argmax(-1).tolist()
            if self.speculation.proposer is not None:  # lookahead reads its Jacobi window's next guesses here
                self.speculation.proposer.observe_tree(req, req.draft.tree, argmax)
            if req.generator is None:
                path, emitted = verify_tree_greedy(req.draft.tree, argmax)
            else:
                batch = SamplingBatch.build([req.params] * n, [req.generator] * n, rows.shape[-1], device=rows.device)
                path, emitted = verify_tree_sampled(req.draft.tree, processed_probs(rows, batch), req.generator)
            emit_rows = [0] + [node + 1 for node in path]  # the row each emitted token was chosen from
            logprobs = token_logprobs([req] * len(emitted), rows[torch.tensor(emit_rows, device=rows.device)],
                                      torch.tensor(emitted, device=rows.device))
            verified.tree_paths[req.request_id] = path
            verified.emit_rows[req.request_id] = emit_rows
            result[req.request_id] = (list(zip(emitted, logprobs)), len(path))
        return result

    def _verify_sampled(self, picked: list[tuple[Request, int, int]], all_logits: torch.Tensor
                        ) -> Results:
        """Rejection sampling (or plain sampling) with each request's own generator, over its rows."""
        index = [row + j for _, row, n in picked for j in range(n)]
        logits = all_logits if len(index) == all_logits.shape[0] else all_logits[torch.tensor(index, device=all_logits.device)]
        starts = [0]
        for _, _, n in picked[:-1]:
            starts.append(starts[-1] + n)
        picked = [(r, start, n) for (r, _, n), start in zip(picked, starts)]
        row_params = [r.params for r, _, n in picked for _ in range(n)]
        row_gens = [r.generator for r, _, n in picked for _ in range(n)]
        batch = SamplingBatch.build(row_params, row_gens, logits.shape[-1], device=logits.device)
        probs = processed_probs(logits, batch)
        reqs = [r for r, _, _ in picked]
        if all(n == 1 for _, _, n in picked):  # nobody speculated: plain sampling, one row each
            emitted = [[t] for t in sample(probs, batch).tolist()]
            accepted = [0] * len(reqs)
        elif self.speculation.synthetic_acceptance is not None:
            emitted, accepted = synthetic_verify(probs, [row for _, row, _ in picked],
                                                 [r.draft.tokens[: n - 1] for r, _, n in picked],
                                                 self.speculation.synthetic_acceptance, self.speculation.rng)
        else:
            drafts = [r.draft.tokens[: n - 1] for r, _, n in picked]
            starts = [row for _, row, _ in picked]
            relaxed, distances = self._relaxation(picked, drafts, logits, probs)
            result = verify(probs, starts, drafts,
                            [None if r.draft.probs is None else r.draft.probs[: n - 1] for r, _, n in picked],
                            [r.generator for r in reqs], relaxed)
            emitted, accepted = result.tokens, result.num_accepted
            if relaxed is not None or any(r.draft.entropies for r in reqs):  # (a stop rule read entropies)
                self._observe_relaxation(reqs, drafts, accepted, result.exact_accepted, distances)
        if self.logit_trace is not None:  # calibration: each request's top scores at the token it sampled
            for r, row, n in picked:
                top = logits[row + n - 1].float().topk(COMPETITORS + 1)
                self.logit_trace.setdefault(r.request_id, []).append((top.indices, top.values))
        row_reqs = [r for r, toks in zip(reqs, emitted) for _ in toks]
        logprobs: list[dict[int, Logprob] | None] = [None] * len(row_reqs)
        if any(r.params.logprobs is not None for r in reqs):
            rows = [row + j for (_, row, _), toks in zip(picked, emitted) for j in range(len(toks))]
            flat = [t for toks in emitted for t in toks]
            logprobs = token_logprobs(row_reqs, logits[torch.tensor(rows, device=logits.device)],
                                      torch.tensor(flat, device=logits.device))
        result_map: Results = {}
        pos = 0
        for req, toks, acc in zip(reqs, emitted, accepted):
            result_map[req.request_id] = (list(zip(toks, logprobs[pos: pos + len(toks)])), acc)
            pos += len(toks)
        return result_map

    def _relaxation(self, picked: list[tuple[Request, int, int]], drafts: list[list[int]], logits: torch.Tensor,
                    probs: torch.Tensor) -> tuple[torch.Tensor | None, list[float]]:
        """Positions lossy acceptance policies keep whatever the exact rule says (verification/lossy.py), or None
        when no request of this step uses one."""
        policies = [r.acceptance for r, _, _ in picked]
        if all(p in LOSSLESS_POLICIES for p, d in zip(policies, drafts) if d):
            return None, []
        greedy = torch.tensor([r.generator is None for r, _, n in picked for _ in range(n)], device=logits.device)
        criterion = torch.where(greedy.unsqueeze(1), logits.float().softmax(dim=-1), probs)
        assert self.speculation.spec is not None
        return relax_drafts(policies, [row for _, row, _ in picked], drafts, criterion,
                            [r.draft.soft_probs for r, _, _ in picked], self.speculation.thresholds,
                            self.speculation.spec.typical_epsilon, self.speculation.spec.typical_delta)

    def _observe_relaxation(self, reqs: list[Request], drafts: list[list[int]], accepted: list[int],
                            exact: list[bool], distances: list[float]) -> None:
        """Count relaxed tokens and feed AdaSD's thresholds from the positions verification reached."""
        pos = 0
        for req, toks, n_acc in zip(reqs, drafts, accepted):
            k = len(toks)
            reached = min(n_acc + 1, k)  # accepted drafts, plus the first rejected one
            flags = exact[pos: pos + k]
            relaxed = sum(1 for ok in flags[:n_acc] if not ok)
            req.relaxed_tokens += relaxed
            self.speculation.stats.num_relaxed_tokens += relaxed
            if req.acceptance in RELAXES_JS:
                self.speculation.thresholds.observe_verification(distances[pos: pos + reached], flags[:reached])
            if req.draft.entropies:  # AdaSD's rule or the confidence stop read these: both learn from them
                self.speculation.thresholds.observe_generation(req.draft.entropies[:reached],
                                                            [j < n_acc for j in range(reached)])
            pos += k
