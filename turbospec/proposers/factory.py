"""Build the proposer a SpeculativeConfig asks for."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import HEAD_METHODS, SpeculativeConfig
from ..models.llama import CausalLM
from ..models.loader import load_model
from ..models.tokenizer import Tokenizer
from .dart import DartDraft
from .dart_proposer import DartProposer
from .draft_model import DraftModelProposer, check_same_vocabulary
from .draft_vocab import DraftVocabulary, resolve_size
from .eagle import EagleDraft
from .head_proposer import EagleProposer, HeadProposer, TreeDrafter
from .heads import DraftHeads, head_path, read_head_file
from ..tuning.layer_search import load_or_search
from .layer_skip import LayerSkipProposer
from .lookahead import LookaheadProposer
from .ngram import NgramProposer
from .base import Proposer

if TYPE_CHECKING:
    from ..engine import LLMEngine

log = logging.getLogger(__name__)


def build_proposer(spec: SpeculativeConfig, engine: LLMEngine, progress: bool = True) -> Proposer:
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "lookahead":
        return LookaheadProposer(spec.lookahead_window, spec.lookahead_ngram)
    if spec.method in HEAD_METHODS:
        return _head_proposer(spec, engine)
    if spec.method == "layer-skip":
        skip = spec.skip_layers
        if skip is None:
            plan = load_or_search(engine, progress)
            log.info("layer-skip draft skips layers %s (searched: acceptance %.2f, cost %.2f of a step)",
                     plan.skip, plan.agreement, plan.cost_fraction)
            skip = plan.skip
        proposer: DraftModelProposer = LayerSkipProposer(engine.runner, skip, engine.adaptive_thresholds)
        return _with_vocabulary(proposer, spec, engine.loaded.model, engine.tokenizer)
    assert spec.model is not None
    draft = load_model(spec.model, engine.dtype, engine.config.device, progress=progress,
                       weight_format=engine.config.weight_format, requantize=spec.quantization == "int4")
    check_same_vocabulary(engine.tokenizer, draft.tokenizer, spec.model)
    if draft.config.vocab_size != engine.model_config.vocab_size:
        raise ValueError(f"draft model {spec.model!r} has {draft.config.vocab_size} embedding rows, the target "
                         f"{engine.model_config.vocab_size}: their logits cannot be compared")
    proposer = DraftModelProposer.for_model(draft, engine.kv.num_blocks, engine.config.block_size, engine.dtype,
                                            engine.config.device, engine.adaptive_thresholds)
    return _with_vocabulary(proposer, spec, draft.model, draft.tokenizer)


def _with_vocabulary(proposer: DraftModelProposer, spec: SpeculativeConfig, model: CausalLM,
                     tokenizer: Tokenizer) -> DraftModelProposer:
    size = resolve_size(spec.draft_vocab_size, model.cfg.vocab_size)
    if size is not None:
        proposer.vocab = DraftVocabulary.for_model(model, tokenizer, size)
    return proposer


def _head_proposer(spec: SpeculativeConfig, engine: LLMEngine) -> TreeDrafter:
    path = Path(spec.heads) if spec.heads else head_path(engine.config.model, spec.method)
    if not path.exists():
        raise ValueError(f"no trained {spec.method} heads at {path}: train them with `turbospec train-head --model "
                         f"{engine.config.model} --method {spec.method}` or give \"heads\": \"<file>\"")
    config, _, _ = read_head_file(path, spec.method)
    hidden, vocab, model_name = config.get("hidden_size"), config.get("vocab_size"), config.get("model")
    if hidden != engine.model_config.hidden_size or vocab != engine.model_config.vocab_size:
        raise ValueError(f"{path} was trained for a model with hidden size {hidden} and {vocab} tokens; this one "
                         f"has {engine.model_config.hidden_size} and {engine.model_config.vocab_size}")
    if model_name != engine.config.model:
        log.warning("heads in %s were trained for %s, not %s: drafts may be poor (output stays exact)", path,
                    model_name, engine.config.model)
    num_heads = config.get("num_heads")
    if spec.method in ("medusa", "hydra") and spec.tree_depth is not None and spec.tree_depth > num_heads:  # type: ignore[operator]
        raise ValueError(f"tree_depth {spec.tree_depth} is deeper than the {num_heads} heads in {path} (each head "
                         f"drafts one level): use at most {num_heads}, or null")
    model = engine.loaded.model
    lm_weight = model.lm_head_weight
    if spec.method == "dart":
        dart, _ = DartDraft.load(path, engine.dtype)
        dart.base.attach(lm_weight, model.embed.weight, model.lm_head_packed)
        log.info("dart draft (%d positions per pass, base %s, %d n-gram pairs) from %s", dart.config.depth,
                 dart.config.base, len(dart.ngram_prev), path)
        return DartProposer(dart, spec.tree_branch, spec.tree_branch, spec.tree_depth)
    if spec.method == "eagle":
        draft, _ = EagleDraft.load(path, engine.dtype)
        draft.attach(lm_weight, model.embed.weight, model.lm_head_packed)
        proposer: TreeDrafter = EagleProposer(draft, spec.tree_branch, spec.tree_branch, spec.tree_depth)
        log.info("eagle draft (window %d, trained depth %d, trees %d deep, %d draft tokens) from %s",
                 draft.config.window, draft.config.depth, proposer.depth, len(draft.vocab), path)
        return proposer
    heads, _ = DraftHeads.load(path, engine.dtype)
    heads.attach(lm_weight, model.embed.weight, model.lm_head_packed)
    log.info("%s: %d heads (rank %d, %d draft tokens) from %s", spec.method, heads.config.num_heads,
             heads.config.rank, len(heads.vocab), path)
    return HeadProposer(heads, spec.tree_branch, spec.tree_branch, spec.tree_depth)
