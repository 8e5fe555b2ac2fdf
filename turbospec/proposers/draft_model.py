"""A smaller model of the same tokenizer drafts for the target, with its own paged KV cache.

The draft's KV is kept in step with the target's tokens. ``computed[r]`` counts the tokens of request r
whose draft KV is valid. Proposing k tokens feeds the tokens the draft has not seen, then each new draft
token but the last. After verification, only the accepted drafts keep their KV, so ``computed`` becomes
``old_len + min(accepted, k - 1)``. Two cases follow:
- after a partial acceptance, the next step feeds just the correction token;
- after a full acceptance, the draft never saw its last token, so the next step feeds two tokens: that last
  draft and the bonus (TurboSpec Fig. 8).
When AdaSD's entropy rule stops a request's draft early, the token that tripped it is dropped but the draft
tokens before it were all fed, so its KV covers every kept draft.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..draft import Draft
from ..kv.block_manager import BlockManager
from ..kv.kv_cache import KVCache
from ..models.loader import LoadedModel
from ..models.tokenizer import Tokenizer
from ..request import Request
from ..runner import ModelRunner, SeqInput
from ..sampler import SamplingBatch, positional_sample, processed_probs, sample
from ..verification.lossy import AdaptiveThresholds, entropy
from ..verification.policies import DRAFT_DISTRIBUTION_POLICIES, STOPS_DRAFTING
from .base import Proposer
from .draft_vocab import DraftVocabulary

_PROBE = "def greet(name):\n    return f'Hello, {name}!'  # naïve café ✓ 12345"


def check_same_vocabulary(target: Tokenizer, draft: Tokenizer, draft_name: str) -> None:
    """Refuse a draft whose token ids mean other strings: its proposals would be nonsense to the target."""
    if target.vocab_size != draft.vocab_size or target.encode(_PROBE) != draft.encode(_PROBE):
        raise ValueError(
            f"draft model {draft_name!r} has a different vocabulary from the target "
            f"({draft.vocab_size} vs {target.vocab_size} tokens): a draft model must share the target's tokenizer"
        )


@dataclass
class _Pending:
    length: int  # tokens the request had when the draft was proposed
    k: int


class DraftModelProposer(Proposer):
    # the engine counts catch-up + k - 1 draft-model tokens per drafting request for the step-time model
    runs_model = True
    stops_when_unsure = True  # lossless requests stop drafting where the draft turns unsure (draft_more)
    model: LoadedModel | None = None  # the separate draft model (None when the target drafts for itself)

    def __init__(self, runner: ModelRunner, thresholds: AdaptiveThresholds | None = None) -> None:
        self.runner = runner
        self.blocks = runner.blocks
        self.thresholds = thresholds or AdaptiveThresholds.fresh()  # AdaSD's, shared with the engine
        self.computed: dict[str, int] = {}
        self.pending: dict[str, _Pending] = {}
        self.vocab: DraftVocabulary | None = None  # a cut draft vocabulary (draft_vocab.py); None: the full head

    @classmethod
    def for_model(cls, loaded: LoadedModel, num_blocks: int, block_size: int, dtype: torch.dtype, device: str,
                  thresholds: AdaptiveThresholds | None = None) -> DraftModelProposer:
        """A separate draft model with its own paged KV cache (as many blocks as the target's)."""
        kv = KVCache.allocate(loaded.config, num_blocks, block_size, dtype, device)
        blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        proposer = cls(ModelRunner(loaded.model, kv, blocks, device), thresholds)
        proposer.model = loaded
        return proposer

    def _reserve(self, req: Request, k: int) -> bool:
        """Slots for every known token plus k - 1 drafts; False when the draft's cache is full."""
        rid = req.request_id
        need = req.num_tokens + k - 1
        if not self.blocks.has_seq(rid):
            if not self.blocks.can_allocate(req.all_token_ids, 0):
                return False
            self.blocks.allocate(rid, req.all_token_ids, 0)
            self.computed[rid] = 0
        extra = need - self.blocks.num_slots(rid)
        if extra > 0:
            if not self.blocks.can_append(rid, extra):
                return False
            self.blocks.append_slots(rid, extra)
        return True

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[Draft]:
        drafts = [Draft([]) for _ in requests]
        active = [i for i, (r, k) in enumerate(zip(requests, num_tokens)) if k > 0 and self._reserve(r, k)]
        limit = list(num_tokens)  # an AdaSD stop lowers a request's limit to the drafts it keeps
        steps_run = dict.fromkeys(active, 0)
        survival = dict.fromkeys(active, 1.0)  # AdaSD: estimated chance that the drafts so far are all accepted
        expected = dict.fromkeys(active, 0.0)  # ... and their expected accepted count
        q_rows: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        soft_rows: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        for step in range(max((num_tokens[i] for i in active), default=0)):
            live = [i for i in active if limit[i] > step]
            if not live:
                break
            items = []
            for i in live:
                req = requests[i]
                steps_run[i] += 1
                if step == 0:  # catch up on everything the draft has not seen (usually 1 or 2 tokens)
                    have = self.computed[req.request_id]
                    items.append(SeqInput(req.request_id, req.all_token_ids[have:], have, 1))
                else:
                    items.append(SeqInput(req.request_id, [drafts[i].tokens[-1]], req.num_tokens + step - 1, 1))
            started = time.perf_counter()
            out = self.runner.run(items, logits=self.vocab is None)
            reqs = [requests[i] for i in live]
            logits = out.logits if self.vocab is None else self.vocab.logits(out.hidden, reqs)
            if step > 0:  # a one-token step: what one more draft token costs (step 0 also catches up)
                self.thresholds.observe_costs(draft_step_s=time.perf_counter() - started)
            batch = SamplingBatch.build([r.params for r in reqs], [r.generator for r in reqs], logits.shape[-1],
                                        device=logits.device)
            probs = processed_probs(logits, batch)
            soft, ent = self._soft(reqs, logits, probs)
            for row, (i, tok) in enumerate(zip(live, self._sample(reqs, logits, probs, batch, step))):
                req = requests[i]
                if soft is not None and req.acceptance in DRAFT_DISTRIBUTION_POLICIES:
                    if req.acceptance in STOPS_DRAFTING:  # AdaSD's generation rule (verification/lossy.py)
                        kept = self.thresholds.keep_drafting(ent[row], step, survival[i], expected[i])
                        if kept is None:  # stop where another draft token no longer pays (it is dropped)
                            limit[i] = step
                            continue
                        survival[i], expected[i] = kept, expected[i] + kept
                    soft_rows[i].append(soft[row])
                drafts[i].tokens.append(tok)
                if req.generator is not None:
                    q_rows[i].append(probs[row])
                if soft is not None and self._stops_when_unsure(req):
                    survival[i], expected[i], more = self.thresholds.draft_more(ent[row], step, survival[i],
                                                                                expected[i])
                    if not more:
                        limit[i] = step + 1
                if soft is not None and (req.acceptance in STOPS_DRAFTING or self._stops_when_unsure(req)):
                    # what a stop rule read: verification then tells the table whether this token was accepted
                    drafts[i].entropies = (drafts[i].entropies or []) + [ent[row]]
        for i in active:
            req = requests[i]
            fed = steps_run[i] - 1  # draft tokens run through the draft model (every step feeds the one before)
            self.computed[req.request_id] = req.num_tokens + fed
            self.pending[req.request_id] = _Pending(req.num_tokens, fed + 1)
            if q_rows[i]:
                drafts[i].probs = torch.stack(q_rows[i])
            if soft_rows[i]:
                drafts[i].soft_probs = torch.stack(soft_rows[i])
        return drafts

    @staticmethod
    def _sample(reqs: list[Request], logits: torch.Tensor, probs: torch.Tensor, batch: SamplingBatch,
                step: int) -> list[int]:
        """One draft token per row. A request sampled by position drafts with the very noise the target will
        sample that position with (a Gumbel coupling): where the two distributions agree the draft equals the
        target's sample, so equality acceptance keeps it; where they do not, the target's own sample stands."""
        tokens = sample(probs, batch).tolist()
        coupled = [row for row, r in enumerate(reqs) if r.samples_by_position and not r.params.greedy]
        if coupled:
            index = torch.tensor(coupled, device=logits.device)
            keys = [(reqs[row].noise_seed, reqs[row].num_tokens + step) for row in coupled]
            for row, tok in zip(coupled, positional_sample(logits[index], probs[index], keys)[0]):
                tokens[row] = tok
        return tokens

    def _soft(self, reqs: list[Request], logits: torch.Tensor, probs: torch.Tensor
              ) -> tuple[torch.Tensor | None, list[float]]:
        """The distribution AdaSD reads per row (untempered softmax for greedy rows) and its entropy, or None
        when no request of this step uses a policy that reads it."""
        if not any(r.acceptance in DRAFT_DISTRIBUTION_POLICIES or self._stops_when_unsure(r) for r in reqs):
            return None, []
        greedy = torch.tensor([r.generator is None for r in reqs], device=logits.device).unsqueeze(1)
        soft = torch.where(greedy, logits.float().softmax(dim=-1), probs)
        return soft, entropy(soft).tolist()

    def _stops_when_unsure(self, req: Request) -> bool:
        """The confidence stop applies to this request (AdaSD's policies have their own rule)."""
        return self.confidence_stop and req.acceptance not in DRAFT_DISTRIBUTION_POLICIES

    def catch_up_tokens(self, request: Request) -> int:
        return request.num_tokens - self.computed.get(request.request_id, 0)

    def forget(self, request_id: str) -> None:
        """Drop what this proposer tracks for a finished request (not its KV blocks)."""
        self.pending.pop(request_id, None)
        self.computed.pop(request_id, None)
        if self.vocab is not None:
            self.vocab.free(request_id)

    def on_verified(self, request: Request, num_accepted: int) -> None:
        rid = request.request_id
        pending = self.pending.pop(rid, None)
        if pending is None or not self.blocks.has_seq(rid):
            return
        self.computed[rid] = pending.length + min(num_accepted, pending.k - 1)
        self.blocks.truncate(rid, self.computed[rid])

    def rollback(self, request: Request, num_tokens: int) -> None:
        rid = request.request_id
        self.pending.pop(rid, None)
        if rid in self.computed and self.computed[rid] > num_tokens - 1 and self.blocks.has_seq(rid):
            self.computed[rid] = num_tokens - 1  # the last token changed: its KV is recomputed on catch-up
            self.blocks.truncate(rid, self.computed[rid])

    def free(self, request_id: str) -> None:
        self.forget(request_id)
        if self.blocks.has_seq(request_id):
            self.blocks.free(request_id)
