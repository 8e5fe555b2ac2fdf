"""What a proposer drafts for one request and the next step verifies: the request carries it between the two."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .verification.tree import TokenTree


@dataclass
class Draft:
    """Draft tokens for one request (empty: none this step)."""

    tokens: list[int]
    # [len(tokens), V]: the distribution each token was sampled from. None for deterministic proposers
    # (n-gram lookup, or greedy drafting): the verifier then treats q as one-hot at the token.
    probs: torch.Tensor | None = None
    # For acceptance policies that read the draft's distribution (verification/lossy.py): [len(tokens), V] rows
    # (untempered softmax for greedy requests). entropies: the draft entropy (nats) at each token a stop rule
    # read (AdaSD's generation rule, the confidence stop), which verification feeds back into its table. None
    # when neither applies.
    soft_probs: torch.Tensor | None = None
    entropies: list[float] | None = None
    # when the candidates branch: their tree, whose nodes in order are `tokens` (verification/tree.py); None for a chain
    tree: TokenTree | None = None

