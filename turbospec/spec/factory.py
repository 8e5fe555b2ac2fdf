"""Build the proposer a SpeculativeConfig asks for."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import SpeculativeConfig
from ..models.loader import load_model
from .draft_model import DraftModelProposer, check_same_vocabulary
from .ngram import NgramProposer
from .proposer import Proposer

if TYPE_CHECKING:
    from ..engine import LLMEngine


def build_proposer(spec: SpeculativeConfig, engine: LLMEngine, progress: bool = True) -> Proposer:
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    assert spec.model is not None
    draft = load_model(spec.model, engine.dtype, engine.config.device, progress=progress)
    check_same_vocabulary(engine.tokenizer, draft.tokenizer, spec.model)
    if draft.config.vocab_size != engine.model_config.vocab_size:
        raise ValueError(f"draft model {spec.model!r} has {draft.config.vocab_size} embedding rows, the target "
                         f"{engine.model_config.vocab_size}: their logits cannot be compared")
    return DraftModelProposer(draft, engine.kv.num_blocks, engine.config.block_size, engine.dtype,
                              engine.config.device, engine.adaptive_thresholds)
