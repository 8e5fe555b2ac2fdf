"""Building blocks shared by the model families: RMSNorm, rotary embeddings, fused weight loading."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..determinism.batch_invariant import invariant_linear
from .packed import PackedWeight, packed_linear


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               invariant: bool = False) -> torch.Tensor:
    """F.linear in the activations' dtype (weights are cast up when they are stored narrower, as LayerCast
    does), rows computed independently of each other when `invariant` (the batch-invariant mode). bf16 calls of
    up to the measured rows run our kernel where torch's bf16 matmul is slow (CPUs without bf16 arithmetic:
    kernels.bf16_rows_limit; the batch-invariant mode's choice is kernels.bf16_rows_invariant)."""
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
        bias = None if bias is None else bias.to(x.dtype)
    if invariant:
        return invariant_linear(x, weight, bias)
    if kernels.bf16_rows_fits(x, weight, bias):
        return kernels.bf16_rows_mm(x, weight, bias)
    return F.linear(x, weight, bias)


class RowLinear(nn.Linear):
    """nn.Linear computed by row_linear, or by its packed low-bit form when one is attached (weight_format.py)
    and the call has few enough rows (packed.py).

    group_width marks a linear that tensor parallelism splits along its input (attention's output and the MLP's
    down projection, one slice per KV-head group): on the batch-invariant path it is computed as one partial
    product per slice, added in float32 in a fixed order, the order a sharded model uses too, so invariant
    outputs are the same bits for every tensor-parallel size (parallel/shard.py)."""

    packed: PackedWeight | None = None
    group_width: int = 0  # input columns per KV-head group when tensor parallelism may split this linear's input

    def forward(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        if invariant and self.group_width:
            return sum_in_order(self.partials(x), self.bias).to(x.dtype)
        y = packed_linear(x, self.weight, self.bias, self.packed, invariant)
        return row_linear(x, self.weight, self.bias, invariant) if y is None else y

    def partials(self, x: torch.Tensor) -> Iterator[torch.Tensor]:
        """Invariant partial products of x @ weight.T, one per group slice of the input columns this linear
        holds (views: a slice's row stride does not change the bits, tests/engine/test_tensor_parallel.py)."""
        w = self.group_width
        for lo in range(0, self.in_features, w):
            yield row_linear(x[:, lo:lo + w], self.weight[:, lo:lo + w], invariant=True)


def sum_in_order(partials: Iterable[torch.Tensor], bias: torch.Tensor | None = None) -> torch.Tensor:
    """float32 sum of the partials, added one after another (a fixed order: the same bits wherever it runs)."""
    total: torch.Tensor | None = None
    for p in partials:
        total = p.float() if total is None else total + p.float()
    assert total is not None, "nothing to add"
    return total if bias is None else total + bias.float()


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 (as HF does), with Gemma's (1 + w) variant behind a flag."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) - offset, requires_grad=False)
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = self._fused(x)
        if ops is not None:
            return ops.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:  # Gemma multiplies in float32 before casting back
            return (xf * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, this norm of it): a layer's residual add and the norm after it, one call when fused."""
        ops = self._fused(x)
        if ops is not None:
            return ops.add_rms_norm(x, delta, self.weight, self.eps)
        total = x + delta
        return total, self(total)

    def _fused(self, x: torch.Tensor) -> Any:
        """The compiled operators (kernels/fused_ops.cpp) where they compute exactly this: bf16 rows on the
        CPU, no Gemma offset, nothing to differentiate."""
        if (x.dtype != torch.bfloat16 or x.dim() != 2 or x.device.type != "cpu" or self.offset
                or self.weight.dtype != torch.bfloat16 or (torch.is_grad_enabled() and x.requires_grad)):
            return None
        return kernels.fused_ops()


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
    if scaling:  # Llama-3 frequency-dependent scaling
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv.float()


class Rotary(nn.Module):
    """Neox-style rotary embedding (two halves), with a cos/sin table looked up by position.

    The tables are built lazily on the device of the first input, so a model can be constructed on the
    meta device (no memory, no init cost) and materialised later.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)
        self.max_positions = max_positions
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None
        self._step: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tables is None or self._tables[0].device != device:
            pos = torch.arange(self.max_positions, dtype=torch.float32, device="cpu")
            freqs = torch.outer(pos, self.inv_freq.to("cpu"))
            self._tables = (freqs.cos().to(device), freqs.sin().to(device))
        return self._tables

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # Every layer of a forward passes the same positions tensor: look the rows up once per step.
        # Holding a reference to that tensor makes the identity check safe.
        if self._step is None or self._step[0] is not positions or self._step[1] is not dtype:
            cos_t, sin_t = self.tables(positions.device)
            self._step = (positions, dtype, cos_t[positions].to(dtype)[:, None, :], sin_t[positions].to(dtype)[:, None, :])
        return self._step[2], self._step[3]

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D]; rotates in the input dtype like HF, with float32 tables cast down."""
        cos, sin = self.lookup(positions, x.dtype)
        if (x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.stride(-1) == 1
                and not (torch.is_grad_enabled() and x.requires_grad)):
            ops = kernels.fused_ops()
            if ops is not None:  # one call instead of seven (kernels/fused_ops.cpp), the same bf16 roundings
                return ops.rotary(x, cos, sin)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def dummy_init_(module: nn.Module, seed: int = 0) -> None:
    """Random weights with a scale that keeps activations finite through many layers (timing runs only)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for sub in module.modules():
            if isinstance(sub, RMSNorm):
                sub.weight.fill_(1.0 - sub.offset)
            else:
                for p in sub.parameters(recurse=False):
                    p.copy_((torch.randn(p.shape, generator=gen) * 0.02).to(p.dtype))
