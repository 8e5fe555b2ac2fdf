"""A draft's cut vocabulary (proposers/draft_vocab.py): which tokens it keeps, and that the logits it gives are the full
head's on those tokens and -inf elsewhere (greedy exactness with it: test_spec.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from turbospec.models.loader import load_model
from turbospec.models.registry import pull
from turbospec.models.weight_format import _load_packs
from turbospec.proposers.draft_vocab import (AUTO_SIZE, DraftVocabulary, VocabHead, frequent_tokens, resolve_size,
                                             token_counts)

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def loaded():
    return load_model(MODEL, "float32", progress=False)


@dataclass
class _Request:  # the two fields the vocabulary reads
    request_id: str
    all_token_ids: list[int]


def test_auto_cuts_only_large_vocabularies():
    assert resolve_size("auto", 151936) == AUTO_SIZE
    assert resolve_size("auto", 49152) is None  # SmolLM2: the head is small already
    assert resolve_size(0, 151936) is None and resolve_size(None, 151936) is None
    assert resolve_size(200_000, 151936) is None
    assert resolve_size(1000, 49152) == 1000


def test_the_kept_tokens_are_the_most_frequent_plus_the_special_ones(loaded):
    tok, vocab = loaded.tokenizer, loaded.config.vocab_size
    ids = frequent_tokens(tok, vocab, 1000)
    assert len(ids) == 1008  # rounded up to the packed head's 16-row blocks
    assert torch.equal(ids, ids.sort().values) and len(set(ids.tolist())) == len(ids)
    assert set(tok.eos_token_ids) <= set(ids.tolist())
    counts = token_counts(tok, vocab)
    assert counts is not None and counts.sum() > 1_000_000  # ShareGPT's answers, counted once and cached
    top = np.argsort(-counts, kind="stable")[:900]
    assert set(top.tolist()) <= set(ids.tolist())
    space = tok.encode(" the", add_special_tokens=False)
    assert len(space) == 1 and space[0] in ids.tolist()


def test_logits_are_the_full_heads_on_kept_and_request_tokens_and_minus_inf_elsewhere(loaded):
    model = loaded.model
    vocab = DraftVocabulary.for_model(model, loaded.tokenizer, 256)
    kept = set(vocab.head.ids.tolist())
    rare = [t for t in range(loaded.config.vocab_size - 1, 0, -1) if t not in kept][:3]
    reqs = [_Request("a", [1, 2, rare[0], rare[1]]), _Request("b", [rare[2]])]
    hidden = torch.randn(2, loaded.config.hidden_size)
    got = vocab.logits(hidden, reqs)
    full = model.compute_logits(hidden)
    assert got.shape == full.shape and got.dtype == torch.float32
    for row, allowed in enumerate([kept | {1, 2, rare[0], rare[1]}, kept | {rare[2]}]):
        finite = set(torch.isfinite(got[row]).nonzero().flatten().tolist())
        assert finite == allowed
        index = torch.tensor(sorted(allowed))
        torch.testing.assert_close(got[row, index], full[row, index], rtol=1e-4, atol=1e-4)
    # a request's later tokens join its set; a freed request starts over
    reqs[1].all_token_ids.append(rare[0])
    assert torch.isfinite(vocab.logits(hidden, reqs)[1, rare[0]])
    vocab.free("b")
    assert "b" not in vocab.context


def test_a_vocab_head_runs_the_files_packed_rows_and_matches_the_dense_ones():
    """Heads (Medusa, Hydra, EAGLE) and cut draft vocabularies score their tokens on the LM head's packed rows."""
    loaded = load_model(MODEL, "bfloat16", progress=False, weight_format="auto")
    model = loaded.model
    packed = model.lm_head_packed  # SmolLM2's Q8_0 head: amx-int8, or our int8 kernel without AMX
    if packed is None:  # `auto` keeps it dense where packed was slower at every row count (AVX2 CPUs): pack it here
        assert "lm_head.weight" in loaded.weights.kept_dense, loaded.weights.kept_dense
        _, packs = _load_packs(model, pull(MODEL, progress=False), torch.bfloat16, False, None, False)
        packed = packs["lm_head.weight"]
    weight = model.embed.weight
    ids = torch.arange(0, 32 * 16 * 7, 7)  # 512 ids, a multiple of 16
    head = VocabHead(weight, ids, packed)
    assert head.packed is not None and head.packed.parts[0].out_features == len(ids)
    x = torch.randn(3, loaded.config.hidden_size).to(torch.bfloat16)
    want = torch.nn.functional.linear(x.float(), weight[ids].float())
    got = head(x)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    assert torch.equal(head(x.unsqueeze(0))[0], got)  # any leading dims
    assert head._dense is None  # no dense copy until a call needs one
    torch.testing.assert_close(head(x.float()), want, rtol=1e-2, atol=1e-2)  # another dtype: dense rows
    assert head._dense is not None
