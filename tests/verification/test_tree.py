"""Token trees: the attention mask against dense per-path attention, greedy tree acceptance against a brute-force
reference, sampled tree acceptance against the target's exact distributions (chi-square), and compaction."""

from __future__ import annotations

import random

import pytest
import torch
from test_verifier import chi2_critical, chi2_stat

from turbospec.attention import build_metadata, paged_attention
from turbospec.sampler import make_generator
from turbospec.verification.tree import TokenTree, compaction, verify_tree_greedy, verify_tree_sampled

torch.set_num_threads(1)


def random_tree(rng: random.Random, nodes: int, vocab: int) -> TokenTree:
    """Random trie: each node picks a random earlier parent and a token not used by its siblings."""
    tokens: list[int] = []
    parents: list[int] = []
    for i in range(nodes):
        for _ in range(50):
            p = rng.randint(-1, i - 1)
            tok = rng.randrange(vocab)
            if not any(pp == p and t == tok for pp, t in zip(parents, tokens)):
                break
        tokens.append(tok)
        parents.append(p)
    return TokenTree(tokens, parents)


def test_tree_structure_and_validation():
    tree = TokenTree.from_paths([[5, 6, 7], [5, 8], [9]])
    assert tree.tokens == [5, 6, 7, 8, 9] and tree.parents == [-1, 0, 1, 0, -1] and tree.depth == [1, 2, 3, 2, 1]
    assert tree.children() == [[0, 4], [1, 3], [2], [], [], []]
    assert tree.path(2) == [0, 1, 2] and tree.path(3) == [0, 3]
    assert tree.positions(10) == [10, 11, 12, 13, 12, 11]
    assert tree.positions(10, num_known=3) == [8, 9, 10, 11, 12, 13, 12, 11]
    assert TokenTree.chain([1, 2, 3]).is_chain and not tree.is_chain
    with pytest.raises(ValueError, match="parent 3 must be -1"):
        TokenTree([1, 2], [-1, 3])
    with pytest.raises(ValueError, match="one parent per token"):
        TokenTree([1, 2], [-1])


@pytest.mark.parametrize("nodes", [7, 25], ids=["short-query-kernel", "sdpa-kernel"])
@pytest.mark.parametrize("num_known", [1, 3])
def test_tree_mask_equals_dense_attention_along_each_path(nodes, num_known):
    """Each node's attention output equals causal attention over context + known tokens + its own path."""
    gen = torch.Generator().manual_seed(nodes + num_known)
    tree = random_tree(random.Random(nodes), nodes, vocab=50)
    hq, hkv, d, ctx = 4, 2, 16, 9
    q_len = num_known + nodes
    total = ctx + q_len
    slots = torch.randperm(64, generator=gen)[:total]  # scattered, as pages are
    k_cache, v_cache = torch.zeros(64, hkv, d), torch.zeros(64, hkv, d)
    ctx_k, ctx_v = torch.randn(ctx, hkv, d, generator=gen), torch.randn(ctx, hkv, d, generator=gen)
    k_cache[slots[:ctx]], v_cache[slots[:ctx]] = ctx_k, ctx_v
    q = torch.randn(q_len, hq, d, generator=gen)
    k, v = torch.randn(q_len, hkv, d, generator=gen), torch.randn(q_len, hkv, d, generator=gen)
    meta = build_metadata([q_len], [total], [slots], tree_masks=[tree.attention_mask(num_known)])
    out = paged_attention(q, k, v, k_cache, v_cache, meta, scale=d**-0.5).view(q_len, hq, d)
    all_k, all_v = torch.cat([ctx_k, k]), torch.cat([ctx_v, v])
    for row in range(q_len):
        if row < num_known:
            keys = list(range(ctx + row + 1))
        else:
            keys = list(range(ctx + num_known)) + [ctx + num_known + n for n in tree.path(row - num_known)]
        kk = all_k[keys].repeat_interleave(hq // hkv, dim=1)  # [L, hq, d]
        vv = all_v[keys].repeat_interleave(hq // hkv, dim=1)
        weights = torch.einsum("hd,lhd->hl", q[row], kk).mul(d**-0.5).softmax(-1)
        want = torch.einsum("hl,lhd->hd", weights, vv)
        torch.testing.assert_close(out[row], want, atol=1e-5, rtol=1e-5)


def _greedy_reference(tree: TokenTree, argmax: list[int]) -> list[int]:
    """Follow the target's greedy chain while it stays on a root-to-node path of the tree."""
    node_of = {tuple(tree.tokens[i] for i in tree.path(n)): n for n in range(len(tree))}
    emitted: list[int] = []
    row = 0
    while True:
        emitted.append(argmax[row])
        node = node_of.get(tuple(emitted))
        if node is None:
            return emitted
        row = node + 1


def test_greedy_tree_acceptance_matches_brute_force():
    rng = random.Random(0)
    for case in range(300):
        vocab = rng.choice([2, 3, 6])
        tree = random_tree(rng, rng.randint(1, 12), vocab)
        argmax = [rng.randrange(vocab) for _ in range(len(tree) + 1)]
        path, emitted = verify_tree_greedy(tree, argmax)
        assert emitted == _greedy_reference(tree, argmax), case
        assert [tree.tokens[i] for i in path] == emitted[:-1]
        assert all(tree.parents[b] == a for a, b in zip([-1] + path, path))  # a real root-to-node path


V = 5
TRIALS = 20_000


def test_sampled_tree_acceptance_is_the_target_distribution():
    """First token ~ p(root); given the first token is child c, the second ~ p(c) — whatever the candidates."""
    torch.manual_seed(1)
    tree = TokenTree.from_paths([[1, 2], [1, 0], [3, 4], [0]])  # root children 1, 3, 0; node "1" has children 2, 0
    probs = torch.distributions.Dirichlet(torch.ones(V)).sample((len(tree) + 1,)).double()
    probs = (probs + 0.05) / (probs + 0.05).sum(-1, keepdim=True)  # every cell large enough for the test
    g = make_generator(7)
    first = torch.zeros(V)
    second_after_1 = torch.zeros(V)
    depth_counts = [0, 0, 0]
    for _ in range(TRIALS):
        path, emitted = verify_tree_sampled(tree, probs, g)
        first[emitted[0]] += 1
        if path and tree.tokens[path[0]] == 1:
            second_after_1[emitted[1]] += 1
        depth_counts[len(path)] += 1
    assert chi2_stat(first, probs[0]) < chi2_critical(V - 1)
    node1 = tree.tokens.index(1)
    assert chi2_stat(second_after_1, probs[node1 + 1]) < chi2_critical(V - 1)
    # accepting some candidate at the root happens with p(1) + p(3) + p(0)
    assert depth_counts[0] / TRIALS == pytest.approx(1 - float(probs[0][[1, 3, 0]].sum()), abs=0.015)
    # seeded: the same generator state gives the same result
    assert verify_tree_sampled(tree, probs, make_generator(3)) == verify_tree_sampled(tree, probs, make_generator(3))


def test_greedy_rows_accept_the_argmax_path_under_sampling_rule():
    """One-hot rows (a greedy target) make the sampled rule agree with the greedy one."""
    rng = random.Random(5)
    for _ in range(50):
        tree = random_tree(rng, rng.randint(1, 10), 4)
        argmax = [rng.randrange(4) for _ in range(len(tree) + 1)]
        onehot = torch.nn.functional.one_hot(torch.tensor(argmax), 4).double()
        assert verify_tree_sampled(tree, onehot, make_generator(0)) == verify_tree_greedy(tree, argmax)


def test_compaction_moves_the_accepted_path_down():
    tree = TokenTree.from_paths([[5, 6, 7], [5, 8], [9, 1]])
    path = [0, 3]  # tokens 5, 8
    assert compaction(tree, path, root_slot_index=10) == ([14], [12])
    assert compaction(tree, [0, 1, 2], root_slot_index=10) == ([], [])
    assert compaction(tree, [4, 5], root_slot_index=0) == ([5, 6], [1, 2])


def test_sliding_window_is_measured_from_the_nodes_depth():
    """A node at depth d sits at position root + d, not at its flat index: a window counts back from there."""
    tree = TokenTree.from_paths([[1, 2], [3, 4, 5]])  # nodes: 1 (d1), 2 (d2), 3 (d1), 4 (d2), 5 (d3)
    ctx, root = 10, 9  # positions 0..8 before the root, the root at 9 (slot 9), five nodes in slots 10..14
    slots = torch.arange(ctx + len(tree))
    meta = build_metadata([1 + len(tree)], [ctx + len(tree)], [slots], tree_masks=[tree.attention_mask(1)],
                          tree_positions=[tree.positions(root)])
    window = 4
    masked = meta.groups[0].mask_for_window(window)[0, 0]
    for row, pos in enumerate(tree.positions(root)):
        visible = masked[row].nonzero().flatten().tolist()
        ancestors = [] if row == 0 else [ctx + n for n in tree.path(row - 1)]
        # keys within the window (the root included) and the node's ancestors, which are all within it
        want = [k for k in range(ctx) if k > pos - window] + ancestors
        assert visible == want, (row, visible, want)


def test_spec_stats_count_trees_by_depth_and_chains_by_position():
    from turbospec.verification.stats import SpecDecodingStats

    stats = SpecDecodingStats()
    stats.observe(3, 2)  # a chain of 3, 2 accepted
    stats.observe(7, 1, depth=2)  # a 7-node tree 2 deep, a path of 1 accepted
    stats.observe(5, 3, depth=3)
    assert stats.num_draft_tokens == 15 and stats.num_accepted_tokens == 6
    assert stats.num_draft_tokens_per_pos == [3, 3, 2]
    assert stats.num_accepted_tokens_per_pos == [3, 2, 1]
    assert stats.mean_accepted_length == 1 + 6 / 3
