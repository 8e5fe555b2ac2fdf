"""Architecture hyper-parameters, read from GGUF metadata, an HF config.json, or a named dummy shape."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_REDUCTION_GROUPS = 8


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model code needs to build a network. One class for every family we run."""

    arch: str  # "llama" (Llama, SmolLM2, Qwen2) or "gemma3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    # Llama-3 style frequency scaling ({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}).
    rope_scaling: dict[str, Any] | None = None
    # Gemma3 only: local layers use a sliding window and their own rope base; every Nth layer is global.
    sliding_window: int | None = None
    sliding_window_pattern: int = 0
    rope_local_theta: float = 10000.0
    query_pre_attn_scalar: float | None = None
    final_logit_softcap: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    name: str = ""

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def reduction_groups(self) -> int:
        """Slices of attention-out's and MLP-down's input that the batch-invariant path adds in a fixed order
        (so that its bits do not depend on the tensor-parallel split): one per KV head, merged into at most
        MAX_REDUCTION_GROUPS equal runs (each slice is one more matmul), 1 when that cannot be even."""
        g = self.num_kv_heads
        r = max(d for d in range(1, min(g, MAX_REDUCTION_GROUPS) + 1) if g % d == 0)
        return r if self.intermediate_size % r == 0 else 1

    def is_sliding_layer(self, layer: int) -> bool:
        """Gemma3 interleaves 5 sliding-window layers with 1 global layer."""
        if self.sliding_window is None or self.sliding_window_pattern <= 0:
            return False
        return (layer + 1) % self.sliding_window_pattern != 0

    def num_params(self) -> int:
        attn = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        emb = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp) + emb


# Real shapes without weights, for timing runs on big hardware (see `dummy:<name>` model arguments).
DUMMY_SHAPES: dict[str, ModelConfig] = {
    "llama-3.1-8b": ModelConfig(
        arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=131072, bos_token_id=128000, eos_token_ids=(128001, 128009),
        rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        name="dummy:llama-3.1-8b",
    ),
    "llama-2-7b": ModelConfig(
        arch="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
        num_heads=32, num_kv_heads=32, head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=4096, bos_token_id=1, eos_token_ids=(2,), name="dummy:llama-2-7b",
    ),
    "llama-3.2-1b": ModelConfig(
        arch="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
        num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=131072, tie_word_embeddings=True, bos_token_id=128000,
        eos_token_ids=(128001, 128009),
        rope_scaling={"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        name="dummy:llama-3.2-1b",
    ),
    # A tiny shape for fast unit tests of the engine machinery.
    "tiny": ModelConfig(
        arch="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=2048, qkv_bias=True, bos_token_id=1, eos_token_ids=(2,), name="dummy:tiny",
    ),
}


def from_gguf_metadata(meta: dict[str, Any], num_vocab: int, has_output: bool, name: str) -> ModelConfig:
    """Build a config from GGUF key/values (keys prefixed by the architecture, as llama.cpp writes them)."""
    arch = meta["general.architecture"]
    if arch not in ("llama", "qwen2", "gemma3"):
        raise ValueError(f"unsupported GGUF architecture {arch!r}: turbospec runs llama, qwen2 and gemma3")

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    num_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // num_heads))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    common = dict(
        vocab_size=int(get("vocab_size", num_vocab)),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 4096)),
        tie_word_embeddings=not has_output,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
        name=name,
    )
    if arch == "gemma3":
        return ModelConfig(
            arch="gemma3", sliding_window=int(get("attention.sliding_window", 512)), sliding_window_pattern=6,
            rope_local_theta=10000.0, query_pre_attn_scalar=float(head_dim), **common,
        )
    return ModelConfig(arch="llama", qkv_bias=(arch == "qwen2"), **common)


def from_hf_config(cfg: dict[str, Any], name: str) -> ModelConfig:
    """Build a config from a Hugging Face config.json (Llama, Qwen2 or Gemma3 text models)."""
    model_type = cfg.get("model_type", "")
    if model_type == "gemma3":  # multimodal wrapper: the text part is nested
        cfg = {**cfg, **cfg.get("text_config", {})}
        model_type = "gemma3_text"
    if model_type not in ("llama", "qwen2", "gemma3_text"):
        raise ValueError(f"unsupported model_type {model_type!r}: turbospec runs llama, qwen2 and gemma3")
    num_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    eos = cfg.get("eos_token_id")
    common = dict(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"], num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads", num_heads), head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(rope_theta),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=cfg.get("tie_word_embeddings", model_type != "llama"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
        name=name,
    )
    if model_type == "gemma3_text":
        return ModelConfig(
            arch="gemma3", sliding_window=cfg.get("sliding_window", 512),
            sliding_window_pattern=cfg.get("sliding_window_pattern", 6),
            rope_local_theta=cfg.get("rope_local_base_freq", 10000.0),
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", head_dim),
            final_logit_softcap=cfg.get("final_logit_softcapping"), **common,
        )
    scaling = rope if rope.get("rope_type") == "llama3" else None
    return ModelConfig(arch="llama", qkv_bias=model_type == "qwen2" or cfg.get("attention_bias", False),
                       rope_scaling=scaling, **common)

