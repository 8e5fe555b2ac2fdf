"""The Llama family: Llama 2/3, SmolLM2 and Qwen2 (GQA, optional qkv bias, tied or untied embeddings).

The forward runs over a flat ragged batch of tokens (see attention.py), so one call serves prefill
chunks, decodes and multi-token verification together, and can hand back hidden states to heads.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionMetadata, paged_attention
from .fused_layers import FusedLayers, LayerCall
from .layers import RMSNorm, Rotary, RowLinear, row_linear
from .model_config import ModelConfig
from .packed import PackedWeight, packed_linear

KVCache = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary) -> None:
        super().__init__()
        self.cfg = cfg
        self.qkv = RowLinear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o = RowLinear(cfg.q_size, cfg.hidden_size, bias=False)
        self.rotary = rotary
        self.scale = cfg.head_dim**-0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: KVCache) -> torch.Tensor:
        c = self.cfg
        qkv = self.qkv(x, meta.invariant)
        # q and k sit side by side in the fused projection: rotate both heads' groups in one call
        qk = self.rotary(qkv[:, : c.q_size + c.kv_size].view(-1, c.num_heads + c.num_kv_heads, c.head_dim), positions)
        q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
        v = qkv[:, c.q_size + c.kv_size:].view(-1, c.num_kv_heads, c.head_dim)
        return self.o(paged_attention(q, k, v, kv[0], kv[1], meta, self.scale), meta.invariant)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up = RowLinear(hidden, 2 * intermediate, bias=False)
        self.down = RowLinear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        gate, up = self.gate_up(x, invariant).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up, invariant)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, rotary)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: KVCache) -> torch.Tensor:
        x, h = self.mlp_norm.add_forward(x, self.attn(self.input_norm(x), positions, meta, kv))
        return x + self.mlp(h, meta.invariant)


class CausalLM(nn.Module):
    """Shared skeleton: embeddings, a stack of layers, final norm and LM head; subclasses pick the layer."""

    # HF name suffix -> (our module path suffix, fused parameter, index of the part inside the fused tensor)
    FUSED = {
        "self_attn.q_proj": ("attn.qkv", 0),
        "self_attn.k_proj": ("attn.qkv", 1),
        "self_attn.v_proj": ("attn.qkv", 2),
        "mlp.gate_proj": ("mlp.gate_up", 0),
        "mlp.up_proj": ("mlp.gate_up", 1),
    }
    RENAMED = {
        "self_attn.o_proj": "attn.o",
        "mlp.down_proj": "mlp.down",
        "input_layernorm": "input_norm",
        "post_attention_layernorm": "mlp_norm",
    }

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.make_layers(cfg))
        self._mark_reduction_groups(cfg)
        self.norm = self.make_norm(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # the LM head's packed form (weight_format.py); its dense copy is always kept: heads read its rows
        self.lm_head_packed: PackedWeight | None = None
        self.requires_grad_(False)
        # layers whose outputs a forward keeps in `captured` ([T, len * H], in this order): EAGLE's features
        self.capture_layers: tuple[int, ...] = ()
        self.captured: torch.Tensor | None = None
        self._fused: FusedLayers | None = None  # built at the first forward, when the packed weights are attached

    def _mark_reduction_groups(self, cfg: ModelConfig) -> None:
        """Attention's output and the MLP's down projection reduce over slices of whole KV-head groups, the
        unit tensor parallelism shards by: their invariant path adds the slices in a fixed order
        (layers.RowLinear, ModelConfig.reduction_groups)."""
        groups = cfg.reduction_groups
        if groups < 2:
            return
        for layer in self.layers:
            layer.attn.o.group_width = cfg.q_size // groups
            layer.mlp.down.group_width = cfg.intermediate_size // groups

    def make_layers(self, cfg: ModelConfig) -> list[nn.Module]:
        rotary = Rotary(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        return [DecoderLayer(cfg, rotary) for _ in range(cfg.num_layers)]

    def make_norm(self, cfg: ModelConfig) -> nn.Module:
        return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_caches: list[KVCache],
        layer_ids: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, one row per input token. layer_ids runs only those layers (in
        order), each with its own KV cache: the layer-skip draft (proposers/layer_skip.py)."""
        x = self.embed_tokens(input_ids)
        if meta.compute_dtype is not None:
            x = x.to(meta.compute_dtype)
        kept = []
        fused = self.fused_layers(x, positions, meta, kv_caches)
        for i in range(len(self.layers)) if layer_ids is None else layer_ids:
            x = fused(i, x) if fused is not None else self.layers[i](x, positions, meta, kv_caches[i])
            if i in self.capture_layers:
                kept.append(x)
        if layer_ids is None:
            self.captured = torch.cat(kept, dim=-1) if kept else None
        return self.norm(x)

    def fused_layers(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                     kv_caches: list[KVCache]) -> LayerCall | None:
        """This step's compiled layer calls (fused_layers.py), or None where the Python layers run it."""
        if self._fused is None or not self._fused.current():  # (a model without one is refused at its first layer)
            self._fused = FusedLayers.build(self, DecoderLayer)
        return None if self._fused is None else self._fused.for_step(x, positions, meta, kv_caches,
                                                                     self.layers[0].attn.rotary)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The LM head's weight: the input embedding when the two are tied."""
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        weight = self.lm_head_weight
        logits = packed_linear(hidden, weight, None, self.lm_head_packed, invariant)
        return (row_linear(hidden, weight, invariant=invariant) if logits is None else logits).float()

    # --- weights -------------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; every parameter must be filled exactly once."""
        params = dict(self.named_parameters())
        pending: dict[str, list[torch.Tensor | None]] = {}
        filled: set[str] = set()
        for hf, tensor in weights:
            target, part = self._map_name(hf)
            if target is None:
                continue
            if target not in params:
                raise ValueError(f"checkpoint tensor {hf} has no place in the model ({target})")
            if part is None:
                self._copy(params[target], tensor, hf)
                filled.add(target)
                continue
            slots = pending.setdefault(target, [None, None, None] if ".qkv." in target else [None, None])
            slots[part] = tensor
            if all(s is not None for s in slots):
                self._copy(params[target], torch.cat(slots, dim=0), hf)  # type: ignore[arg-type]
                filled.add(target)
                del pending[target]
        missing = sorted(set(params) - filled)
        if missing:
            raise ValueError(f"checkpoint is missing weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}")

    def _map_name(self, hf: str) -> tuple[str | None, int | None]:
        if hf == "rope_freqs":
            return None, None  # a table we compute ourselves
        if hf == "lm_head.weight":
            return (None if self.lm_head is None else "lm_head.weight"), None  # a tied head is the embedding
        if hf == "model.embed_tokens.weight":
            return "embed.weight", None
        if hf == "model.norm.weight":
            return "norm.weight", None
        if not hf.startswith("model.layers."):
            return None, None  # e.g. rotary inv_freq buffers in old HF checkpoints
        _, _, idx, rest = hf.split(".", 3)
        module, _, kind = rest.rpartition(".")
        if module in self.FUSED:
            ours, part = self.FUSED[module]
            return f"layers.{idx}.{ours}.{kind}", part
        return f"layers.{idx}.{self.RENAMED.get(module, module)}.{kind}", None

    @staticmethod
    def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, the model expects {tuple(param.shape)}")
        param.data.copy_(tensor.to(param.dtype))

