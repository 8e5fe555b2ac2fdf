"""Draft heads on the target's last hidden state: Medusa (2401.10774) and Hydra (2402.05109), sized for CPU.

Both read h, the target's final hidden state (after the final norm) at the row that chose the request's last
token x_0, and predict the tokens after it. Head i (1-based) predicts x_i:
- Medusa: ``z_i = h + W2_i silu(W1_i h)``; heads are independent of each other's guesses;
- Hydra: ``z_i = z_{i-1} + W2_i silu(W1_i [z_{i-1}; e(x_{i-1})])`` with z_0 = h and e the target's own
  input embedding (RMS-normalised), so each head sees the tokens drafted before it (x_0 is the known one).
Logits are the target's own LM head applied to z_i, restricted to a draft vocabulary: the tokens most
frequent in the training answers (EAGLE-3 does the same). By weights read, the full LM head of
qwen2.5-coder-1.5b (152k x 1536, 233M) is about 15% of the model per row; 8k draft rows are 1/19 of that
(weight counts, not a timing).
The LM head and embeddings are not stored: a head file holds W1, W2 and the vocabulary (1.4-14 MB here).
W1 is H x r (Hydra: 2H x r) and W2 r x H with r = H / 4, which keeps Medusa, Hydra and EAGLE for two models
under the 50 MB the repository allows for heads (45 MB in heads/).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from ..models.packed import PackedWeight
from .draft_vocab import VocabHead

HEAD_METHODS = ("medusa", "hydra")
HEADS_DIR = Path(__file__).resolve().parents[2] / "heads"


@dataclass
class HeadConfig:
    method: str  # medusa | hydra
    num_heads: int
    hidden_size: int
    rank: int
    model: str  # the target these heads were trained for (registry name)
    vocab_size: int  # the target's vocabulary (draft vocabulary ids index into it)

    def __post_init__(self) -> None:
        if self.method not in HEAD_METHODS:
            raise ValueError(f"unknown head method {self.method!r}: expected one of {', '.join(HEAD_METHODS)}")


class DraftHeads(nn.Module):
    """Medusa or Hydra heads over a frozen LM head restricted to `vocab` (target token ids)."""

    def __init__(self, config: HeadConfig, vocab: torch.Tensor) -> None:
        super().__init__()
        self.config = config
        h, r = config.hidden_size, config.rank
        fan_in = 2 * h if config.method == "hydra" else h
        self.w1 = nn.ModuleList(nn.Linear(fan_in, r) for _ in range(config.num_heads))
        self.w2 = nn.ModuleList(nn.Linear(r, h) for _ in range(config.num_heads))
        for w in self.w2:  # start as the identity: every head begins by predicting what the LM head would
            nn.init.zeros_(w.weight)
            nn.init.zeros_(w.bias)
        self.register_buffer("vocab", vocab.long(), persistent=False)
        # the target's tensors, attached after loading (plain tensors, so never trained or saved)
        self.lm_head: VocabHead | None = None  # the LM head's draft-vocabulary rows
        self.embed_weight: torch.Tensor | None = None  # [V, H]: the input embedding (Hydra)

    def attach(self, lm_weight: torch.Tensor, embed_weight: torch.Tensor, lm_packed: PackedWeight | None = None
               ) -> DraftHeads:
        """The target's LM head (and its packed form: the draft vocabulary's rows then run packed) and embedding."""
        self.lm_head = VocabHead(lm_weight.detach(), self.vocab, lm_packed)
        self.embed_weight = embed_weight.detach()
        return self

    @property
    def sequential(self) -> bool:
        return self.config.method == "hydra"

    def step(self, i: int, z: torch.Tensor, h: torch.Tensor, prev_tokens: torch.Tensor | None) -> torch.Tensor:
        """State of head i (0-based): Medusa reads h, Hydra reads z_{i} and the embedding of the token before."""
        if self.config.method == "medusa":
            return h + self.w2[i](F.silu(self.w1[i](h)))
        assert self.embed_weight is not None and prev_tokens is not None
        e = F.embedding(prev_tokens, self.embed_weight).to(z.dtype)
        e = e * torch.rsqrt(e.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(z.dtype)
        return z + self.w2[i](F.silu(self.w1[i](torch.cat([z, e], dim=-1))))

    def logits(self, z: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "attach() the target's LM head first"
        return self.lm_head(z)

    def save(self, path: Path, extra: dict[str, object]) -> None:
        save_head_file(path, self, asdict(self.config), extra)

    @classmethod
    def load(cls, path: Path, dtype: torch.dtype = torch.float32) -> tuple[DraftHeads, dict[str, object]]:
        config, tensors, extra = read_head_file(path)
        heads = cls(HeadConfig(**config), tensors.pop("vocab"))
        heads.load_state_dict({k: v.to(dtype) for k, v in tensors.items()})
        heads.to(dtype).requires_grad_(False)
        return heads, extra


# --- head files: trained weights (bf16) + the draft vocabulary; config and training report as metadata -------

def save_head_file(path: Path, module: nn.Module, config: dict[str, object], extra: dict[str, object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # weights in bf16; integer tables (DART's n-gram) as int32
    tensors = {k: v.detach().to(torch.bfloat16 if v.is_floating_point() else torch.int32).contiguous()
               for k, v in module.state_dict().items()}
    tensors["vocab"] = module.vocab.to(torch.int32).contiguous()  # type: ignore[union-attr,operator]
    save_file(tensors, str(path), metadata={"config": json.dumps(config), "extra": json.dumps(extra)})


def file_sha256(path: Path) -> str:
    """A head file's identity: what a DART file records of its base, and a fine-tune of its --init."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_head_file(path: Path, method: str | None = None
                   ) -> tuple[dict[str, object], dict[str, torch.Tensor], dict[str, object]]:
    """(config, tensors with "vocab", training report) of a head file; refused unless it holds `method`'s draft
    when one is named."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if "config" not in meta:
        raise ValueError(f"{path} is not a turbospec head file (no config in its metadata)")
    config = json.loads(meta["config"])
    if method is not None and config.get("method") != method:
        raise ValueError(f"{path} holds {config.get('method')} heads, not {method}")
    return config, load_file(str(path)), json.loads(meta.get("extra", "{}"))


def head_path(model: str, method: str) -> Path:
    """Where the committed heads for a registry model live."""
    return HEADS_DIR / f"{model}-{method}.safetensors"
