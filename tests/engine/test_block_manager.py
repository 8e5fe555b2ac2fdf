"""Tests for the paged-KV block manager (pure Python, CPU only)."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from turbospec.kv.block_manager import BlockManager, NoFreeBlocksError

BS = 4


def snapshot(bm: BlockManager) -> object:
    """Everything observable plus the internals, to prove an operation changed nothing."""
    return copy.deepcopy(
        (bm._blocks, list(bm._free), bm._hash_to_block, {k: vars(v) for k, v in bm._seqs.items()})
    )


def chain_hash(tokens: list[int], bs: int = BS) -> int | None:
    """Independent re-computation of the prefix hash of the last full block of tokens."""
    h = None
    for i in range(len(tokens) // bs):
        h = hash((h, tuple(tokens[i * bs:(i + 1) * bs])))
    return h


# ---------------------------------------------------------------- unit tests
def test_slot_mapping_arithmetic() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    bm.allocate("a", list(range(10)), 10)
    table = bm.block_table("a")
    assert len(table) == 3
    expected = [table[p // BS] * BS + p % BS for p in range(10)]
    assert bm.slot_mapping("a", 0, 10) == expected
    assert bm.slot_mapping("a", 5, 7) == expected[5:7]
    assert bm.slot_mapping("a", 3, 3) == []
    with pytest.raises(ValueError):
        bm.slot_mapping("a", 0, 11)  # position 10 is not reserved
    bm.block_table("a").append(99)  # block_table returns a copy
    assert bm.block_table("a") == table


def test_round_trip_returns_all_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    assert bm.allocate("a", list(range(6)), 3) == 0
    assert (bm.num_slots("a"), len(bm.block_table("a")), bm.num_free_blocks) == (3, 1, 7)
    bm.append_slots("a", 1)  # fills block 0 exactly: no new block
    assert bm.num_free_blocks == 7
    bm.append_slots("a", 6)  # 10 slots -> 3 blocks
    assert (bm.num_slots("a"), len(bm.block_table("a")), bm.num_free_blocks) == (10, 3, 5)
    assert bm.usage() == pytest.approx(3 / 8)
    bm.free("a")
    assert not bm.has_seq("a")
    assert bm.num_free_blocks == 8 and bm.usage() == 0.0
    with pytest.raises(KeyError, match="unknown sequence"):
        bm.free("a")
    with pytest.raises(KeyError):
        bm.block_table("a")


def _alloc_commit(bm: BlockManager, seq: str, tokens: list[int]) -> int:
    cached = bm.allocate(seq, tokens, len(tokens))
    bm.commit(seq, tokens)
    return cached


def test_prefix_hit_count() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    assert _alloc_commit(bm, "a", prompt) == 0
    assert bm.num_cached_prefix_tokens(prompt) == 8
    assert bm.num_cached_prefix_tokens(prompt) == 8  # no side effects
    assert bm.allocate("b", prompt, 2) == 8
    # Reserved = max(num_tokens, cached); cached tokens are committed.
    assert bm.num_slots("b") == 8 and bm.num_committed("b") == 8
    # A prompt of exactly 2 blocks hits only 1 block: the last token must be computed.
    assert bm.num_cached_prefix_tokens(prompt[:8]) == 4
    assert bm.num_cached_prefix_tokens(prompt[:5]) == 4
    assert bm.num_cached_prefix_tokens(prompt[:4]) == 0
    assert bm.num_cached_prefix_tokens([]) == 0


def test_hit_reuses_physical_blocks_and_diverging_prompt_shares_common_blocks() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = list(range(13))
    _alloc_commit(bm, "a", a)
    ta = bm.block_table("a")
    assert bm.allocate("b", a, len(a)) == 12
    tb = bm.block_table("b")
    assert tb[:3] == ta[:3] and tb[3] != ta[3]
    assert [bm._blocks[b].ref_count for b in ta] == [2, 2, 2, 1]
    # Diverges inside block 1: only block 0 is shared.
    c = a[:6] + [99] + a[7:]
    assert bm.allocate("c", c, len(c)) == 4
    tc = bm.block_table("c")
    assert tc[0] == ta[0] and set(tc[1:]).isdisjoint(ta)
    # Same second block content but a different first block: no hit (hash covers the prefix).
    d = [77] + a[1:]
    assert bm.num_cached_prefix_tokens(d) == 0


def test_no_prefix_caching_never_hashes() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    a = list(range(13))
    _alloc_commit(bm, "a", a)
    assert all(b.hash is None for b in bm._blocks) and not bm._hash_to_block
    assert bm.allocate("b", a, len(a)) == 0
    assert set(bm.block_table("a")).isdisjoint(bm.block_table("b"))


def test_truncate_frees_blocks_and_unhashes() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = list(range(12))
    bm.allocate("a", a, 12)
    bm.commit("a", a)
    bm.append_slots("a", 5)  # 17 slots: 5 blocks, speculative draft slots
    t = bm.block_table("a")
    assert len(t) == 5
    bm.truncate("a", 13)  # reject drafts
    assert bm.block_table("a") == t[:4] and bm.num_free_blocks == 12 and bm.num_committed("a") == 12
    bm.truncate("a", 6)  # cut into committed, hashed block 1
    assert bm.block_table("a") == t[:2]
    assert bm.num_slots("a") == 6 and bm.num_committed("a") == 6
    assert bm._blocks[t[1]].hash is None and bm._blocks[t[0]].hash is not None
    assert t[1] not in bm._hash_to_block.values()
    # Block 2 was released whole: its content is intact, so it stays cached.
    assert bm._blocks[t[2]].ref_count == 0 and bm._hash_to_block[bm._blocks[t[2]].hash] == t[2]
    assert bm.num_cached_prefix_tokens(a + [0]) == 4  # chain broken at block 1
    with pytest.raises(ValueError):
        bm.truncate("a", 7)  # cannot grow with truncate
    # Recommit different tokens: block 1 gets the new hash.
    bm.append_slots("a", 2)
    new = a[:6] + [50, 51]
    bm.commit("a", new)
    assert bm._blocks[t[1]].hash == chain_hash(new)
    assert bm.num_cached_prefix_tokens(new + [1]) == 8


def test_truncate_into_shared_block_raises_without_change() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = list(range(9))
    _alloc_commit(bm, "a", a)
    assert bm.allocate("b", a, 9) == 8
    before = snapshot(bm)
    with pytest.raises(ValueError, match="shared"):
        bm.truncate("b", 6)
    assert snapshot(bm) == before
    bm.truncate("b", 8)  # on a block boundary: nothing is overwritten, fine
    bm.truncate("b", 4)
    assert bm.block_table("b") == bm.block_table("a")[:1]


def test_no_free_blocks_leaves_state_unchanged() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    _alloc_commit(bm, "a", list(range(9)))  # 3 blocks; blocks 0,1 hashed
    bm.free("a")  # everything free, two cached blocks
    bm.allocate("x", [7, 7], 2)  # takes an unhashed free block first
    assert bm.num_cached_prefix_tokens(list(range(9))) == 8
    before = snapshot(bm)
    # 8 cached tokens + 9 more need 2 free-hit + 3 new = 5 > 3 free blocks.
    assert not bm.can_allocate(list(range(17)), 17)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate("b", list(range(17)), 17)
    assert snapshot(bm) == before and not bm.has_seq("b")
    assert not bm.can_append("x", 15)
    with pytest.raises(NoFreeBlocksError):
        bm.append_slots("x", 15)
    assert snapshot(bm) == before
    # Exactly fits: 2 hits on free cached blocks + 1 new block = all 3 free blocks.
    assert bm.can_allocate(list(range(9)), 9)
    assert bm.allocate("b", list(range(9)), 9) == 8
    assert bm.num_free_blocks == 0


def test_freed_cached_blocks_hit_until_evicted_lru() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    p1, p2 = [1] * 5, [2] * 5
    _alloc_commit(bm, "a", p1)
    _alloc_commit(bm, "b", p2)
    b1, b2 = bm.block_table("a")[0], bm.block_table("b")[0]
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 6
    # Re-hit p1: same physical block, taken out of the free queue.
    assert bm.allocate("a2", p1, 5) == 4 and bm.block_table("a2")[0] == b1
    bm.free("a2")  # b1 is now the most recently freed
    # Fresh allocations consume unhashed blocks first, then the LRU cached one (b2).
    bm.allocate("x", [9] * 16, 16)
    assert b1 not in bm.block_table("x") and b2 not in bm.block_table("x")
    assert bm.num_cached_prefix_tokens(p2) == 4
    bm.append_slots("x", 1)
    assert b2 in bm.block_table("x")
    assert bm.num_cached_prefix_tokens(p2) == 0 and bm._blocks[b2].hash is None
    assert bm.num_cached_prefix_tokens(p1) == 4
    bm.append_slots("x", 4)
    assert b1 in bm.block_table("x") and bm.num_cached_prefix_tokens(p1) == 0
    assert not bm._hash_to_block


def test_reset_prefix_cache_keeps_live_hashes() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    _alloc_commit(bm, "a", [1] * 5)
    _alloc_commit(bm, "b", [2] * 5)
    bm.free("a")
    bm.reset_prefix_cache()
    assert bm.num_cached_prefix_tokens([1] * 5) == 0
    assert bm.num_cached_prefix_tokens([2] * 5) == 4


def test_duplicate_live_blocks_keep_first_mapping() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    bm.allocate("a", [3] * 4, 4)
    bm.allocate("b", [3] * 4, 4)  # nothing committed yet: no hit
    bm.commit("a", [3] * 4)
    bm.commit("b", [3] * 4)
    ta, tb = bm.block_table("a"), bm.block_table("b")
    assert ta != tb and bm._hash_to_block[chain_hash([3] * 4)] == ta[0]
    bm.free("b")  # an unreachable duplicate: dropped from the cache
    assert bm._blocks[tb[0]].hash is None
    assert bm.allocate("c", [3] * 5, 5) == 4 and bm.block_table("c")[0] == ta[0]


def test_errors() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    bm.allocate("a", [1, 2, 3], 2)
    with pytest.raises(ValueError):
        bm.allocate("a", [1], 1)  # duplicate id
    with pytest.raises(ValueError):
        bm.allocate("b", [1], 2)  # num_tokens > len(token_ids)
    with pytest.raises(ValueError):
        bm.commit("a", [1, 2, 3])  # beyond reserved slots
    with pytest.raises(KeyError):
        bm.commit("zz", [1])
    with pytest.raises(KeyError):
        bm.can_append("zz", 1)


# ----------------------------------------------------------- stateful test
# Shared prompt heads so that random prompts actually collide on full blocks.
PREFIXES = [[], [0, 0, 0, 0], [0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 2, 2, 1], [1, 2, 1, 2, 0, 0, 0, 0, 2]]


class BlockManagerMachine(RuleBasedStateMachine):
    """Random scheduler traffic against a shadow model of the KV cache contents."""

    @initialize(caching=st.sampled_from([True, True, True, False]))
    def setup(self, caching: bool) -> None:
        self.bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=caching)
        self.tokens: dict[str, list[int]] = {}  # known tokens of each live sequence
        self.shadow: dict[int, int] = {}  # slot -> token whose KV the "model" wrote there
        self.prefix_of: dict[int, list[int]] = {}  # block -> full prefix it held when last committed
        self.next_id = 0
        self.dead: list[str] = []  # freed ids, to check that a double free is refused

    def _check_exclusive_write(self, seq: str, start: int, end: int) -> None:
        # The model writes KV for positions >= num_committed; those blocks must be private.
        table = self.bm.block_table(seq)
        for p in range(start, end):
            assert self.bm._blocks[table[p // BS]].ref_count == 1, "write into a shared block"

    def _record_prefixes(self, seq: str) -> None:
        table, toks = self.bm.block_table(seq), self.tokens[seq]
        for i in range(self.bm.num_committed(seq) // BS):
            self.prefix_of[table[i]] = toks[:(i + 1) * BS]

    def _allocate(self, seq: str, toks: list[int], n: int) -> None:
        expected = self.bm.num_cached_prefix_tokens(toks)
        cached = self.bm.allocate(seq, toks, n)
        assert cached == expected and cached % BS == 0
        assert cached < len(toks) or cached == 0
        assert self.bm.num_slots(seq) == max(n, cached) and self.bm.num_committed(seq) == cached
        self.tokens[seq] = toks
        # A hit must map to blocks whose content is this prompt (checked by the invariant).
        self._record_prefixes(seq)

    def _pick(self, data: st.DataObject) -> str:
        return data.draw(st.sampled_from(sorted(self.tokens)), label="seq")

    @rule(head=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 2), max_size=12), data=st.data())
    def allocate(self, head: list[int], tail: list[int], data: st.DataObject) -> None:
        toks = head + tail
        n = data.draw(st.one_of(st.just(len(toks)), st.integers(0, len(toks))), label="num_tokens")
        seq = f"s{self.next_id}"
        self.next_id += 1
        if not self.bm.can_allocate(toks, n):
            before = snapshot(self.bm)
            with pytest.raises(NoFreeBlocksError):
                self.bm.allocate(seq, toks, n)
            assert snapshot(self.bm) == before
            return
        self._allocate(seq, toks, n)

    @precondition(lambda self: self.tokens)
    @rule(n=st.integers(0, 9), data=st.data())
    def append_slots(self, n: int, data: st.DataObject) -> None:
        seq = self._pick(data)
        old = self.bm.num_slots(seq)
        if self.bm.can_append(seq, n):
            self.bm.append_slots(seq, n)
            assert self.bm.num_slots(seq) == old + n
        else:
            before = snapshot(self.bm)
            with pytest.raises(NoFreeBlocksError):
                self.bm.append_slots(seq, n)
            assert snapshot(self.bm) == before

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        seq = self._pick(data)
        old, slots = self.bm.num_committed(seq), self.bm.num_slots(seq)
        n = data.draw(st.one_of(st.just(slots), st.integers(old, slots)), label="num_committed")
        toks = self.tokens[seq]
        if n > len(toks):  # accepted outputs extend the known tokens
            toks = toks + data.draw(st.lists(st.integers(0, 2), min_size=n - len(toks), max_size=n - len(toks)))
        self.tokens[seq] = toks
        self._check_exclusive_write(seq, old, n)
        for p, slot in zip(range(old, n), self.bm.slot_mapping(seq, old, n)):
            self.shadow[slot] = toks[p]
        self.bm.commit(seq, toks[:n])
        assert self.bm.num_committed(seq) == n
        self._record_prefixes(seq)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        seq = self._pick(data)
        n = data.draw(st.integers(0, self.bm.num_slots(seq)), label="truncate_to")
        committed = self.bm.num_committed(seq)
        cut = self.bm.block_table(seq)[n // BS] if n % BS else None
        if cut is not None and self.bm._blocks[cut].ref_count > 1:
            before = snapshot(self.bm)
            with pytest.raises(ValueError):
                self.bm.truncate(seq, n)
            assert snapshot(self.bm) == before
            return
        self.bm.truncate(seq, n)
        assert self.bm.num_slots(seq) == n and self.bm.num_committed(seq) == min(committed, n)
        if n < committed:  # rolled-back tokens are forgotten
            self.tokens[seq] = self.tokens[seq][:n]
        if cut is not None:
            assert self.bm._blocks[cut].hash is None

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = self._pick(data)
        self.bm.free(seq)
        del self.tokens[seq]
        self.dead.append(seq)
        assert not self.bm.has_seq(seq)

    @precondition(lambda self: self.dead)
    @rule(data=st.data())
    def double_free(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.dead), label="dead_seq")
        before = snapshot(self.bm)
        with pytest.raises(KeyError):
            self.bm.free(seq)
        assert snapshot(self.bm) == before

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        """Free, then resume by re-allocating with all known tokens (recompute)."""
        seq = self._pick(data)
        toks = self.tokens.pop(seq)
        self.bm.free(seq)
        n = data.draw(st.integers(0, len(toks)), label="resume_tokens")
        if self.bm.can_allocate(toks, n):
            self._allocate(seq, toks, n)
        else:
            self.dead.append(seq)

    @rule()
    def reset_prefix_cache(self) -> None:
        live = {b for s in self.tokens for b in self.bm.block_table(s)}
        live_hashes = {self.bm._blocks[b].hash for b in live}
        self.bm.reset_prefix_cache()
        assert all(self.bm._blocks[b].hash is None for b in range(16) if b not in live)
        assert {self.bm._blocks[b].hash for b in live} == live_hashes

    # ------------------------------------------------------------ invariants
    @invariant()
    def refcounts_match_tables(self) -> None:
        bm = self.bm
        counts = [0] * bm.num_blocks
        for seq in self.tokens:
            table = bm.block_table(seq)
            assert len(table) == len(set(table)), "block twice in one table"
            assert len(table) == -(-bm.num_slots(seq) // BS)
            assert bm.num_committed(seq) <= bm.num_slots(seq)
            for b in table:
                counts[b] += 1
        assert [b.ref_count for b in bm._blocks] == counts
        used = sum(c > 0 for c in counts)
        assert bm.num_free_blocks == bm.num_blocks - used
        assert set(bm._free) == {i for i, c in enumerate(counts) if c == 0}
        assert bm.usage() == pytest.approx(used / bm.num_blocks)
        assert set(self.bm._seqs) == set(self.tokens)

    @invariant()
    def hashes_consistent(self) -> None:
        bm = self.bm
        if not bm.enable_prefix_caching:
            assert not bm._hash_to_block and all(b.hash is None for b in bm._blocks)
            return
        for h, b in bm._hash_to_block.items():
            assert bm._blocks[b].hash == h
        for blk in bm._blocks:
            if blk.hash is None:
                continue
            # The hash is the prefix's chain hash and the cached KV is that prefix's.
            prefix = self.prefix_of[blk.block_id]
            assert chain_hash(prefix) == blk.hash
            slots = range(blk.block_id * BS, (blk.block_id + 1) * BS)
            assert [self.shadow.get(s) for s in slots] == prefix[-BS:]
            if blk.ref_count == 0:  # evictable blocks are only kept if findable
                assert bm._hash_to_block.get(blk.hash) == blk.block_id

    @invariant()
    def committed_kv_matches_tokens(self) -> None:
        bm = self.bm
        for seq, toks in self.tokens.items():
            n = bm.num_committed(seq)
            assert len(toks) >= n
            table = bm.block_table(seq)
            for i in range(n // BS):  # full committed blocks are hashed (when caching)
                assert (bm._blocks[table[i]].hash is not None) == bm.enable_prefix_caching
            assert [self.shadow.get(s) for s in bm.slot_mapping(seq, 0, n)] == toks[:n]

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        for seq in list(self.tokens):
            self.bm.free(seq)
        # No leak: everything comes back.
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(b.ref_count == 0 for b in self.bm._blocks)


BlockManagerMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestBlockManagerMachine = BlockManagerMachine.TestCase


def test_cache_salt_keeps_namespaces_apart() -> None:
    """Blocks committed under one salt are never hit by a sequence with another (verified determinism modes
    only share KV that the invariant path computed)."""
    bm = BlockManager(num_blocks=16, block_size=4)
    tokens = list(range(13))
    bm.allocate("a", tokens, 13, salt="invariant")
    bm.commit("a", tokens)
    assert bm.num_cached_prefix_tokens(tokens, salt="invariant") == 12
    assert bm.num_cached_prefix_tokens(tokens) == 0
    assert bm.allocate("b", tokens, 13) == 0
    assert bm.allocate("c", tokens, 13, salt="invariant") == 12
