"""How long a sequence may be and how many KV blocks the cache holds, from the config and the model."""

from __future__ import annotations

import math

import torch

from ..config import EngineConfig
from ..models.model_config import ModelConfig
from .kv_cache import KVCache

DEFAULT_KV_BUDGET_GIB = 4.0
CPU_MAX_MODEL_LEN = 4096


def max_model_len(config: EngineConfig, model: ModelConfig) -> int:
    """The configured length, else the model's context capped at CPU_MAX_MODEL_LEN (KV memory on a CPU host)."""
    limit = model.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > limit:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's context length {limit}")
    return config.max_model_len or min(limit, CPU_MAX_MODEL_LEN)


def num_kv_blocks(config: EngineConfig, kv_config: ModelConfig, max_len: int, dtype: torch.dtype) -> int:
    """kv_cache_memory_gib's worth of blocks, else enough for max_num_seqs full sequences within
    DEFAULT_KV_BUDGET_GIB; never fewer than one full sequence needs."""
    per_block = KVCache.bytes_per_block(kv_config, config.block_size, dtype)
    per_seq = math.ceil(max_len / config.block_size)
    if config.kv_cache_memory_gib is not None:
        blocks = int(config.kv_cache_memory_gib * 2**30 // per_block)
    else:
        blocks = min(config.max_num_seqs * per_seq, int(DEFAULT_KV_BUDGET_GIB * 2**30 // per_block))
    if blocks < per_seq:
        raise ValueError(
            f"the KV cache holds {blocks} blocks of {config.block_size} tokens, fewer than one sequence of "
            f"max_model_len={max_len} needs ({per_seq}): raise kv_cache_memory_gib or lower max_model_len"
        )
    return blocks
