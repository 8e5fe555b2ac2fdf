"""Attention for a short query as two matmuls (one of the three kernels attention_choice.py measures): beats SDPA
on CPU for a few queries over a gathered context, since it skips SDPA's per-call set-up."""

from __future__ import annotations

import torch


def grouped_matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """q [B, Hq, Q, D], k/v [B, Hkv, L, D], mask [B, 1, Q, L] -> [B, Hq, Q, D]; softmax in float32.

    The query heads that share a KV head are stacked as extra query rows, so GQA needs no repeated K/V."""
    b, hq, nq, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    group = hq // hkv
    scores = torch.matmul(q.reshape(b, hkv, group * nq, d), k.transpose(-1, -2)).float() * scale
    scores = scores.view(b, hkv, group, nq, length).masked_fill(~mask[:, :, None], float("-inf"))
    probs = scores.softmax(-1).to(v.dtype).view(b, hkv, group * nq, length)
    return torch.matmul(probs, v).view(b, hq, nq, d)
