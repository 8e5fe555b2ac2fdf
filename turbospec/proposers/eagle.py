"""An EAGLE-style draft (EAGLE 2401.15077, EAGLE-3 2503.01840): one small decoder layer over the target's features.

Each position j of the sequence so far is an entry (s_j, t_j): s_j is the fused target feature at j and t_j the
token the target chose there (the token at j + 1). The draft layer reads the entries of a window of recent
positions, causally, and its output at the last one predicts the token after t_j (through the target's LM
head on a draft vocabulary). To draft further, the output itself becomes the next entry's state, with the
token just drafted (EAGLE feeds its own predicted features back; EAGLE-3 trains on exactly that, which
``training/eagle.py`` does by unrolling).
- Features (EAGLE-3): the outputs of a low and a middle target layer and the final hidden state, fused by a
  low-rank projection added to the final hidden state.
- The layer: [state; RMS-normalised token embedding] -> low-rank input projection (residual), multi-head
  attention without positions over the window (causal order is the position signal), SwiGLU MLP.
- Sized for CPU and for the repository's 50 MB: attention width 256, MLP 512, ranks H / 4.
Unlike EAGLE there is no draft KV cache kept between steps: the window is short (16 entries), so each step
recomputes the layer over it, which keeps the draft stateless across preemption and rollback. Within one
call, appended entries reuse the earlier entries' keys and values (`past`), as training's unrolling does;
the proposer (head_proposer.py) computes each tree node's entry once, at the node's expansion.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..models.layers import RowLinear
from ..models.packed import PackedWeight
from .draft_vocab import VocabHead
from .heads import read_head_file, save_head_file

HEAD_DIM = 64


@dataclass
class EagleConfig:
    hidden_size: int
    feature_layers: list[int]  # target layers whose outputs are fused with the final hidden state
    rank: int
    attn_dim: int
    mlp_dim: int
    window: int  # target positions the draft attends to
    depth: int  # draft steps trained (the deepest tree level)
    model: str
    vocab_size: int
    method: str = "eagle"


def default_feature_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low and middle layers (the final hidden state is the high one)."""
    return [max(0, num_layers // 4 - 1), num_layers // 2 - 1]


def window_mask(valid: torch.Tensor) -> torch.Tensor:
    """valid [B, T] (False: left padding) -> causal attention mask [B, T, T] over real entries; a padded query
    sees itself (its row is never read), so no softmax row is empty."""
    t = valid.shape[1]
    return (torch.ones(t, t, dtype=torch.bool).tril()[None] & valid[:, None, :]) | torch.eye(t, dtype=torch.bool)[None]


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


class EagleDraft(nn.Module):
    def __init__(self, config: EagleConfig, vocab: torch.Tensor) -> None:
        super().__init__()
        self.config = config
        h, r = config.hidden_size, config.rank
        features = (len(config.feature_layers) + 1) * h
        # RowLinear: at inference, in bf16, our rows kernel (the draft's products are a few rows, where it beats
        # torch's: benchmarks/results/bf16_rows/bf16_rows*.md); in training it is nn.Linear
        self.fuse_down, self.fuse_up = RowLinear(features, r), RowLinear(r, h)
        self.in_down, self.in_up = RowLinear(2 * h, r), RowLinear(r, h)
        self.norm1 = nn.Parameter(torch.ones(h))
        self.qkv = RowLinear(h, 3 * config.attn_dim, bias=False)
        self.o = RowLinear(config.attn_dim, h, bias=False)
        self.norm2 = nn.Parameter(torch.ones(h))
        self.gate_up = RowLinear(h, 2 * config.mlp_dim, bias=False)
        self.down = RowLinear(config.mlp_dim, h, bias=False)
        self.norm_out = nn.Parameter(torch.ones(h))
        for w in (self.fuse_up, self.in_up):  # start from the target's own final hidden state
            nn.init.zeros_(w.weight)
            nn.init.zeros_(w.bias)
        for w in (self.o, self.down):
            nn.init.zeros_(w.weight)
        self.register_buffer("vocab", vocab.long(), persistent=False)
        self.lm_head: VocabHead | None = None  # the LM head's draft-vocabulary rows
        self.embed_weight: torch.Tensor | None = None

    def attach(self, lm_weight: torch.Tensor, embed_weight: torch.Tensor, lm_packed: PackedWeight | None = None
               ) -> EagleDraft:
        """The target's LM head (and its packed form: the draft vocabulary's rows then run packed) and embedding."""
        self.lm_head = VocabHead(lm_weight.detach(), self.vocab, lm_packed)
        self.embed_weight = embed_weight.detach()
        return self

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., (c + 1) H] -> the entry state [..., H]."""
        final = features[..., -self.config.hidden_size:]
        return final + self.fuse_up(F.silu(self.fuse_down(features)))

    def forward(self, states: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None = None, appended: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """states [B, T, H], tokens [B, T] -> outputs [B, T, H] and the keys / values of every entry so far.

        mask [B, T, P + T] (True: query may attend key) covers `past` (P earlier entries' keys and values, from
        a previous call) and these T entries: earlier outputs never change when entries are appended (causal),
        so drafting one more entry costs one position, not the whole window again.
        `appended` [B, M, H]: DART's mask entries (dart.py), placed after the T entries: each is the last entry's
        input plus its offset in units of that input's RMS (a mask needs the context's latest state: the layer
        has no positions, so attention alone could not find it); T and the mask then count them too."""
        assert self.embed_weight is not None, "attach() the target's tensors first"
        e = _rms(F.embedding(tokens, self.embed_weight).to(states.dtype))
        x = states + self.in_up(F.silu(self.in_down(torch.cat([states, e], dim=-1))))
        if appended is not None:
            last = x[:, -1:]
            scale = last.float().pow(2).mean(-1, keepdim=True).sqrt().to(x.dtype)
            x = torch.cat([x, last + appended.to(x.dtype) * scale], dim=1)
        b, t, _ = x.shape
        q, k, v = self.qkv(_rms(x) * self.norm1).view(b, t, 3, -1, HEAD_DIM).permute(2, 0, 3, 1, 4)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        x = x + self.o(attn.transpose(1, 2).reshape(b, t, -1))
        gate, up = self.gate_up(_rms(x) * self.norm2).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up), (k, v)

    def logits(self, outputs: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "attach() the target's tensors first"
        return self.lm_head(_rms(outputs) * self.norm_out)

    def save(self, path: Path, extra: dict[str, object]) -> None:
        save_head_file(path, self, asdict(self.config), extra)

    @classmethod
    def load(cls, path: Path, dtype: torch.dtype = torch.float32) -> tuple[EagleDraft, dict[str, object]]:
        config, tensors, extra = read_head_file(path, "eagle")
        draft = cls(EagleConfig(**config), tensors.pop("vocab"))  # type: ignore[arg-type]
        draft.load_state_dict({k: v.to(dtype) for k, v in tensors.items()})
        draft.to(dtype).requires_grad_(False)
        return draft, extra
