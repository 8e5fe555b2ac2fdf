"""Gemma 3 text models: sandwich norms, per-head q/k RMSNorm, GELU-tanh MLP, scaled embeddings, and
5 sliding-window layers (local RoPE base) for every global layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionMetadata, paged_attention
from .layers import RMSNorm, Rotary, RowLinear
from .llama import MLP, CausalLM, KVCache
from .model_config import ModelConfig


class GemmaMLP(MLP):
    def forward(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        gate, up = self.gate_up(x, invariant).chunk(2, dim=-1)
        return self.down(F.gelu(gate, approximate="tanh") * up, invariant)


class GemmaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary, window: int | None) -> None:
        super().__init__()
        self.cfg = cfg
        self.qkv = RowLinear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o = RowLinear(cfg.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, offset=1.0)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, offset=1.0)
        self.rotary = rotary
        self.window = window
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: KVCache) -> torch.Tensor:
        c = self.cfg
        q, k, v = self.qkv(x, meta.invariant).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = self.rotary(self.q_norm(q.view(-1, c.num_heads, c.head_dim)), positions)
        k = self.rotary(self.k_norm(k.view(-1, c.num_kv_heads, c.head_dim)), positions)
        v = v.view(-1, c.num_kv_heads, c.head_dim)
        return self.o(paged_attention(q, k, v, kv[0], kv[1], meta, self.scale, self.window), meta.invariant)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary, window: int | None) -> None:
        super().__init__()
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=1.0)
        self.input_norm, self.post_attn_norm = norm(), norm()
        self.pre_ffn_norm, self.post_ffn_norm = norm(), norm()
        self.attn = GemmaAttention(cfg, rotary, window)
        self.mlp = GemmaMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: KVCache) -> torch.Tensor:
        x = x + self.post_attn_norm(self.attn(self.input_norm(x), positions, meta, kv))
        return x + self.post_ffn_norm(self.mlp(self.pre_ffn_norm(x), meta.invariant))


class Gemma3ForCausalLM(CausalLM):
    RENAMED = {
        **CausalLM.RENAMED,
        "post_attention_layernorm": "post_attn_norm",
        "pre_feedforward_layernorm": "pre_ffn_norm",
        "post_feedforward_layernorm": "post_ffn_norm",
        "self_attn.q_norm": "attn.q_norm",
        "self_attn.k_norm": "attn.k_norm",
    }

    def make_layers(self, cfg: ModelConfig) -> list[nn.Module]:
        global_rope = Rotary(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        local_rope = Rotary(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_local_theta)
        return [
            GemmaDecoderLayer(cfg, local_rope, cfg.sliding_window) if cfg.is_sliding_layer(i)
            else GemmaDecoderLayer(cfg, global_rope, None)
            for i in range(cfg.num_layers)
        ]

    def make_norm(self, cfg: ModelConfig) -> nn.Module:
        return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=1.0)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        # Gemma scales embeddings by sqrt(hidden), rounded to the activation dtype first (as HF does).
        return x * torch.tensor(self.cfg.hidden_size**0.5, dtype=x.dtype)

    def compute_logits(self, hidden: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        logits = super().compute_logits(hidden, invariant)
        if cap := self.cfg.final_logit_softcap:
            logits = torch.tanh(logits / cap) * cap
        return logits
