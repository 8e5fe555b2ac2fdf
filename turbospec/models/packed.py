"""Packed low-bit weights for few-row steps: torch's int4 kernel and our grouped int8 kernel, or, on CPUs with
AMX, our AMX kernels for both (nearly flat in rows up to 16, so verification runs packed too).

On this kind of CPU a bf16 matmul costs about the same for 1 to 16 rows (weight-bandwidth bound), while the
packed kernels are 2-3x faster for one row and grow with the rows. So a linear may hold both forms and
pick per call: packed up to `max_rows` rows (measured per shape by `crossover.py`), dense above, and packed
again from `gemm_rows` on where our AMX GEMM beats the dense one at prefill sizes. A linear
holding only the packed form (weight formats int4 / int8) always runs packed.

A packed weight is a list of parts along the output dimension, because a fused projection (q|k|v, gate|up)
may mix block types: Q4_K_M files keep some v and down projections in Q6_K.
"""

from __future__ import annotations

import copy
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

    def dequantize(self) -> torch.Tensor:
        return torch.from_numpy(Int8Groups(self.q.numpy(), self.scale.numpy()).dequantize())

    def take_rows(self, rows: np.ndarray) -> Int8Part:
        index = torch.from_numpy(rows)
        return Int8Part(self.q[index].contiguous(), self.scale[index].contiguous(), self.dtype)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes


def tile_order(w: np.ndarray) -> np.ndarray:
    """[N, K] -> [N / 16, K / 32, 16, 32]: per block of 16 outputs and 32 inputs, AMX's B-tile order (row r holds
    inputs 2r and 2r + 1 of each output, interleaved: element j is output j // 2, input 2r + j % 2)."""
    n, k = w.shape
    return w.reshape(n // 16, 16, k // 32, 16, 2).transpose(0, 2, 3, 1, 4).reshape(n // 16, k // 32, 16, 32)


def from_tile_order(t: np.ndarray) -> np.ndarray:
    """The inverse of `tile_order`."""
    nb, kb = t.shape[:2]
    return t.reshape(nb, kb, 16, 16, 2).transpose(0, 3, 1, 2, 4).reshape(nb * 16, kb * 32)


def _per_block_half(v: np.ndarray) -> np.ndarray:
    """[N, G] per-output float32 values -> uint8 [N / 16, G, 32]: each block's 16 outputs as float16 bytes.
    ValueError when a value does not fit float16 (the caller keeps another form)."""
    n, g = v.shape
    half = v.astype(np.float16)
    if not np.isfinite(half).all() or not np.isfinite(v).all():
        raise ValueError("a group scale or offset does not fit float16")
    return half.reshape(n // 16, 16, g).transpose(0, 2, 1).copy().view(np.uint8)


def _from_block_half(b: np.ndarray) -> np.ndarray:
    """uint8 [N / 16, G, 32] -> float32 [N, G]: the inverse of `_per_block_half`."""
    nb, g = b.shape[:2]
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32).reshape(nb, g, 16).transpose(0, 2, 1) \
        .reshape(nb * 16, g).copy()


def _nibbles(t: np.ndarray) -> np.ndarray:
    """[..., 16, 32] values 0..15 in tile order -> [..., 256] bytes: byte j of chunk c holds element j of rows 2c
    (low nibble) and 2c + 1 (high nibble)."""
    t = t.reshape(*t.shape[:-2], 8, 2, 32)
    return (t[..., 0, :] | (t[..., 1, :] << 4)).astype(np.uint8).reshape(*t.shape[:-3], 256)


def _from_nibbles(b: np.ndarray) -> np.ndarray:
    w = b.reshape(*b.shape[:-1], 8, 1, 32)
    return np.concatenate([w & 15, w >> 4], axis=-2).reshape(*b.shape[:-1], 16, 32)


class _AmxPart:
    """One uint8 record per 16 outputs x 32 inputs ([N / 16, K / 32, BYTES]), run by our AMX kernel
    (kernels/amx_grouped.cpp says each kind's record)."""

    kind = ""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.out_features, self.in_features = data.shape[0] * 16, data.shape[1] * 32
        self.dtype = torch.bfloat16  # of the activations it serves
        self._op = kernels.record_op(self.kind)  # looked up once: mm runs for every linear of every step
        self.int8_activations = False

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"data": self.data}

    def quantize_activations(self) -> None:
        """From now on run the int8-activation kernel (weight format auto-q8act; kernels/records_dpbf16.cpp)."""
        self._op = kernels.record_op(self.kind, int8_activations=True)
        self.int8_activations = True

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.data)

    @property
    def op_name(self) -> str:
        """The product's operator ("turbospec::dpbf16_int4_mm", ...), "" where none runs here."""
        return getattr(self._op, "_qualified_op_name", "")

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def to_groups(self) -> Groups:
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], from the packed form (the tests' reference)."""
        return torch.from_numpy(self.to_groups().dequantize())

    def take_rows(self, rows: np.ndarray) -> _AmxPart:
        """These output rows (a multiple of 16 of them), repacked: the same values, in the same kind."""
        return type(self).from_groups(self.to_groups().take_rows(rows))  # type: ignore[attr-defined]


class AmxInt4Part(_AmxPart):
    """`Int4Groups` for our AMX kernel: value = q * s + z per group of 32, s and z in float16.

    One 320-byte record per 16 outputs x 32 inputs (see kernels/amx_grouped.cpp): the 512 nibbles in tile order
    (byte j of each 32-byte chunk c holds element j of tile rows 2c (low) and 2c + 1 (high)), then the 16 scales,
    then the 16 offsets. float16 keeps the file's own Q4_0 / Q4_1 scales exactly and rounds Q4_K's d * sc at
    2^-11 (torch's int4 kernel rounds them to bf16, 2^-8)."""

    kind = "amx-int4"


    @classmethod
    def from_groups(cls, groups: Int4Groups) -> AmxInt4Part:
        nibbles = _nibbles(tile_order(groups.q.astype(np.uint8)))
        record = np.concatenate([nibbles, _per_block_half(groups.scale), _per_block_half(groups.offset)], axis=2)
        return cls(torch.from_numpy(record))

    def to_groups(self) -> Int4Groups:
        d = self.data.numpy()
        q = from_tile_order(_from_nibbles(d[:, :, :256])).astype(np.uint8)
        return Int4Groups(q, _from_block_half(d[:, :, 256:288]), _from_block_half(d[:, :, 288:]))


class AmxInt6Part(_AmxPart):
    """`Int8Groups` whose values fit 6 bits (Q6_K's -32..31, Q5_0's -16..15): value = (u - 32) * s per 16 inputs.
    One 448-byte record per 16 outputs x 32 inputs: the low nibbles of u as in `AmxInt4Part`, 128 bytes of high
    2-bit pairs (byte j of chunk c holds element j of tile rows 4c + i in bits 2i, 2i + 1), then the float16
    scales of inputs 0..15 and of inputs 16..31. 0.875 bytes per weight (Q6_K: 0.82)."""

    kind = "amx-int6"


    @staticmethod
    def fits(groups: Int8Groups) -> bool:
        return bool(groups.q.min() >= -32 and groups.q.max() <= 31)

    @classmethod
    def from_groups(cls, groups: Int8Groups) -> AmxInt6Part:
        u = tile_order((groups.q.astype(np.int16) + 32).astype(np.uint8))  # [nb, kb, 16, 32], 0..63
        high = (u >> 4).reshape(*u.shape[:2], 4, 4, 32)  # chunk c, row 4c + i
        pairs = sum(high[:, :, :, i] << (2 * i) for i in range(4)).astype(np.uint8).reshape(*u.shape[:2], 128)
        scales = _per_block_half(groups.scale).reshape(*u.shape[:2], 64)
        return cls(torch.from_numpy(np.concatenate([_nibbles(u & 15), pairs, scales], axis=2)))

    def to_groups(self) -> Int8Groups:
        d = self.data.numpy()
        nb, kb = d.shape[:2]
        pairs = d[:, :, 256:384].reshape(nb, kb, 4, 1, 32)
        high = np.concatenate([(pairs >> (2 * i)) & 3 for i in range(4)], axis=3).reshape(nb, kb, 16, 32)
        u = from_tile_order(_from_nibbles(d[:, :, :256]) | (high << 4))
        scale = _from_block_half(d[:, :, 384:].reshape(nb, kb * 2, 32))
        return Int8Groups((u.astype(np.int16) - 32).astype(np.int8), scale)


class AmxInt8Part(_AmxPart):
    """`Int8Groups` for our AMX kernel: one 576-byte record per 16 outputs x 32 inputs: the 512 int8 values in
    tile order, then the float16 scales of inputs 0..15 and of inputs 16..31 (exact for Q8_0 and Q5_0, whose
    scales are float16 in the file; Q6_K's d * sc rounded at 2^-11)."""

    kind = "amx-int8"


    @classmethod
    def from_groups(cls, groups: Int8Groups) -> AmxInt8Part:
        nb, kb = groups.q.shape[0] // 16, groups.q.shape[1] // 32
        values = tile_order(groups.q.astype(np.int8)).reshape(nb, kb, 512).view(np.uint8)
        scales = _per_block_half(groups.scale).reshape(nb, kb, 64)  # groups 2b and 2b + 1 of each block
        return cls(torch.from_numpy(np.concatenate([values, scales], axis=2)))

    def to_groups(self) -> Int8Groups:
        d = self.data.numpy()
        nb, kb = d.shape[:2]
        q = from_tile_order(np.ascontiguousarray(d[:, :, :512]).view(np.int8).reshape(nb, kb, 16, 32))
        return Int8Groups(q, _from_block_half(d[:, :, 512:].reshape(nb, kb * 2, 32)))


Part = Int4Part | Int8Part | AmxInt4Part | AmxInt6Part | AmxInt8Part
AMX_PARTS = {cls.kind: cls for cls in (AmxInt4Part, AmxInt6Part, AmxInt8Part)}


@dataclass
class PackedWeight:
    parts: list[Part]
    # the most rows a call runs packed when a dense copy exists (0: always dense); no dense copy: always packed
    max_rows: int = 0
    # ... and the fewest rows from which calls run packed again (prefill chunks, where our AMX GEMM wins; 0: never)
    gemm_rows: int = 0

    def runs_packed(self, rows: int) -> bool:
        """Whether a call of this many rows runs packed when a dense copy exists too."""
        return rows <= self.max_rows or 0 < self.gemm_rows <= rows

    @property
    def signature(self) -> str:
        """What the kernels see: the crossover is measured once per signature."""
        return "|".join(f"{p.kind}{'-q8act' if getattr(p, 'int8_activations', False) else ''}:"
                        f"{p.out_features}x{p.in_features}" for p in self.parts)

    def quantize_activations(self) -> None:
        """Run every part's int8-activation kernel (weight format auto-q8act); ValueError where a part has none."""
        for part in self.parts:
            if not isinstance(part, _AmxPart):
                raise ValueError(f"a {part.kind} part has no int8-activation kernel")
            part.quantize_activations()

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

    def clone(self) -> PackedWeight:
        """A copy in memory of its own (the same kernels, values and crossover): for timing it as a model runs it,
        streamed from memory (models/crossover.py)."""
        parts = []
        for part in self.parts:
            twin = copy.copy(part)
            for name, t in part.tensors().items():  # each part holds its tensors under these attribute names
                setattr(twin, name, t.clone())
            parts.append(twin)
        return PackedWeight(parts, self.max_rows, self.gemm_rows)

    def take_rows(self, rows: np.ndarray) -> PackedWeight | None:
        """A packed weight of these output rows (same values and kinds), or None when a part cannot be cut (torch's
        int4 layout is opaque) or the rows span several parts."""
        if len(self.parts) != 1 or isinstance(self.parts[0], Int4Part):
            return None
        part = self.parts[0]
        if isinstance(part, _AmxPart) and len(rows) % 16:
            return None
        return PackedWeight([part.take_rows(rows)], self.max_rows, self.gemm_rows)


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


def _part(g: Groups, dtype: torch.dtype, amx: bool) -> Part:
    if amx and g.q.shape[0] % 16 == 0 and g.q.shape[1] % 32 == 0:
        try:
            if isinstance(g, Int4Groups):
                return AmxInt4Part.from_groups(g)
            return AmxInt6Part.from_groups(g) if AmxInt6Part.fits(g) else AmxInt8Part.from_groups(g)
        except ValueError:  # a scale beyond float16: torch's / our AVX-512 kernel hold it
            pass
    if isinstance(g, Int4Groups):
        if g.q.shape[0] % 16:
            raise ValueError(f"int4 packing needs output rows in multiples of 16, got {g.q.shape[0]}")
        return Int4Part.from_groups(g, dtype)
    return Int8Part.from_groups(g, dtype)


def pack(groups: list[Groups], dtype: torch.dtype) -> PackedWeight:
    """Packed parts for a linear's row segments (same-kind neighbours merged): for bf16, our tile-order records where
    the CPU runs them (`kernels.records_path()`: AMX, AVX512-BF16 dot products or AVX2 FMAs), else torch's int4 and our
    AVX-512 int8 kernel. ValueError when torch's int4 packing cannot take a part (it needs output rows in
    multiples of 16)."""
    amx = dtype == torch.bfloat16 and bool(kernels.records_path())
    return PackedWeight([_part(g, dtype, amx) for g in merge_groups(groups)])


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
        elif kind in AMX_PARTS:
            parts.append(AMX_PARTS[kind](tensors[f"{prefix}.{i}.data"]))
        else:
            parts.append(Int8Part(tensors[f"{prefix}.{i}.q"], tensors[f"{prefix}.{i}.scale"], dtype))
    return PackedWeight(parts)


def packed_linear(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                  packed: PackedWeight | None, invariant: bool) -> torch.Tensor | None:
    """The packed product when this call should run packed, else None (the caller runs the dense one).

    Dense when: the batch-invariant mode (its kernels fix the reduction order; the packed ones do not),
    the activations are in another dtype than the packed scales (LayerCast's float32), or a dense copy exists and
    the measured crossover says it is faster for this many rows."""
    if packed is None:
        return None
    if weight is None:  # packed only (int4 / int8): engine and requests refuse the modes that need a dense copy
        if invariant:
            raise RuntimeError("the batch-invariant path needs dense weights; this linear keeps only packed ones")
        return packed.mm(x, bias)
    if invariant or x.dtype != packed.dtype or not packed.runs_packed(x.shape[0]):
        return None
    return packed.mm(x, bias)
