"""Engine-wide options, validated once. Every user-facing engine option lives here (no torch import)."""

from __future__ import annotations

import os
from dataclasses import dataclass

DTYPE_NAMES = ("bfloat16", "bf16", "float32", "fp32", "float16", "fp16")


@dataclass
class EngineConfig:
    """How the engine batches, caches and runs. Names follow vLLM where vLLM has the option."""

    model: str
    dtype: str = "bfloat16"
    max_model_len: int | None = None  # default: the model's context length, capped at 4096 on CPU
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    block_size: int = 16
    enable_prefix_caching: bool = True
    # KV cache size in GiB; None sizes it to hold max_num_seqs full-length sequences, capped at 4 GiB.
    kv_cache_memory_gib: float | None = None
    num_threads: int | None = None
    device: str = "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"unknown dtype {self.dtype!r}: expected one of bfloat16, float32, float16")
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("block_size", self.block_size)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.kv_cache_memory_gib is not None and not self.kv_cache_memory_gib > 0:
            raise ValueError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib}")
        if self.num_threads is not None:
            _positive("num_threads", self.num_threads)
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"unknown device {self.device!r}: expected 'cpu' or 'cuda[:N]'")

    @property
    def threads(self) -> int:
        return self.num_threads or os.cpu_count() or 1


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
