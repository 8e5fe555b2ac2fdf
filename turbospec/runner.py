"""Turns a SchedulerOutput into one forward pass over the ragged batch and returns the rows to sample."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .attention import build_metadata
from .kv.block_manager import BlockManager
from .kv.kv_cache import KVCache, copy_slots
from .models.llama import CausalLM
from .scheduler import SchedulerOutput
from .verification.tree import TokenTree

if TYPE_CHECKING:
    from .parallel.group import TensorParallelGroup


@dataclass
class ModelOutput:
    """Logits (float32) for the rows that are sampled or verified: for each scheduled request that reaches
    the end of its known tokens, 1 + (number of draft tokens) consecutive rows starting at row_start[i]."""

    logits: torch.Tensor | None  # [R, V]; None when the caller asked for hidden states only
    hidden: torch.Tensor  # [R, H], the same rows before the LM head (for draft heads)
    row_start: list[int]  # per scheduled request, or -1 when it samples nothing this step
    num_rows: list[int]
    # [R, (len(capture_layers) + 1) * H]: the captured layers' outputs and the final hidden state, when the
    # model captures layers (EAGLE's features); None otherwise
    features: torch.Tensor | None = None


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache, blocks: BlockManager, device: str | torch.device,
                 batch_invariant: bool = False, compute_dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.compute_dtype = compute_dtype  # activations' dtype when it differs from the weights' (LayerCast)
        # every row computed the same way whatever the batch (determinism/batch_invariant.py)
        self.batch_invariant = batch_invariant
        self.kv = kv_cache
        self.blocks = blocks
        self.device = torch.device(device)
        self._offsets = torch.arange(kv_cache.block_size)
        # rank 0's handle on the other tensor-parallel ranks (parallel/group.py), None without tensor parallelism
        self.parallel: TensorParallelGroup | None = None

    def move_kv(self, request_id: str, src: list[int], dst: list[int]) -> None:
        """Copy the K/V at positions `src` of a sequence to positions `dst` in every layer (a token tree's
        accepted path moves down to consecutive positions)."""
        if not src:
            return
        table = self.slot_table(request_id, max(max(src), max(dst)) + 1)
        if self.parallel is not None:  # the other ranks hold the other KV heads of these slots
            self.parallel.copy_slots(table[src], table[dst])
        copy_slots(self.kv.layers, table[src].to(self.device), table[dst].to(self.device))

    def slot_table(self, request_id: str, length: int) -> torch.Tensor:
        table = torch.tensor(self.blocks.block_table(request_id), dtype=torch.long)
        return (table[:, None] * self.kv.block_size + self._offsets).reshape(-1)[:length]

    def execute(self, sched: SchedulerOutput, exact: set[str] = frozenset()) -> ModelOutput:
        """One forward over everything scheduled: chunks, decodes, and known tokens followed by drafts. Requests
        in `exact` are computed on the batch-invariant path even when the runner is not in that mode."""
        items = []
        for s in sched.scheduled:
            req = s.request
            drafts = req.draft.tokens[: s.num_spec_tokens] if s.samples else []
            tokens = req.all_token_ids[s.start: s.start + s.num_new_tokens] + drafts
            tree = req.draft.tree if drafts else None
            items.append(SeqInput(req.request_id, tokens, s.start, 1 + len(drafts) if s.samples else 0,
                                  req.request_id in exact, tree))
        return self.run(items)

    @torch.inference_mode()
    def run(self, items: list[SeqInput], invariant: bool = False, logits: bool = True) -> ModelOutput:
        """Compute items' tokens (each continuing its sequence at `start`) and return their last rows.
        invariant=True computes every item on the batch-invariant path, as does the runner's own mode.
        logits=False skips the LM head (the output's logits are then None): a caller scoring the rows itself."""
        invariant = invariant or self.batch_invariant
        ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        tables: list[torch.Tensor] = []
        sample_rows: list[int] = []
        row_start: list[int] = []
        num_rows: list[int] = []
        masks: list[torch.Tensor | None] = []
        tree_positions: list[list[int] | None] = []
        for item in items:
            end = item.start + len(item.tokens)
            base = len(ids)
            ids += item.tokens
            if item.tree is None:
                positions += range(item.start, end)
                masks.append(None)
                tree_positions.append(None)
            else:  # a token tree after the known tokens: nodes at root + depth, each seeing its ancestors only
                known = len(item.tokens) - len(item.tree)
                tree_positions.append(item.tree.positions(item.start + known - 1, known))
                positions += tree_positions[-1]
                masks.append(item.tree.attention_mask(known))
            query_lens.append(len(item.tokens))
            context_lens.append(end)
            tables.append(self.slot_table(item.seq_id, end))
            row_start.append(len(sample_rows) if item.num_rows else -1)
            num_rows.append(item.num_rows)
            sample_rows += range(base + len(item.tokens) - item.num_rows, base + len(item.tokens))
        trees = any(m is not None for m in masks)
        meta = build_metadata(query_lens, context_lens, tables, tree_masks=masks if trees else None,
                              invariant=[invariant or it.invariant for it in items],
                              tree_positions=tree_positions if trees else None)
        meta.compute_dtype = self.compute_dtype
        meta = meta.to(self.device) if self.device.type != "cpu" else meta
        hidden = self.model(
            torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device), meta, self.kv.layers
        )
        rows = torch.tensor(sample_rows, device=self.device, dtype=torch.long)
        hidden = hidden[rows]
        captured = getattr(self.model, "captured", None)
        features = torch.cat([captured[rows], hidden], dim=-1) if captured is not None else None
        scores = self.model.compute_logits(hidden, meta.invariant) if logits else None
        return ModelOutput(scores, hidden, row_start, num_rows, features)


@dataclass
class SeqInput:
    seq_id: str
    tokens: list[int]  # computed this pass, at positions start .. start + len - 1
    start: int
    num_rows: int  # how many of the last tokens' logits to return (0: none)
    invariant: bool = False  # computed on the batch-invariant path
    tree: TokenTree | None = None  # the last len(tree) tokens are this tree's nodes (verification/tree.py)

    def __post_init__(self) -> None:
        if self.tree is not None:
            assert self.tokens[len(self.tokens) - len(self.tree):] == self.tree.tokens, "tree nodes must end tokens"
