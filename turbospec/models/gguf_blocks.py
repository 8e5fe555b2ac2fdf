"""GGUF quantised blocks taken apart into integer values and group scales, without rounding anything.

Two shapes cover the block types the packed kernels can run exactly:
- `Int4Groups`: value = q * scale + offset, q in 0..15, one (scale, offset) per 32 inputs of a row.
  Q4_0 (offset -8 * scale), Q4_1 (scale d, offset m) and Q4_K (scale d * sc, offset -dmin * m per
  32-value sub-block) are all of this form.
- `Int8Groups`: value = q * scale, q a signed byte, one scale per 16 inputs. Q8_0 (32 bytes, one scale,
  written twice), Q5_0 (5-bit values minus 16, one scale per 32) and Q6_K (6-bit values minus 32, one d * sc
  per 16) are of this form.

Each decoder computes the scales in float32 in the same order as `gguf.quants`, so `dequantize()` equals
gguf's own dequantisation bit for bit (tests check it). Other types (Q5_1, Q5_K, F16, ...) return None:
no packed kernel here holds them exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK_K = 256  # values per K-quant super-block


@dataclass
class Int4Groups:
    q: np.ndarray  # uint8 [N, K], 0..15
    scale: np.ndarray  # float32 [N, K / 32]
    offset: np.ndarray  # float32 [N, K / 32]

    group = 32

    def dequantize(self) -> np.ndarray:
        n, k = self.q.shape
        q = self.q.reshape(n, k // self.group, self.group).astype(np.float32)
        return (q * self.scale[..., None] + self.offset[..., None]).reshape(n, k)

    def take_rows(self, rows: np.ndarray) -> Int4Groups:
        return Int4Groups(self.q[rows], self.scale[rows], self.offset[rows])


@dataclass
class Int8Groups:
    q: np.ndarray  # int8 [N, K]
    scale: np.ndarray  # float32 [N, K / 16]

    group = 16

    def dequantize(self) -> np.ndarray:
        n, k = self.q.shape
        q = self.q.reshape(n, k // self.group, self.group).astype(np.float32)
        return (q * self.scale[..., None]).reshape(n, k)

    def take_rows(self, rows: np.ndarray) -> Int8Groups:
        return Int8Groups(self.q[rows], self.scale[rows])


Groups = Int4Groups | Int8Groups


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[..., 0]


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """[blocks, width / 2] bytes -> [blocks, width]: low nibbles first, then high (ggml's layout)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(qs.shape[0], width)


def _q4_0(blocks: np.ndarray) -> Int4Groups:
    d = _f16(blocks[:, :2])
    q = _nibbles(blocks[:, 2:], 32)
    return Int4Groups(q, d, -8.0 * d)  # d * (q - 8); -8 * d is exact in float32


def _q4_1(blocks: np.ndarray) -> Int4Groups:
    return Int4Groups(_nibbles(blocks[:, 4:], 32), _f16(blocks[:, :2]), _f16(blocks[:, 2:4]))


def _q4_k(blocks: np.ndarray) -> Int4Groups:
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc_bytes = blocks[:, 4:16].reshape(n, 3, 4)
    a, b, c = sc_bytes[:, 0], sc_bytes[:, 1], sc_bytes[:, 2]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1).astype(np.float32)  # [n, 8]
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1).astype(np.float32)
    qs = blocks[:, 16:].reshape(n, 4, 32)  # 4 x 32 bytes: each holds two 32-value sub-blocks
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, QK_K)
    return Int4Groups(q, d[:, None] * sc, -(dmin[:, None] * mn))


def _q8_0(blocks: np.ndarray) -> Int8Groups:
    d = _f16(blocks[:, :2])
    return Int8Groups(np.ascontiguousarray(blocks[:, 2:]).view(np.int8), np.repeat(d[:, None], 2, axis=1))


def _q5_0(blocks: np.ndarray) -> Int8Groups:
    d = _f16(blocks[:, :2])
    high = (np.ascontiguousarray(blocks[:, 2:6]).view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1  # [n, 32]
    low = _nibbles(blocks[:, 6:], 32)
    q = (low | (high.astype(np.uint8) << 4)).astype(np.int8) - np.int8(16)
    return Int8Groups(q, np.repeat(d[:, None], 2, axis=1))  # d * (q - 16), q - 16 in -16..15


def _q6_k(blocks: np.ndarray) -> Int8Groups:
    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    d = _f16(blocks[:, 208:210])
    low = np.stack([ql.reshape(n, 2, 64) & 0x0F, ql.reshape(n, 2, 64) >> 4], axis=2).reshape(n, 2, 4, 32)
    high = np.stack([(qh.reshape(n, 2, 32) >> s) & 0x03 for s in (0, 2, 4, 6)], axis=2)  # [n, 2, 4, 32]
    q = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n, QK_K)
    return Int8Groups(q, d[:, None] * scales)


# type name -> (bytes per block, values per block, decoder)
_DECODERS = {
    "Q4_0": (18, 32, _q4_0),
    "Q4_1": (20, 32, _q4_1),
    "Q4_K": (144, QK_K, _q4_k),
    "Q8_0": (34, 32, _q8_0),
    "Q5_0": (22, 32, _q5_0),
    "Q6_K": (210, QK_K, _q6_k),
}
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
INT8_TYPES = ("Q8_0", "Q6_K", "Q5_0")


def decodable(type_name: str) -> bool:
    return type_name in _DECODERS


def decode(raw: np.ndarray, type_name: str, rows: int, cols: int) -> Groups | None:
    """Raw GGUF tensor bytes of a [rows, cols] weight -> its groups, or None for a type we cannot hold."""
    if type_name not in _DECODERS:
        return None
    block_bytes, block_values, fn = _DECODERS[type_name]
    if cols % block_values:
        return None
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, block_bytes)
    if blocks.shape[0] != rows * cols // block_values:
        raise ValueError(f"{type_name} tensor of {rows}x{cols} holds {blocks.shape[0]} blocks")
    g = fn(blocks)
    if isinstance(g, Int4Groups):
        return Int4Groups(g.q.reshape(rows, cols), g.scale.reshape(rows, -1), g.offset.reshape(rows, -1))
    return Int8Groups(g.q.reshape(rows, cols), g.scale.reshape(rows, -1))


def requantize_int4(groups: Int8Groups) -> Int4Groups:
    """Wider groups (Q5_0, Q8_0, Q6_K values) rounded to 4 bits per group of 32, min-max affine as Q4_1 stores
    them: lossy, for a draft model only (its proposals are verified, so the output stays exact); 0.625 bytes per
    weight in our AMX layout against 0.875 (int6) or 1.125 (int8)."""
    n, k = groups.q.shape
    values = groups.dequantize().reshape(n, k // Int4Groups.group, Int4Groups.group)
    low, high = values.min(-1), values.max(-1)
    scale = np.where(high > low, (high - low) / 15, 1.0).astype(np.float32)  # a constant group: any scale
    q = np.clip(np.rint((values - low[..., None]) / scale[..., None]), 0, 15).astype(np.uint8)
    return Int4Groups(q.reshape(n, k), scale, low.astype(np.float32))
