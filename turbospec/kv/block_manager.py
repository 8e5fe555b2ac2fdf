"""Paged KV-cache bookkeeping with vLLM-v1-style prefix caching.

The KV cache is ``num_blocks`` blocks of ``block_size`` token slots. Each sequence owns
a block table; the token at position ``p`` lives in slot
``table[p // block_size] * block_size + p % block_size``.

Prefix caching: once a block is full of committed tokens it gets the hash
``hash((parent_hash, tuple(block_tokens)))`` (the first block's parent is the sequence's cache salt,
``None`` by default), so a hash identifies the whole prefix up to the end of that block, and sequences with different
salts never share KV (the verified determinism modes only share KV computed by the invariant path). Blocks whose ref_count
drops to 0 keep their hash and stay findable until they are reused for new content.
This module is pure Python (no torch) so it can be tested exhaustively on CPU.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation needs more free blocks than the pool has."""


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and all its tokens are committed


@dataclass
class _SeqState:
    table: list[int] = field(default_factory=list)
    num_slots: int = 0
    num_committed: int = 0
    salt: Hashable | None = None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Allocates KV blocks to sequences and shares committed full blocks by prefix hash."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [Block(i) for i in range(num_blocks)]
        # Free queue (ref_count == 0) in eviction order: pop from the front, release to the
        # back. An OrderedDict gives O(1) removal from the middle on a cache hit.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_to_block: dict[int, int] = {}
        self._seqs: dict[Hashable, _SeqState] = {}

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_count 0, including evictable cached ones."""
        return len(self._free)

    def _seq(self, seq_id: Hashable) -> _SeqState:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r}") from None

    def block_table(self, seq_id: Hashable) -> list[int]:
        """Return a copy of the sequence's block table."""
        return list(self._seq(seq_id).table)

    def num_slots(self, seq_id: Hashable) -> int:
        """Number of token slots reserved for the sequence."""
        return self._seq(seq_id).num_slots

    def num_committed(self, seq_id: Hashable) -> int:
        """Number of leading tokens whose KV is computed and final."""
        return self._seq(seq_id).num_committed

    def has_seq(self, seq_id: Hashable) -> bool:
        """Whether the sequence is currently registered."""
        return seq_id in self._seqs

    def usage(self) -> float:
        """Fraction of blocks in use (ref_count > 0)."""
        return (self.num_blocks - len(self._free)) / self.num_blocks

    def slot_mapping(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        """Cache slots of positions [start, end); all of them must be reserved."""
        st = self._seq(seq_id)
        if not 0 <= start <= end <= st.num_slots:
            raise ValueError(f"positions [{start}, {end}) outside reserved [0, {st.num_slots}) of {seq_id!r}")
        bs = self.block_size
        return [st.table[p // bs] * bs + p % bs for p in range(start, end)]

    # ------------------------------------------------------------ prefix cache
    def _find_cached(self, token_ids: Sequence[int], salt: Hashable | None = None) -> list[int]:
        """Block ids of the longest cached prefix, leaving at least one token to compute."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        # Never hit the whole prompt: the model must run on >= 1 token to produce logits.
        max_hits = max(0, (len(token_ids) - 1) // bs)
        hits: list[int] = []
        parent: Hashable | None = salt
        for i in range(max_hits):
            h = hash((parent, tuple(token_ids[i * bs:(i + 1) * bs])))
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                break
            hits.append(block_id)
            parent = h
        return hits

    def num_cached_prefix_tokens(self, token_ids: Sequence[int], salt: Hashable | None = None) -> int:
        """How many leading tokens allocate() would find cached (no side effects)."""
        return len(self._find_cached(token_ids, salt)) * self.block_size

    def reset_prefix_cache(self) -> None:
        """Drop the hashes of all blocks with ref_count 0 (live blocks keep theirs)."""
        for block_id in self._free:
            self._unhash(self._blocks[block_id])

    def _unhash(self, block: Block) -> None:
        # A duplicate block may carry a hash that maps to another block; only remove
        # the map entry if it points at this block.
        if block.hash is not None and self._hash_to_block.get(block.hash) == block.block_id:
            del self._hash_to_block[block.hash]
        block.hash = None

    # -------------------------------------------------------- block lifecycle
    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self._blocks[block_id]
        self._unhash(block)  # evict: its old content is about to be overwritten
        block.ref_count = 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"double free of block {block_id}")
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None
            if block.hash is not None and self._hash_to_block.setdefault(block.hash, block_id) != block_id:
                # A live duplicate of another cached block: it can never be hit, so drop it.
                block.hash = None
            if block.hash is None:
                # Nothing worth keeping: reuse it before any evictable cached block.
                self._free.move_to_end(block_id, last=False)

    def _release_tail(self, st: _SeqState, keep: int) -> None:
        # Release in reverse so a sequence's tail blocks (least likely to be shared
        # prefixes) are evicted before its head blocks.
        while len(st.table) > keep:
            self._release(st.table.pop())

    # ---------------------------------------------------------------- mutation
    def can_allocate(self, token_ids: Sequence[int], num_tokens: int, salt: Hashable | None = None) -> bool:
        """Whether allocate(token_ids, num_tokens, salt) would succeed for a new sequence."""
        return self._blocks_needed(token_ids, num_tokens, salt)[1] <= len(self._free)

    def _blocks_needed(self, token_ids: Sequence[int], num_tokens: int,
                       salt: Hashable | None = None) -> tuple[list[int], int]:
        if not 0 <= num_tokens <= len(token_ids):
            raise ValueError(f"num_tokens={num_tokens} outside [0, {len(token_ids)}]")
        hits = self._find_cached(token_ids, salt)
        num_slots = max(num_tokens, len(hits) * self.block_size)
        new_blocks = _cdiv(num_slots, self.block_size) - len(hits)
        # Hits on free (evictable) blocks take them out of the free pool too.
        free_hits = sum(1 for b in hits if self._blocks[b].ref_count == 0)
        return hits, new_blocks + free_hits

    def allocate(self, seq_id: Hashable, token_ids: Sequence[int], num_tokens: int,
                 salt: Hashable | None = None) -> int:
        """Register a new sequence and reserve slots for its first num_tokens tokens.

        token_ids are all known tokens (prompt, or prompt + outputs when resuming after
        preemption). Returns the number of leading tokens found in the prefix cache (a
        multiple of block_size, always < len(token_ids)); they count as committed and
        reserved, so the reservation is max(num_tokens, cached). All-or-nothing: raises
        NoFreeBlocksError without changing state if the pool is too small.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already allocated")
        hits, needed = self._blocks_needed(token_ids, num_tokens, salt)
        if needed > len(self._free):
            raise NoFreeBlocksError(f"sequence {seq_id!r} needs {needed} free blocks, only {len(self._free)} free")
        cached = len(hits) * self.block_size
        st = _SeqState(num_slots=max(num_tokens, cached), num_committed=cached, salt=salt)
        # Take hits first so popping fresh blocks can never evict a block we just hit.
        for block_id in hits:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            st.table.append(block_id)
        while len(st.table) < _cdiv(st.num_slots, self.block_size):
            st.table.append(self._pop_free())
        self._seqs[seq_id] = st
        return cached

    def can_append(self, seq_id: Hashable, num_new_slots: int) -> bool:
        """Whether append_slots(seq_id, num_new_slots) would succeed."""
        st = self._seq(seq_id)
        return _cdiv(st.num_slots + num_new_slots, self.block_size) - len(st.table) <= len(self._free)

    def append_slots(self, seq_id: Hashable, num_new_slots: int) -> None:
        """Grow the sequence's reservation by num_new_slots, allocating blocks as needed."""
        st = self._seq(seq_id)
        if num_new_slots < 0:
            raise ValueError(f"num_new_slots must be >= 0, got {num_new_slots}")
        if not self.can_append(seq_id, num_new_slots):
            needed = _cdiv(st.num_slots + num_new_slots, self.block_size) - len(st.table)
            raise NoFreeBlocksError(f"sequence {seq_id!r} needs {needed} free blocks, only {len(self._free)} free")
        st.num_slots += num_new_slots
        while len(st.table) < _cdiv(st.num_slots, self.block_size):
            st.table.append(self._pop_free())

    def commit(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        """Mark the first len(token_ids) tokens as computed and final.

        token_ids is the full committed token list so far. Every block that becomes full
        of committed tokens is hashed and registered in the prefix cache (an existing
        mapping for the same hash is kept; live duplicates are not merged).
        """
        st = self._seq(seq_id)
        n = len(token_ids)
        if not st.num_committed <= n <= st.num_slots:
            raise ValueError(
                f"cannot commit {n} tokens of {seq_id!r}: committed={st.num_committed}, slots={st.num_slots}"
            )
        if self.enable_prefix_caching:
            bs = self.block_size
            for i in range(st.num_committed // bs, n // bs):
                block = self._blocks[st.table[i]]
                # Blocks before the first uncommitted one are all hashed (see truncate).
                parent = self._blocks[st.table[i - 1]].hash if i > 0 else st.salt
                block.hash = hash((parent, tuple(token_ids[i * bs:(i + 1) * bs])))
                self._hash_to_block.setdefault(block.hash, block.block_id)
        st.num_committed = n

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Roll the reservation back to num_tokens slots (e.g. rejected draft tokens).

        Blocks no longer needed are released. If this cuts into committed tokens the
        committed count drops and the block cut into loses its hash, since its tail will
        be overwritten; that block must not be shared (no copy-on-write): ValueError,
        raised before anything changes.
        """
        st = self._seq(seq_id)
        if not 0 <= num_tokens <= st.num_slots:
            raise ValueError(f"cannot truncate {seq_id!r} to {num_tokens}: reserved slots={st.num_slots}")
        bs = self.block_size
        cut = self._blocks[st.table[num_tokens // bs]] if num_tokens % bs else None
        if cut is not None and cut.hash is not None and cut.ref_count > 1:
            raise ValueError(
                f"truncating {seq_id!r} to {num_tokens} cuts into shared block {cut.block_id}; copy-on-write unsupported"
            )
        if cut is not None and cut.hash is not None:
            self._unhash(cut)
        self._release_tail(st, _cdiv(num_tokens, bs))
        st.num_slots = num_tokens
        st.num_committed = min(st.num_committed, num_tokens)

    def free(self, seq_id: Hashable) -> None:
        """Release all blocks of the sequence (finish, abort or preemption)."""
        st = self._seq(seq_id)
        self._release_tail(st, 0)
        del self._seqs[seq_id]
