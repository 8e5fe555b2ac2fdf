"""The paged KV tensors' memory: zeros that the machine commits only where a slot is written."""

from __future__ import annotations

import pytest
import torch

from turbospec.kv.kv_cache import KVCache
from turbospec.models.model_config import ModelConfig


def _resident_mib() -> int:
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith("VmRSS:")).split()[1]) // 1024


def _config() -> ModelConfig:
    return ModelConfig(arch="llama", vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                       num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=10000.0,
                       max_position_embeddings=4096)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kv_cache_reads_zeros_and_commits_memory_only_where_written(dtype):
    """2 GiB of KV cache: all zeros (padded attention rows read slot 0), written like any tensor, and the
    process's resident memory grows by the slots written, not by the budget (torch.zeros wrote every byte: two
    test workers' engines, 4 GiB each, once exhausted a 24 GiB machine)."""
    cfg = _config()
    per_block = KVCache.bytes_per_block(cfg, 16, dtype)
    before = _resident_mib()
    kv = KVCache.allocate(cfg, (2 << 30) // per_block, 16, dtype, "cpu")
    keys, values = kv.layers[0]
    assert keys.dtype == dtype and keys.shape == (kv.num_blocks * 16, 2, 64) and keys.is_contiguous()
    keys[3] = 1.5
    values[:16].fill_(-2.0)
    assert float(keys[3].sum()) == 1.5 * 128 and float(values[:16].sum()) == -2.0 * 16 * 128
    assert float(keys[:3].abs().sum()) == 0 and float(keys[-1000:].abs().sum()) == 0
    assert _resident_mib() - before < 256, "the KV budget was committed up front"
