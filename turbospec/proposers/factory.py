"""Build the proposer a SpeculativeConfig asks for, over the target model the engine has loaded."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import HEAD_METHODS, EngineConfig, SpeculativeConfig
from ..models.llama import CausalLM
from ..models.loader import LoadedModel, load_model
from ..models.model_config import ModelConfig
from ..models.tokenizer import Tokenizer
from ..runner import ModelRunner
from ..verification.lossy import AdaptiveThresholds
from .base import Proposer
from .dart import DartDraft
from .dart_proposer import DartProposer
from .draft_model import DraftModelProposer, check_same_vocabulary
from .draft_vocab import DraftVocabulary, resolve_size
from .eagle import EagleDraft
from .head_proposer import EagleProposer, HeadProposer, TreeDrafter
from .heads import DraftHeads, head_path, read_head_file
from .layer_skip import LayerSkipProposer
from .lookahead import LookaheadProposer
from .ngram import NgramProposer

log = logging.getLogger(__name__)


@dataclass
class ProposerTarget:
    """What a proposer may build on: the engine's config, its loaded target, its runner (layer-skip drafts with
    the target's own layers), the KV blocks a draft model's cache mirrors, and AdaSD's shared thresholds."""

    config: EngineConfig
    loaded: LoadedModel
    runner: ModelRunner
    dtype: torch.dtype
    num_blocks: int
    thresholds: AdaptiveThresholds

    @property
    def tokenizer(self) -> Tokenizer:
        return self.loaded.tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self.loaded.config


def build_proposer(spec: SpeculativeConfig, target: ProposerTarget, progress: bool = True) -> Proposer:
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "lookahead":
        return LookaheadProposer(spec.lookahead_window, spec.lookahead_ngram)
    if spec.method in HEAD_METHODS:
        return _head_proposer(spec, target)
    if spec.method == "layer-skip":
        if spec.skip_layers is None:  # turbospec.tuning.build_engine loads or searches them first
            raise ValueError("layer-skip needs skip_layers: give them, or build the engine with "
                             "turbospec.tuning.build_engine, which searches them once per model (cached)")
        proposer: DraftModelProposer = LayerSkipProposer(target.runner, spec.skip_layers, target.thresholds)
        return _with_vocabulary(proposer, spec, target.loaded.model, target.tokenizer)
    assert spec.model is not None
    draft = load_model(spec.model, target.dtype, target.config.device, progress=progress,
                       weight_format=target.config.weight_format, requantize=spec.quantization == "int4")
    check_same_vocabulary(target.tokenizer, draft.tokenizer, spec.model)
    if draft.config.vocab_size != target.model_config.vocab_size:
        raise ValueError(f"draft model {spec.model!r} has {draft.config.vocab_size} embedding rows, the target "
                         f"{target.model_config.vocab_size}: their logits cannot be compared")
    proposer = DraftModelProposer.for_model(draft, target.num_blocks, target.config.block_size, target.dtype,
                                            target.config.device, target.thresholds)
    return _with_vocabulary(proposer, spec, draft.model, draft.tokenizer)


def _with_vocabulary(proposer: DraftModelProposer, spec: SpeculativeConfig, model: CausalLM,
                     tokenizer: Tokenizer) -> DraftModelProposer:
    size = resolve_size(spec.draft_vocab_size, model.cfg.vocab_size)
    if size is not None:
        proposer.vocab = DraftVocabulary.for_model(model, tokenizer, size)
    return proposer


def _head_proposer(spec: SpeculativeConfig, target: ProposerTarget) -> TreeDrafter:
    path = Path(spec.heads) if spec.heads else head_path(target.config.model, spec.method)
    if not path.exists():
        raise ValueError(f"no trained {spec.method} heads at {path}: train them with `turbospec train-head --model "
                         f"{target.config.model} --method {spec.method}` or give \"heads\": \"<file>\"")
    config, _, _ = read_head_file(path, spec.method)
    hidden, vocab, model_name = config.get("hidden_size"), config.get("vocab_size"), config.get("model")
    if hidden != target.model_config.hidden_size or vocab != target.model_config.vocab_size:
        raise ValueError(f"{path} was trained for a model with hidden size {hidden} and {vocab} tokens; this one "
                         f"has {target.model_config.hidden_size} and {target.model_config.vocab_size}")
    if model_name != target.config.model:
        log.warning("heads in %s were trained for %s, not %s: drafts may be poor (output stays exact)", path,
                    model_name, target.config.model)
    num_heads = config.get("num_heads")
    if spec.method in ("medusa", "hydra") and spec.tree_depth is not None and spec.tree_depth > num_heads:  # type: ignore[operator]
        raise ValueError(f"tree_depth {spec.tree_depth} is deeper than the {num_heads} heads in {path} (each head "
                         f"drafts one level): use at most {num_heads}, or null")
    model = target.loaded.model
    lm_weight = model.lm_head_weight
    if spec.method == "dart":
        dart, _ = DartDraft.load(path, target.dtype)
        dart.base.attach(lm_weight, model.embed.weight, model.lm_head_packed)
        log.info("dart draft (%d positions per pass, base %s, %d n-gram pairs) from %s", dart.config.depth,
                 dart.config.base, len(dart.ngram_prev), path)
        return DartProposer(dart, spec.tree_branch, spec.tree_branch, spec.tree_depth)
    if spec.method == "eagle":
        draft, _ = EagleDraft.load(path, target.dtype)
        draft.attach(lm_weight, model.embed.weight, model.lm_head_packed)
        proposer: TreeDrafter = EagleProposer(draft, spec.tree_branch, spec.tree_branch, spec.tree_depth)
        log.info("eagle draft (window %d, trained depth %d, trees %d deep, %d draft tokens) from %s",
                 draft.config.window, draft.config.depth, proposer.depth, len(draft.vocab), path)
        return proposer
    heads, _ = DraftHeads.load(path, target.dtype)
    heads.attach(lm_weight, model.embed.weight, model.lm_head_packed)
    log.info("%s: %d heads (rank %d, %d draft tokens) from %s", spec.method, heads.config.num_heads,
             heads.config.rank, len(heads.vocab), path)
    return HeadProposer(heads, spec.tree_branch, spec.tree_branch, spec.tree_depth)
