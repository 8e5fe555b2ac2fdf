"""The one interface every proposer implements: draft up to k_i tokens for each of a set of requests."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..draft import Draft
from ..request import Request
from ..verification.tree import TokenTree


class Proposer(ABC):
    # True when drafting runs a model token by token (its time is the step-time model's "draft" part)
    runs_model = False
    # True when the proposer drafts from the target's hidden state (heads): the engine calls observe_hidden
    needs_hidden = False
    # target layers whose outputs observe_hidden also receives (EAGLE's fused features)
    capture_layers: tuple[int, ...] = ()
    # True when the proposer reads observe_tree: its chains are verified as one-branch trees too
    observes_trees = False
    # True when the proposer's k drafts are its k most confident nodes of one candidate tree (TokenTree.ranks):
    # the goodput controller then values the k-th node by how often the node of rank k is accepted
    ranks_nodes = False
    # a tree drafter's deepest level: it grows trees level by level, min(this, k) passes (0: not a tree drafter)
    tree_levels = 0
    # True when proposing costs nothing (a lookup in the request's own tokens): under the goodput controller the
    # lookups are made first, and the controller chooses how many of the found tokens to verify
    free_lookups = False
    # True when a draft can end where the drafter turns unsure; `confidence_stop` says whether this step's drafts
    # do (set before each propose: auto mode with SpeculativeConfig.draft_stop "confidence")
    stops_when_unsure = False
    confidence_stop = False

    def draft_levels(self, max_k: int) -> int:
        """The levels a tree drafter grows for a step whose largest k is max_k: a tree of k nodes is at most k
        levels deep, so levels past it would never be kept (the step-time model's `draft_levels` feature)."""
        return min(self.tree_levels, max_k)

    @abstractmethod
    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[Draft]:
        """Draft at most num_tokens[i] tokens for requests[i] (fewer, even none, is allowed)."""

    def catch_up_tokens(self, request: Request) -> int:
        """Tokens of this request a model-based proposer has not run over yet (its prompt, the first time)."""
        return 0

    def observe_hidden(self, request: Request, hidden: torch.Tensor, tokens: list[int], num_tokens: int) -> None:
        """This step's emitted `tokens` and, per token, the target's hidden state at the row that chose it:
        [len(tokens), H], or [len(tokens), (c + 1) * H] with the `capture_layers` outputs first when the
        proposer sets them. The request then has num_tokens tokens."""

    def observe_tree(self, request: Request, tree: TokenTree, argmax: list[int]) -> None:
        """The target's argmax at the root (argmax[0]) and at every node of the request's verified tree."""

    def on_verified(self, request: Request, num_accepted: int) -> None:
        """Called after the target verified this request's draft and committed num_accepted of its tokens."""

    def rollback(self, request: Request, num_tokens: int) -> None:
        """The request's sequence was cut back to num_tokens tokens (an llm42 replay disagreed with a token):
        forget any state computed for the tokens after them."""

    def free(self, request_id: str) -> None:
        """The request finished or was aborted: drop any state kept for it."""
