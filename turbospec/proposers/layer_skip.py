"""Layer-skip self-speculation (Self-SpecDec, 2309.08168): the target drafts for itself with some layers skipped.

No second model and no second KV cache. The draft runs the kept layers over the target's own paged cache:
- the tokens before the request's last one already have the full model's K/V in every layer, and the draft
  reads them as they are (the kept layers see exactly what they would see in the full model);
- the draft writes its own K/V for the last token and its draft tokens into the kept layers' slots, which
  the scheduler has already reserved for this step's verification. The verification forward then rewrites
  those slots in every layer before anything reads them, so the target's cache is never left with draft K/V
  at an accepted position.
So a draft step costs (kept layers / all layers) of a target step, with no catch-up prefill for new
requests, and the verifier stays exact: output equals plain decoding.

Which layers to skip comes from `search_skip_layers` (tuning/layer_search.py), cached per model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..models.llama import CausalLM
from ..request import Request
from ..runner import ModelRunner
from ..verification.lossy import AdaptiveThresholds
from .draft_model import DraftModelProposer


@dataclass
class SkippingModel:
    """The target run through `kept` layers only; called by a ModelRunner like a model."""

    target: CausalLM
    kept: list[int]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, kv_caches) -> torch.Tensor:
        return self.target(input_ids, positions, meta, kv_caches, layer_ids=self.kept)

    def compute_logits(self, hidden: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        return self.target.compute_logits(hidden, invariant)


def kept_layers(num_layers: int, skip: Sequence[int]) -> list[int]:
    bad = sorted(i for i in skip if not 0 <= i < num_layers)
    if bad:
        raise ValueError(f"skip_layers {bad} out of range: the model has layers 0..{num_layers - 1}")
    kept = [i for i in range(num_layers) if i not in set(skip)]
    if not kept:
        raise ValueError("skip_layers names every layer: the draft must keep at least one")
    return kept


class LayerSkipProposer(DraftModelProposer):
    """The draft-model loop (sampling, AdaSD's stop rule) over the target with layers skipped."""

    def __init__(self, runner: ModelRunner, skip: Sequence[int], thresholds: AdaptiveThresholds | None = None
                 ) -> None:
        target = runner.model
        assert isinstance(target, CausalLM)
        self.skip = sorted(skip)
        self.kept = kept_layers(len(target.layers), skip)
        draft_runner = ModelRunner(SkippingModel(target, self.kept), runner.kv, runner.blocks,  # type: ignore[arg-type]
                                   runner.device, compute_dtype=runner.compute_dtype)
        super().__init__(draft_runner, thresholds)

    @property
    def cost_fraction(self) -> float:
        """A draft step's layers as a share of the target's (the LM head is run by both)."""
        return len(self.kept) / (len(self.kept) + len(self.skip))

    def _reserve(self, req: Request, k: int) -> bool:
        """The target's slots for this step's verification hold the draft too (the scheduler reserved them);
        only the request's last token lacks K/V, so that is all the draft catches up on."""
        if self.blocks.num_slots(req.request_id) < req.num_tokens + k - 1:
            return False
        self.computed[req.request_id] = req.num_tokens - 1
        return True

    def catch_up_tokens(self, request: Request) -> int:
        return 1

    # The target's KV and blocks belong to the engine: nothing to truncate or free here.
    def on_verified(self, request: Request, num_accepted: int) -> None:
        self.pending.pop(request.request_id, None)

    def rollback(self, request: Request, num_tokens: int) -> None:
        self.pending.pop(request.request_id, None)

    def free(self, request_id: str) -> None:
        self.forget(request_id)
