"""Packed low-bit weights for few-row steps: torch's int4 kernel and our grouped int8 kernel.

On this kind of CPU a bf16 matmul costs about the same for 1 to 16 rows (weight-bandwidth bound), while the
packed kernels are 2-3x faster for one row and grow with the rows. So a linear may hold both forms and
pick per call: packed up to `max_rows` rows (measured per shape by `crossover.py`), dense above. A linear
holding only the packed form (weight formats int4 / int8) always runs packed.

A packed weight is a list of parts along the output dimension, because a fused projection (q|k|v, gate|up)
may mix block types: Q4_K_M files keep some v and down projections in Q6_K.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .. import kernels
from .gguf_blocks import Groups, Int4Groups, Int8Groups


class Int4Part:
    """value = (q - 8) * s + z per group of 32 (torch's int4 convention), s and z in the compute dtype."""

    kind = "int4"

    def __init__(self, weight: torch.Tensor, scales_zeros: torch.Tensor) -> None:
        self.weight = weight  # torch's packed layout
        self.scales_zeros = scales_zeros  # [K / 32, N, 2]
        self.out_features = scales_zeros.shape[1]
        self.in_features = scales_zeros.shape[0] * Int4Groups.group
        self.dtype = scales_zeros.dtype

    @classmethod
    def from_groups(cls, groups: Int4Groups, dtype: torch.dtype) -> Int4Part:
        q = torch.from_numpy(np.ascontiguousarray(groups.q)).to(torch.int32)
        scale = torch.from_numpy(groups.scale)
        zero = torch.from_numpy(groups.offset) + 8.0 * scale  # q * s + offset = (q - 8) * s + (offset + 8 s)
        return cls(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1),
                   torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous())

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight, "scales_zeros": self.scales_zeros}

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight, Int4Groups.group, self.scales_zeros)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scales_zeros.nbytes


class Int8Part:
    """value = q * s per group of 16, s in float32 (exact for Q8_0, Q5_0 and Q6_K)."""

    kind = "int8"

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        self.q, self.scale = q, scale
        self.out_features, self.in_features = q.shape
        self.dtype = dtype  # of the activations it serves; the scales stay float32 (exact)

    @classmethod
    def from_groups(cls, groups: Int8Groups, dtype: torch.dtype) -> Int8Part:
        return cls(torch.from_numpy(np.ascontiguousarray(groups.q)),
                   torch.from_numpy(np.ascontiguousarray(groups.scale)), dtype)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"q": self.q, "scale": self.scale}

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.grouped_int8_mm(x, self.q, self.scale).to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes


Part = Int4Part | Int8Part


@dataclass
class PackedWeight:
    parts: list[Part]
    # the most rows a call runs packed when a dense copy exists (0: always dense); no dense copy: always packed
    max_rows: int = 0

    @property
    def signature(self) -> str:
        """What the kernels see: the crossover is measured once per signature."""
        return "|".join(f"{p.kind}:{p.out_features}x{p.in_features}" for p in self.parts)

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def mm(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        outs = [p.mm(x) for p in self.parts]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return y if bias is None else y + bias.to(y.dtype)


def merge_groups(groups: list[Groups]) -> list[Groups]:
    """Adjacent parts of the same kind become one (fewer kernel calls): q and k, gate and up."""
    merged: list[Groups] = []
    for g in groups:
        last = merged[-1] if merged else None
        if isinstance(g, Int4Groups) and isinstance(last, Int4Groups) and last.q.shape[1] == g.q.shape[1]:
            merged[-1] = Int4Groups(np.concatenate([last.q, g.q]), np.concatenate([last.scale, g.scale]),
                                    np.concatenate([last.offset, g.offset]))
        elif isinstance(g, Int8Groups) and isinstance(last, Int8Groups) and last.q.shape[1] == g.q.shape[1]:
            merged[-1] = Int8Groups(np.concatenate([last.q, g.q]), np.concatenate([last.scale, g.scale]))
        else:
            merged.append(g)
    return merged


def pack(groups: list[Groups], dtype: torch.dtype) -> PackedWeight:
    """Packed parts for a linear's row segments (same-kind neighbours merged). ValueError when torch's int4
    packing cannot take a part (it needs output rows in multiples of 16)."""
    merged = merge_groups(groups)
    for g in merged:
        if isinstance(g, Int4Groups) and g.q.shape[0] % 16:
            raise ValueError(f"int4 packing needs output rows in multiples of 16, got {g.q.shape[0]}")
    return PackedWeight([Int4Part.from_groups(g, dtype) if isinstance(g, Int4Groups) else Int8Part.from_groups(g, dtype)
                         for g in merged])


def save_parts(packed: PackedWeight, prefix: str, out: dict[str, torch.Tensor]) -> list[str]:
    """Add the parts' tensors to `out` under `prefix.i.name`; returns the kinds, for `load_parts`."""
    for i, part in enumerate(packed.parts):
        out.update({f"{prefix}.{i}.{name}": t for name, t in part.tensors().items()})
    return [p.kind for p in packed.parts]


def load_parts(kinds: list[str], prefix: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> PackedWeight:
    parts: list[Part] = []
    for i, kind in enumerate(kinds):
        if kind == "int4":
            parts.append(Int4Part(tensors[f"{prefix}.{i}.weight"], tensors[f"{prefix}.{i}.scales_zeros"]))
        else:
            parts.append(Int8Part(tensors[f"{prefix}.{i}.q"], tensors[f"{prefix}.{i}.scale"], dtype))
    return PackedWeight(parts)


def packed_linear(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                  packed: PackedWeight | None, invariant: bool) -> torch.Tensor | None:
    """The packed product when this call should run packed, else None (the caller runs the dense one).

    Dense when: the batch-invariant mode (its kernels fix the reduction order; the packed ones do not),
    the activations are in another dtype than the packed scales (LayerCast's float32), or the call has
    more rows than the measured crossover and a dense copy exists."""
    if packed is None:
        return None
    if weight is None:  # packed only (int4 / int8): engine and requests refuse the modes that need a dense copy
        if invariant:
            raise RuntimeError("the batch-invariant path needs dense weights; this linear keeps only packed ones")
        return packed.mm(x, bias)
    if invariant or x.dtype != packed.dtype or x.shape[0] > packed.max_rows:
        return None
    return packed.mm(x, bias)
