"""The engine's structured-output stage, around a step: drafts of constrained requests are cut where their grammar
refuses a token (trees pruned) before the forward; after it, every verification row of a constrained request gets
its own mask (row j: the tokens allowed after the first j drafts, or after its tree node's path); at commit the
accepted tokens advance the grammar and the tokens it then forces are appended without sampling (jump-forward:
the next step computes their KV as a short prefill).

Lossless: the mask makes the target distribution the constrained one, and every verification rule (greedy,
rejection sampling, trees, positional sampling) then keeps that distribution, whatever the drafts were. Requests
without a grammar pay one attribute check."""

from __future__ import annotations

import time

import llguidance
import torch

from ..draft import Draft
from ..models.tokenizer import Tokenizer
from ..request import Request
from ..runner import ModelOutput
from ..scheduler import SchedulerOutput
from ..speculation import Speculation
from ..verification.stats import SpecDecodingStats
from ..verification.tree import TokenTree
from .grammar import GrammarError, compile_grammar, vocabulary
from .matcher import GrammarState
from .params import StructuredOutputsParams


class GrammarDeadEnd(RuntimeError):
    """A constrained request's grammar allows no token: the request fails, the batch goes on."""


def start_grammar(ask: StructuredOutputsParams, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                  jump_forward: bool) -> GrammarState:
    """A fresh grammar state for one request, or GrammarError saying why its ask cannot be compiled."""
    vocab = vocabulary(tokenizer, vocab_size)
    matcher = llguidance.LLMatcher(vocab, compile_grammar(ask, vocab), log_level=0)
    if matcher.is_error():
        raise GrammarError(f"invalid {ask.kind}: {matcher.get_error()}")
    return GrammarState(matcher, vocab_size, eos_token_ids, jump_forward)


class Constraints:
    def __init__(self, speculation: Speculation) -> None:
        self.speculation = speculation

    @property
    def stats(self) -> SpecDecodingStats:  # speculation's (its counters are reported and reset together)
        return self.speculation.stats

    def cut_drafts(self, sched: SchedulerOutput) -> None:
        """Before the forward: keep of each constrained draft only what its grammar allows."""
        for s in sched.scheduled:
            req = s.request
            if req.grammar is None or not req.draft.tokens:
                continue
            start = time.perf_counter()
            before = len(req.draft.tokens)
            req.draft = _pruned(req.draft, req.grammar)
            if len(req.draft.tokens) < before:
                self.stats.num_grammar_cuts += 1
                self.stats.num_grammar_cut_tokens += before - len(req.draft.tokens)
            self.stats.grammar_seconds += time.perf_counter() - start

    def mask(self, sched: SchedulerOutput, out: ModelOutput) -> None:
        """After the forward: each constrained row's disallowed tokens get -inf logits."""
        start, masked = time.perf_counter(), False
        for i, s in enumerate(sched.scheduled):
            req = s.request
            if req.grammar is None or out.row_start[i] < 0:
                continue
            masked, n = True, out.num_rows[i]
            allowed = req.grammar.allowed(_row_paths(req.draft, n))
            with torch.inference_mode():  # the logits are inference tensors
                rows = out.logits[out.row_start[i]: out.row_start[i] + n]
                rows.masked_fill_(~torch.from_numpy(allowed).to(rows.device), float("-inf"))
        if masked:
            self.stats.grammar_seconds += time.perf_counter() - start

    def extend(self, req: Request, tokens: list[int], max_model_len: int) -> list[int]:
        """At commit, before the step's tokens are appended: advance the grammar over them and return the
        tokens it forces next (to append after them), within max_tokens and the model's length. Raises
        GrammarDeadEnd where the grammar allowed no token."""
        state = req.grammar
        if state is None:
            return []
        start = time.perf_counter()
        try:
            return self._extend(req, state, tokens, max_model_len)
        finally:
            self.stats.grammar_seconds += time.perf_counter() - start

    def _extend(self, req: Request, state: GrammarState, tokens: list[int], max_model_len: int) -> list[int]:
        ends = [i for i, t in enumerate(tokens) if t in req.eos_token_ids or t in req.params.stop_token_ids]
        state.advance(tokens[: ends[0]] if ends else tokens)  # (the answer ends at EOS: a stopped grammar allows it)
        if state.error is not None:
            raise GrammarDeadEnd(state.error)
        if ends:
            return []
        length = req.num_tokens + len(tokens)
        room = min(req.params.max_tokens - req.num_output_tokens - len(tokens), max_model_len - length)
        forced = state.forced(room)
        self.stats.num_forced_tokens += len(forced)
        return forced


def _row_paths(draft: Draft, rows: int) -> list[list[int]]:
    """The tokens each verification row follows: row 0 none, then each draft prefix (or tree node's path)."""
    if draft.tree is not None and rows > 1:
        tree = draft.tree
        return [[]] + [[tree.tokens[n] for n in tree.path(node)] for node in range(rows - 1)]
    return [draft.tokens[:j] for j in range(rows)]


def _pruned(draft: Draft, state: GrammarState) -> Draft:
    """The draft without what the grammar refuses: a chain cut at its first refused token, a tree without its
    refused nodes (and their subtrees)."""
    if draft.tree is None:
        n = state.valid_prefix(draft.tokens)
        if n == len(draft.tokens):
            return draft
        return Draft(draft.tokens[:n], None if draft.probs is None else draft.probs[:n],
                     None if draft.soft_probs is None else draft.soft_probs[:n],
                     None if draft.entropies is None else draft.entropies[:n])
    tree = draft.tree
    ok = state.valid_nodes(tree)
    if all(ok):
        return draft
    keep = [i for i, good in enumerate(ok) if good]
    if not keep:
        return Draft([])
    new_index = {old: new for new, old in enumerate(keep)}
    ranks = None
    if tree.ranks is not None:  # the kept nodes in their old confidence order
        order = sorted(keep, key=lambda i: tree.ranks[i])  # type: ignore[index]
        rank_of = {node: r for r, node in enumerate(order)}
        ranks = [rank_of[i] for i in keep]
    pruned = TokenTree([tree.tokens[i] for i in keep], [new_index.get(tree.parents[i], -1) for i in keep], ranks)
    index = torch.tensor(keep)
    return Draft(pruned.tokens, None if draft.probs is None else draft.probs[index.to(draft.probs.device)],
                 None if draft.soft_probs is None else draft.soft_probs[index.to(draft.soft_probs.device)],
                 draft.entropies, pruned)
