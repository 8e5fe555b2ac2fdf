"""Turns a SchedulerOutput into one forward pass over the ragged batch and returns the rows to sample."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import build_metadata
from .kv.block_manager import BlockManager
from .kv.kv_cache import KVCache
from .models.llama import CausalLM
from .scheduler import SchedulerOutput


@dataclass
class ModelOutput:
    """Logits (float32) for the rows that are sampled or verified: for each scheduled request that reaches
    the end of its known tokens, 1 + (number of draft tokens) consecutive rows starting at row_start[i]."""

    logits: torch.Tensor  # [R, V]
    hidden: torch.Tensor  # [R, H], the same rows before the LM head (for draft heads)
    row_start: list[int]  # per scheduled request, or -1 when it samples nothing this step
    num_rows: list[int]


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache, blocks: BlockManager, device: str | torch.device) -> None:
        self.model = model
        self.kv = kv_cache
        self.blocks = blocks
        self.device = torch.device(device)
        self._offsets = torch.arange(kv_cache.block_size)

    def slot_table(self, request_id: str, length: int) -> torch.Tensor:
        table = torch.tensor(self.blocks.block_table(request_id), dtype=torch.long)
        return (table[:, None] * self.kv.block_size + self._offsets).reshape(-1)[:length]

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        tables: list[torch.Tensor] = []
        sample_rows: list[int] = []
        row_start: list[int] = []
        num_rows: list[int] = []
        for s in sched.scheduled:
            req = s.request
            drafts = req.spec_token_ids[: s.num_spec_tokens] if s.samples else []
            tokens = req.all_token_ids[s.start: s.start + s.num_new_tokens] + drafts
            end = s.start + len(tokens)
            base = len(ids)
            ids += tokens
            positions += range(s.start, end)
            query_lens.append(len(tokens))
            context_lens.append(end)
            tables.append(self.slot_table(req.request_id, end))
            if s.samples:
                rows = 1 + len(drafts)
                row_start.append(len(sample_rows))
                num_rows.append(rows)
                sample_rows += range(base + len(tokens) - rows, base + len(tokens))
            else:
                row_start.append(-1)
                num_rows.append(0)
        meta = build_metadata(query_lens, context_lens, tables)
        meta = meta.to(self.device) if self.device.type != "cpu" else meta
        hidden = self.model(
            torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device), meta, self.kv.layers
        )
        hidden = hidden[torch.tensor(sample_rows, device=self.device, dtype=torch.long)]
        return ModelOutput(self.model.compute_logits(hidden), hidden, row_start, num_rows)
