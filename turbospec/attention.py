"""Ragged attention over a paged KV cache.

A step's batch is a flat list of T query tokens from several sequences: prefill chunks, one-token
decodes, and k+1-token verification windows side by side. The KV cache of a layer is one flat tensor
of slots ``[num_slots, kv_heads, head_dim]``; a sequence's context is whatever slots its block table
names, so paging costs one gather per layer.

Sequences are packed into *groups* (attention_groups.py): short queries (decode / verification) of similar
context lengths are padded into one ``[B, Q]`` batch and attended in a single call, while each long prefill
chunk gets a group of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .attention_choice import SHORT_QUERY, fused_runs, short_query_kernel
from .attention_groups import plan_groups
from .attention_matmul import grouped_matmul_attention
from .determinism.batch_invariant import invariant_attention


@dataclass
class AttnGroup:
    """Sequences attended together in one padded SDPA call."""

    token_index: torch.Tensor  # [B, Q] int64: row in the flat batch of each query (padding repeats a valid row)
    query_valid: torch.Tensor  # [B, Q] bool
    kv_slots: torch.Tensor  # [B, L] int64: cache slots of the context, positions 0..L_b-1 (padding -> slot 0)
    mask: torch.Tensor  # [B, 1, Q, L] bool: True where the query may attend the key
    query_positions: torch.Tensor  # [B, Q] int64
    # (first, last + 1) when the group's queries are exactly that slice of the flat batch with no padding
    # (every decode-only step): then gathering and scattering queries are plain reshapes.
    token_range: tuple[int, int] | None = None
    # computed with invariant_attention: each query's result independent of the group (determinism/)
    invariant: bool = False
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    _kernel: str | None = None  # kernel()'s answer, once the first layer has asked
    _scatter: torch.Tensor | None = None  # scatter()'s answer, computed once per step

    def scatter(self) -> torch.Tensor:
        """[2, n] int64 for a padded group: row 0 the flat [B * Q] positions of its valid queries' outputs, row 1
        the rows of the batch they fill (padded queries' outputs are dropped)."""
        if self._scatter is None:
            kept = self.query_valid.reshape(-1).nonzero().squeeze(1)
            self._scatter = torch.stack((kept, self.token_index.reshape(-1)[kept]))
        return self._scatter

    def kernel(self, q: torch.Tensor, k_cache: torch.Tensor) -> str:
        """How this group attends: "invariant", "fused", "matmul" or "sdpa" (attention_choice.py). Every layer of
        the step has the same shapes, so the first layer's answer holds for the others."""
        if self._kernel is None:
            self._kernel = "invariant" if self.invariant else _short_query_choice(self, q, k_cache)
        return self._kernel

    def mask_for_window(self, window: int | None) -> torch.Tensor:
        """The mask restricted to a sliding window (key position > query position - window)."""
        if window is None:
            return self.mask
        if window not in self._window_masks:
            key_pos = torch.arange(self.mask.shape[-1])
            near = key_pos[None, None, :] > (self.query_positions[:, :, None] - window)
            masked = self.mask & near[:, None]
            # a padded query row must keep one visible key, or SDPA returns NaN for it
            masked[..., 0] |= ~masked.any(-1)
            self._window_masks[window] = masked
        return self._window_masks[window]

    def to(self, device: torch.device) -> AttnGroup:
        return AttnGroup(*(t.to(device) for t in (self.token_index, self.query_valid, self.kv_slots, self.mask,
                                                   self.query_positions)), token_range=self.token_range,
                         invariant=self.invariant)


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, shared by all layers."""

    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V is written
    groups: list[AttnGroup]
    num_tokens: int
    # linears compute every row independently of the others (determinism/batch_invariant.py): set when any
    # group is invariant (rows padded to a probed multiple, usually 1 or 2, so nearly free)
    invariant: bool = False
    # the activations' dtype when it is not the weights' (LayerCast: bf16 weights, float32 compute); the metadata
    # is the one per-step context every layer sees
    compute_dtype: torch.dtype | None = None

    def to(self, device: torch.device) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping.to(device), [g.to(device) for g in self.groups], self.num_tokens,
                                 self.invariant, self.compute_dtype)


def build_metadata(
    query_lens: list[int],
    context_lens: list[int],
    slot_tables: list[torch.Tensor],
    tree_masks: list[torch.Tensor | None] | None = None,
    invariant: list[bool] | None = None,
    tree_positions: list[list[int] | None] | None = None,
) -> AttentionMetadata:
    """Describe a ragged step.

    query_lens[i] tokens of sequence i are computed this step; they are its last ones, so its context after
    the step has context_lens[i] tokens (positions 0..context_lens[i]-1). slot_tables[i] holds the cache
    slot of every one of those positions. tree_masks[i], when given, is a [q, q] bool matrix that replaces
    the causal mask among the sequence's own new tokens (token trees), and tree_positions[i] then gives its new
    tokens' positions (root + depth: sliding windows are measured from them). invariant[i] puts sequence i in a
    group computed on the batch-invariant path (and makes the linears invariant).
    """
    starts: list[int] = []
    offset = 0
    for q in query_lens:
        starts.append(offset)
        offset += q
    slot_mapping = torch.cat([slot_tables[i][c - q:c] for i, (q, c) in enumerate(zip(query_lens, context_lens))])
    trees = tree_masks or [None] * len(query_lens)
    tree_pos = tree_positions or [None] * len(query_lens)

    exact = invariant or [False] * len(query_lens)
    groups: list[AttnGroup] = []
    for flag in (False, True):  # invariant sequences never share a group with fast ones
        members = [i for i in range(len(query_lens)) if exact[i] == flag]
        made = [_group(seqs, query_lens, context_lens, starts, slot_tables, trees, tree_pos)
                for seqs in plan_groups(query_lens, context_lens, members)]
        for g in made:
            g.invariant = flag
        groups += made
    return AttentionMetadata(slot_mapping=slot_mapping, groups=groups, num_tokens=offset, invariant=any(exact))


def _group(
    seqs: list[int],
    query_lens: list[int],
    context_lens: list[int],
    starts: list[int],
    slot_tables: list[torch.Tensor],
    trees: list[torch.Tensor | None],
    tree_pos: list[list[int] | None],
) -> AttnGroup:
    num = len(seqs)
    q_max = max(query_lens[i] for i in seqs)
    l_max = max(context_lens[i] for i in seqs)
    q_lens = torch.tensor([query_lens[i] for i in seqs])
    c_lens = torch.tensor([context_lens[i] for i in seqs])
    q_idx = torch.arange(q_max)
    query_valid = q_idx[None, :] < q_lens[:, None]
    # Query j of a sequence sits at position context_len - query_len + j.
    query_positions = (c_lens - q_lens)[:, None] + q_idx[None, :]
    token_index = torch.tensor([starts[i] for i in seqs])[:, None] + torch.minimum(q_idx[None, :], q_lens[:, None] - 1)
    kv_slots = torch.zeros(num, l_max, dtype=torch.long)
    for row, i in enumerate(seqs):
        kv_slots[row, : context_lens[i]] = slot_tables[i][: context_lens[i]]
    key_pos = torch.arange(l_max)
    mask = key_pos[None, None, :] <= query_positions[:, :, None]
    for row, i in enumerate(seqs):
        if trees[i] is not None:
            q, c = query_lens[i], context_lens[i]
            mask[row, :q, c - q:c] = trees[i]
            if tree_pos[i] is not None:  # nodes sit at root + depth, before their flat index
                query_positions[row, :q] = torch.tensor(tree_pos[i])
    mask &= query_valid[:, :, None]
    mask[..., 0] |= ~query_valid  # padded rows attend position 0 so SDPA stays finite; their output is dropped
    first = starts[seqs[0]]
    dense = bool(query_valid.all()) and torch.equal(token_index.reshape(-1), torch.arange(first, first + num * q_max))
    return AttnGroup(token_index, query_valid, kv_slots, mask[:, None], query_positions,
                     token_range=(first, first + num * q_max) if dense else None)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] for this step's tokens. Writes k/v into the cache, returns [T, Hq*D]."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    num_heads, head_dim = q.shape[1], q.shape[2]
    out = q.new_empty(q.shape[0], num_heads * head_dim)
    for g in meta.groups:
        kernel = g.kernel(q, k_cache)
        if g.token_range is not None:
            qg = q[g.token_range[0]: g.token_range[1]].view(*g.token_index.shape, num_heads, head_dim)
        else:
            qg = q[g.token_index]  # [B, Q, Hq, D]
        mask = g.mask_for_window(sliding_window)
        if kernel == "fused":  # reads the cache slots in place: no gather
            og = torch.ops.turbospec.short_query_attention(qg, k_cache, v_cache, g.kv_slots, mask[:, 0], scale)
        else:
            qg = qg.transpose(1, 2)  # [B, Hq, Q, D]
            # index_select on the flat slot list is ~6x faster than advanced indexing with a [B, L] index here
            flat = g.kv_slots.reshape(-1)
            kg = k_cache.index_select(0, flat).view(*g.kv_slots.shape, *k_cache.shape[1:]).transpose(1, 2)
            vg = v_cache.index_select(0, flat).view(*g.kv_slots.shape, *v_cache.shape[1:]).transpose(1, 2)
            if kernel == "invariant":
                og = invariant_attention(qg, kg, vg, mask, scale)
            elif kernel == "matmul":
                og = grouped_matmul_attention(qg, kg, vg, mask, scale)
            else:
                og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale,
                                                    enable_gqa=kg.shape[1] != num_heads)
            og = og.transpose(1, 2)
        og = og.reshape(*g.token_index.shape, num_heads * head_dim)
        if g.token_range is not None:
            out[g.token_range[0]: g.token_range[1]] = og.reshape(-1, num_heads * head_dim)
        else:
            kept, rows = g.scatter()
            out.index_copy_(0, rows, og.reshape(-1, num_heads * head_dim).index_select(0, kept))
    return out


# Up to SHORT_QUERY queries per sequence, two grouped matmuls beat SDPA on CPU when a group batches several
# sequences (16 decodes at 400 tokens of context: 0.66 ms against 0.93 ms for SDPA in bf16), while for long
# prefill chunks its flash kernel wins (512 queries: 4.4 ms against 15.7 ms for the matmuls; torch 2.13, a Xeon,
# 2 threads, ad hoc microbenchmarks, not a committed run). For one sequence the fastest of SDPA, the matmuls and our
# fused kernel depends on the CPU, the query count and the context, so it is measured (attention_choice.py); a group
# of several sequences runs the fused kernel where it won for one, else the matmuls.
def _short_query_choice(group: AttnGroup, q: torch.Tensor, k_cache: torch.Tensor) -> str:
    """q [T, Hq, D], k_cache [slots, Hkv, D]: "fused", "matmul" or "sdpa" for this group's queries."""
    batch, queries = group.token_index.shape
    q_heads, kv_heads, head_dim = q.shape[1], k_cache.shape[1], q.shape[2]
    if queries > SHORT_QUERY:
        return "sdpa"
    if q.device.type != "cpu":
        return "matmul" if batch > 1 else "sdpa"
    chosen = short_query_kernel(queries, group.kv_slots.shape[1], q_heads, kv_heads, head_dim, q.dtype)
    if chosen == "fused" and not (fused_runs(head_dim, q.dtype) and k_cache.dtype == q.dtype
                                  and k_cache.is_contiguous()):
        chosen = "matmul"
    return chosen if chosen == "fused" or batch == 1 else "matmul"
