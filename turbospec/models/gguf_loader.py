"""Read a GGUF file into Hugging Face-named float tensors and a ModelConfig.

llama.cpp's converter renames tensors, permutes Llama's Q/K rows for its interleaved RoPE and stores
Gemma's RMSNorm weights as (1 + w). We undo all three here so the model code sees one convention, the
Hugging Face one, whatever the source.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from .model_config import ModelConfig, from_gguf_metadata

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


class GGUFError(ValueError):
    """The file is not a GGUF model we can read (corrupt, truncated, or an unsupported architecture)."""


def open_reader(path: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader fails in many ways on a damaged file; all mean the same to a user
        raise GGUFError(f"{path} is not a readable GGUF file (corrupt or truncated?): {exc}") from exc


def read_metadata(reader: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith(("tokens", "scores", "token_type", "merges")):
            continue  # vocabularies are large and only the tokenizer needs them
        try:
            meta[key] = field.contents()
        except Exception:
            continue
    return meta


def hf_name(gguf_name: str, arch: str) -> str:
    if m := _BLOCK.match(gguf_name):
        layer, part, kind = m.groups()
        if part == "ffn_norm":  # llama: norm before the MLP; gemma3: the pre-feedforward norm
            part_name = "pre_feedforward_layernorm" if arch == "gemma3" else "post_attention_layernorm"
        elif part in _LAYER_NAMES:
            part_name = _LAYER_NAMES[part]
        else:
            raise GGUFError(f"unexpected tensor {gguf_name!r} in a {arch} GGUF")
        return f"model.layers.{layer}.{part_name}.{kind}"
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    if stem == "rope_freqs":
        return "rope_freqs"
    raise GGUFError(f"unexpected tensor {gguf_name!r} in a {arch} GGUF")


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K permutation: interleaved rotary pairs back to HF's two halves."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: Path, name: str, progress: bool = True) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """Return the config and a lazy stream of (HF name, float32 tensor): dequantisation happens as it is consumed."""
    import gguf

    reader = open_reader(path)
    meta = read_metadata(reader)
    if "general.architecture" not in meta:
        raise GGUFError(f"{path} has no general.architecture: not a model GGUF")
    raw_arch = meta["general.architecture"]
    names = {t.name for t in reader.tensors}
    vocab = next((int(t.shape[-1]) for t in reader.tensors if t.name == "token_embd.weight"), 0)
    config = from_gguf_metadata(meta, vocab, has_output="output.weight" in names, name=name)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for t in tqdm(reader.tensors, desc=f"dequantise {path.name}", unit="tensor", disable=not progress,
                      leave=False):
            key = hf_name(t.name, config.arch)
            try:
                arr = gguf.quants.dequantize(t.data, t.tensor_type)
            except Exception as exc:
                raise GGUFError(f"{path}: cannot decode tensor {t.name} ({t.tensor_type.name}): {exc}") from exc
            arr = np.asarray(arr, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
            if raw_arch == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
                heads = config.num_heads if "attn_q" in t.name else config.num_kv_heads
                arr = _unpermute_rope(arr, heads)
            if config.arch == "gemma3" and key.endswith("norm.weight"):
                arr = arr - 1.0  # llama.cpp stores Gemma's (1 + w); HF keeps w
            yield key, torch.from_numpy(np.require(arr, requirements=["C", "W"]))  # writable: torch needs it

    expected = sum(1 for t in reader.tensors)
    if expected == 0:
        raise GGUFError(f"{path} holds no tensors")
    return config, tensors()
