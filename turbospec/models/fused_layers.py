"""Decoder layers in one compiled call each (kernels/decoder_layer.cpp), for the steps where that call computes
exactly what `llama.DecoderLayer` computes: bf16 activations, every linear of every layer on packed records
(`packed._AmxPart`: the AMX, AVX512-BF16 or int8-activation products) for this many rows, and every attention
group attended by the fused short-query kernel (a contiguous slice of the batch, or sequences of different query
counts padded to the longest, gathered and scattered as `attention.paged_attention` does).

Why: a decode step of a 1.5B model runs ~70 small operators per layer around its products; from Python they cost
15-20% of the step on a 2-core CPU, from C++ a fraction of that. Every other step (prefill chunks, dense
linears, the batch-invariant mode, float32, tensor-parallel shards, Gemma) runs the Python layers unchanged.
TURBOSPEC_NO_FUSED_LAYERS=1 switches it off, for side-by-side measurements.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import kernels
from ..attention import AttentionMetadata
from .layers import RMSNorm, RowLinear
from .packed import PackedWeight, _AmxPart

KVCache = tuple[torch.Tensor, torch.Tensor]
LayerCall = Callable[[int, torch.Tensor], torch.Tensor]

_DISABLED = os.environ.get("TURBOSPEC_NO_FUSED_LAYERS") == "1"
_NONE = torch.empty(0, dtype=torch.long)  # a contiguous group's gather and scatter


@dataclass
class _Layer:
    """One layer's arguments to the compiled call, fixed for the model's life."""

    input_norm: torch.Tensor
    mlp_norm: torch.Tensor
    products: str  # the four linears' part products: "a,b|c|d|e" (qkv | o | gate_up | down)
    weights: list[torch.Tensor]
    qkv_bias: torch.Tensor | None
    linears: tuple[tuple[RowLinear, PackedWeight], ...]  # (module, the packed form the arguments were taken from)


@dataclass
class FusedLayers:
    """The compiled calls of one model's decoder layers, built from its packed weights (`build`)."""

    layers: list[_Layer]
    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    _fits_rows: dict[int, bool] = field(default_factory=dict)  # rows -> every linear runs packed at that count

    @classmethod
    def build(cls, model: torch.nn.Module, layer_type: type) -> FusedLayers | None:
        """The calls for `model` (a llama.CausalLM whose layers are all `layer_type`, llama.DecoderLayer), or None
        when any layer is not one they compute exactly."""
        if _DISABLED or kernels.fused_ops() is None:
            return None
        layers = []
        for layer in model.layers:
            if type(layer) is not layer_type:
                return None
            attn, mlp = layer.attn, layer.mlp
            linears = (attn.qkv, attn.o, mlp.gate_up, mlp.down)
            if not all(_runs_records(lin) for lin in linears) or attn.o.bias is not None:
                return None
            if not all(_bf16_norm(n) for n in (layer.input_norm, layer.mlp_norm)):
                return None
            weights = [p.data for lin in linears for p in lin.packed.parts]
            products = "|".join(",".join(p.op_name for p in lin.packed.parts) for lin in linears)
            layers.append(_Layer(layer.input_norm.weight, layer.mlp_norm.weight, products, weights, attn.qkv.bias,
                                 tuple((lin, lin.packed) for lin in linears)))
        cfg = model.cfg
        return cls(layers, cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5)

    def current(self) -> bool:
        """Whether the model still holds the packed weights this was built from."""
        return all(lin.packed is packed for layer in self.layers for lin, packed in layer.linears)

    def for_step(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: list[KVCache], rotary: torch.nn.Module) -> LayerCall | None:
        """A function running layer i on x for this step, or None when this step must run the Python layers."""
        rows = x.shape[0]
        if (x.dtype != torch.bfloat16 or x.device.type != "cpu" or meta.invariant or meta.compute_dtype is not None
                or not self._fits(rows) or (torch.is_grad_enabled() and x.requires_grad)):
            return None
        probe = x.new_empty(0, self.num_heads, self.head_dim)  # attention's choice depends on shapes and dtype only
        k_cache0 = kv_caches[0][0]
        starts, gathers, scatters, slots, masks = [], [], [], [], []
        for g in meta.groups:
            if g.invariant or g.kernel(probe, k_cache0) != "fused":
                return None
            if g.token_range is not None:
                starts.append(g.token_range[0])
                gathers.append(_NONE)
                scatters.append(_NONE)
            else:  # sequences with different query counts, padded to the longest: paged_attention's gather and
                starts.append(-1)  # scatter
                gathers.append(g.token_index.reshape(-1))
                scatters.append(g.scatter())
            slots.append(g.kv_slots)
            masks.append(g.mask[:, 0].contiguous())
        cos, sin = rotary.lookup(positions, x.dtype)
        ops = torch.ops.turbospec

        def run(i: int, h: torch.Tensor) -> torch.Tensor:
            layer, (k_cache, v_cache) = self.layers[i], kv_caches[i]
            return ops.decoder_layer(h, layer.input_norm, layer.mlp_norm, self.eps, layer.products, layer.weights,
                                     layer.qkv_bias, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim,
                                     k_cache, v_cache, meta.slot_mapping, starts, gathers, scatters, slots, masks,
                                     self.scale)

        return run

    def _fits(self, rows: int) -> bool:
        if rows not in self._fits_rows:
            self._fits_rows[rows] = rows > 0 and all(
                lin.weight is None or packed.runs_packed(rows) for layer in self.layers for lin, packed in layer.linears)
        return self._fits_rows[rows]


def _runs_records(lin: torch.nn.Module) -> bool:
    """A plain RowLinear (not a tensor-parallel shard) whose packed form is all records, in bf16."""
    packed = getattr(lin, "packed", None)
    return (type(lin) is RowLinear and packed is not None
            and all(isinstance(p, _AmxPart) and p.op_name for p in packed.parts)
            and packed.dtype == torch.bfloat16 and (lin.weight is None or lin.weight.dtype == torch.bfloat16)
            and (lin.bias is None or lin.bias.dtype == torch.bfloat16))


def _bf16_norm(norm: torch.nn.Module) -> bool:
    return type(norm) is RMSNorm and not norm.offset and norm.weight.dtype == torch.bfloat16
