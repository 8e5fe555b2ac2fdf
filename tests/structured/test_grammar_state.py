"""The grammar state on its own, over the dummy models' byte tokenizer (id = byte + 3, so expectations can be
written by hand): drafts cut at the first refused token, trees pruned with their ranks kept in order, one mask per
verification row, forced tokens, and a dead end that records its error instead of leaving a row with no token."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from turbospec.draft import Draft
from turbospec.models.tokenizer import ByteTokenizer
from turbospec.structured.constraints import _pruned, _row_paths, start_grammar
from turbospec.structured.grammar import GrammarError
from turbospec.structured.params import StructuredOutputsParams
from turbospec.verification.tree import TokenTree

VOCAB = 300
TOK = ByteTokenizer(VOCAB)


def ids(text: str) -> list[int]:
    return [b + 3 for b in text.encode()]


def state(**ask: object):
    return start_grammar(StructuredOutputsParams(**ask), TOK, VOCAB, TOK.eos_token_ids, jump_forward=True)


def test_a_chain_is_cut_at_the_first_refused_token() -> None:
    g = state(regex="ab+c")
    probs = torch.rand(5, VOCAB)
    cut = _pruned(Draft(ids("abbxc"), probs), g)
    assert cut.tokens == ids("abb") and torch.equal(cut.probs, probs[:3])
    whole = Draft(ids("abbc"))
    assert _pruned(whole, g) is whole


def test_a_tree_loses_refused_nodes_and_their_subtrees() -> None:
    g = state(choice=["cat", "car", "dog"])
    # c -> a -> {t, r, x}, x -> s ; q (refused at the root) -> a
    tree = TokenTree(ids("catrxsqa"), [-1, 0, 1, 1, 1, 4, -1, 6], ranks=[0, 1, 2, 3, 4, 5, 6, 7])
    pruned = _pruned(Draft(list(tree.tokens), tree=tree), g)
    assert pruned.tree is not None
    assert pruned.tokens == ids("catr") and pruned.tree.parents == [-1, 0, 1, 1]
    assert pruned.tree.ranks == [0, 1, 2, 3]


def test_each_verification_row_has_its_own_mask() -> None:
    g = state(regex="ab+c")
    draft = Draft(ids("abb"))
    allowed = g.allowed(_row_paths(draft, 4))
    assert allowed.shape == (4, VOCAB)
    as_sets = [set(np.flatnonzero(row)) for row in allowed]
    assert as_sets[0] == set(ids("a"))
    assert as_sets[1] == set(ids("b"))
    assert as_sets[2] == as_sets[3] == set(ids("bc"))
    # computing masks for the drafts leaves the state where it was
    assert set(np.flatnonzero(g.allowed([[]])[0])) == set(ids("a"))


def test_tree_rows_follow_their_node_paths() -> None:
    g = state(choice=["cat", "cow"])
    tree = TokenTree(ids("cao"), [-1, 0, 0])
    allowed = g.allowed(_row_paths(Draft(ids("cao"), tree=tree), 4))
    assert [set(np.flatnonzero(r)) for r in allowed] == [set(ids("c")), set(ids("ao")), set(ids("t")), set(ids("w"))]


def test_forced_tokens_and_the_end() -> None:
    g = state(choice=["hello world"])
    assert g.forced(100) == ids("hello world")
    assert g.matcher.is_accepting()
    assert set(np.flatnonzero(g.allowed([[]])[0])) == {TOK.eos_token_ids[0]}
    g2 = state(choice=["hello world"])
    assert g2.forced(3) == ids("hel")  # within the room left


def test_a_dead_end_records_its_error_and_keeps_the_row_defined() -> None:
    g = state(regex="ab")
    g.matcher.consume_token(ids("x")[0])  # a refused token puts the matcher in its error state
    allowed = g.allowed([[]])
    assert g.error is not None and "dead end" in g.error
    assert set(np.flatnonzero(allowed[0])) == set(TOK.eos_token_ids)


@pytest.mark.parametrize("ask, reason", [
    ({"regex": "a(b"}, "unclosed group"),
    ({"json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "strin"),
    ({"grammar": "start: missing_rule"}, "missing_rule"),
    ({"json": {"type": "array", "contains": {"type": "integer"}}}, "Unimplemented keys"),  # unsupported feature
])
def test_invalid_asks_say_why(ask: dict, reason: str) -> None:
    with pytest.raises(GrammarError, match=reason):
        state(**ask)


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["b"]}, "exactly one"),
    ({"json": "{not json"}, "does not parse"),
    ({"choice": []}, "non-empty list"),
    ({"regex": ""}, "non-empty string"),
])
def test_params_refuse_bad_shapes(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)
