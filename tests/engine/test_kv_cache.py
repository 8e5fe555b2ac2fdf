"""The paged KV tensors' memory: zeros that the machine commits only where a slot is written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from turbospec.kv.kv_cache import KVCache
from turbospec.models.model_config import ModelConfig


def _config() -> ModelConfig:
    return ModelConfig(arch="llama", vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                       num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=10000.0,
                       max_position_embeddings=4096)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kv_cache_starts_at_zero_and_takes_writes(dtype):
    """Zeros everywhere (padded attention rows read slot 0), written and read like any tensor."""
    kv = KVCache.allocate(_config(), 64, 16, dtype, "cpu")
    keys, values = kv.layers[0]
    assert keys.dtype == dtype and keys.shape == (64 * 16, 2, 64) and keys.is_contiguous()
    assert all(float(t.abs().sum()) == 0 for layer in kv.layers for t in layer)
    keys[3] = 1.5
    values[:16].fill_(-2.0)
    assert float(keys[3].sum()) == 1.5 * 128 and float(values[:16].sum()) == -2.0 * 16 * 128
    assert float(keys.abs().sum()) == 1.5 * 128 and float(kv.layers[1][1].abs().sum()) == 0


# A fresh process, so the figure is the cache's alone: a test worker's resident memory moves with what earlier
# tests left behind.
RESIDENT = """
import gc, torch
from turbospec.kv.kv_cache import KVCache
from tests.engine.test_kv_cache import _config
def status(field):
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1]) // 1024
cfg = _config()
rss, vm = status("VmRSS"), status("VmSize")
kv = KVCache.allocate(cfg, (2 << 30) // KVCache.bytes_per_block(cfg, 16, torch.{dtype}), 16, torch.{dtype}, "cpu")
for keys, values in kv.layers:
    keys[:1000] = 1.0
    values[-1000:] = 1.0
grown = status("VmRSS") - rss
del kv, keys, values
gc.collect()
print(grown, status("VmSize") - vm)
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_kv_cache_commits_memory_only_where_written(dtype):
    """2 GiB of KV cache grows the process's resident memory by the slots written, not by the budget, and gives
    its address space back when freed. torch.zeros wrote every byte: two test workers' engines, 4 GiB each,
    once exhausted a 24 GiB machine."""
    out = subprocess.run([sys.executable, "-c", RESIDENT.format(dtype=dtype)], capture_output=True, text=True,
                         check=True, timeout=120, cwd=Path(__file__).parents[2]).stdout.split()
    grown_mib, kept_mib = int(out[-2]), int(out[-1])
    assert grown_mib < 128, f"the KV budget was committed up front: resident memory grew {grown_mib} MiB"
    assert kept_mib < 128, f"freeing the cache kept {kept_mib} MiB of address space"
