"""One request's grammar state: an llguidance matcher advanced by the tokens the request committed, with what
speculation asks of it: how much of a draft (or which nodes of a tree) the grammar allows, one token mask per
verification row, and the tokens the grammar forces next."""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import numpy as np

from ..verification.tree import TokenTree


class GrammarState:
    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_token_ids: Sequence[int],
                 jump_forward: bool) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.jump_forward = jump_forward
        self.error: str | None = None  # set once the grammar reaches a dead end; the request then fails
        self.words = (vocab_size + 31) // 32

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of a draft the grammar allows from here."""
        return self.matcher.validate_tokens(list(tokens)) if tokens else 0

    def valid_nodes(self, tree: TokenTree) -> list[bool]:
        """Whether each node's path from the root is allowed (parents come before children)."""
        ok: list[bool] = []
        for i, parent in enumerate(tree.parents):
            if parent >= 0 and not ok[parent]:
                ok.append(False)
                continue
            path = [tree.tokens[n] for n in tree.path(i)]
            ok.append(self.valid_prefix(path) == len(path))
        return ok

    def allowed(self, paths: Sequence[Sequence[int]]) -> np.ndarray:
        """[len(paths), vocab_size] bools: the tokens the grammar allows after each path of (allowed) tokens.
        A row that allows nothing (a dead end) records the error and allows EOS, so sampling stays defined."""
        bits = np.zeros((len(paths), self.words), dtype=np.int32)
        for row, path in enumerate(paths):
            if path and not self.matcher.consume_tokens(list(path)):
                raise RuntimeError(f"a validated draft was refused by the grammar: {self.matcher.get_error()}")
            self.matcher.unsafe_compute_mask_ptr(bits[row].ctypes.data, bits[row].nbytes)
            if path:
                self.matcher.rollback(len(path))
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, : self.vocab_size].astype(bool)
        dead = ~allowed.any(axis=1)
        if (dead[0] or self.matcher.is_error()) and self.error is None:
            self.error = f"the grammar allows no token here (a dead end): {self.matcher.get_error() or 'no reason given'}"
        if dead.any():
            allowed[np.ix_(dead, self.eos_token_ids)] = True
        return allowed

    def advance(self, tokens: Sequence[int]) -> None:
        """Commit a step's tokens (sampled under this grammar's masks, so allowed unless it reached a dead end)."""
        if self.error is None and not self.matcher.consume_tokens(list(tokens)):
            self.error = f"the grammar refused a token: {self.matcher.get_error()}"

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar allows as the only continuation (jump-forward), consumed."""
        if not self.jump_forward or self.error is not None or limit <= 0 or self.matcher.is_stopped():
            return []
        tokens = self.matcher.compute_ff_tokens()[:limit]
        if tokens and not self.matcher.consume_tokens(tokens):
            self.error = f"the grammar refused its own forced tokens: {self.matcher.get_error()}"
            return []
        return tokens
