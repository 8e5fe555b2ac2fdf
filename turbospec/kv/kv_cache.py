"""The paged KV tensors: per layer, one flat tensor of slots for keys and one for values."""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from ..models.model_config import ModelConfig


@dataclass
class KVCache:
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (keys, values), each [num_slots, kv_heads, head_dim]
    num_blocks: int
    block_size: int

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return 2 * cfg.num_layers * block_size * cfg.kv_size * dtype.itemsize

    @classmethod
    def allocate(cls, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: str | torch.device) -> KVCache:
        # Zeros, not empty: padded attention rows read slot 0, and masked garbage could be NaN (NaN * 0 = NaN).
        shape = (num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
        layers = [(zeroed(shape, dtype, device), zeroed(shape, dtype, device)) for _ in range(cfg.num_layers)]
        return cls(layers, num_blocks, block_size)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """A zero tensor whose CPU memory is committed only where it is written. torch.zeros writes every byte, so
    each engine held its whole KV budget (4 GiB by default) in RAM from the start, and two test workers' engines
    exhausted a 24 GiB machine (2026-12-03, a replica of CI on a fresh clone: 18 + 6 GB resident, thrashing; in
    CI a worker crashed). An anonymous mapping is the kernel's zero pages, each backed on its first write: a CPU
    engine's resident KV follows the slots it uses. (Not numpy's calloc: in a long-lived process glibc may serve it
    from its heap and write the zeros.)"""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # the tensor holds the buffer (and so the mapping) until its storage is freed
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)


def copy_slots(layers: list[tuple[torch.Tensor, torch.Tensor]], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy the K/V held in slots `src` to slots `dst` in every layer."""
    for k_cache, v_cache in layers:
        k_cache[dst] = k_cache[src]
        v_cache[dst] = v_cache[src]
