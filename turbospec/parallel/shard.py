"""Cut a loaded model down to one rank's share (Megatron-style): column-parallel q/k/v and gate/up (each rank
computes its own heads and intermediate features), row-parallel attention output and MLP down (each rank's
partial product, summed over ranks). Embeddings, norms and the LM head stay whole on every rank: the hidden
state after each sum is the same on all ranks, and only rank 0 computes logits."""

from __future__ import annotations

import torch
from torch import nn

from ..models.layers import RowLinear, row_linear, sum_in_order
from ..models.llama import CausalLM
from .comm import Communicator
from .plan import ShardPlan


class RowParallelLinear(RowLinear):
    """One rank's input slice of a linear whose outputs are summed over ranks.

    Batch-invariant calls add per-group partial products in float32 in group order after gathering every
    rank's (exactly what the unsharded RowLinear does on one rank); other calls sum one partial per rank with
    an all-reduce in float32."""

    def __init__(self, weight: torch.Tensor, group_width: int, plan: ShardPlan, comm: Communicator) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias=False, device="meta")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.group_width = group_width
        self.slices_per_rank = plan.slices_per_rank  # fixed by the plan: not recomputed every call
        self.comm = comm

    def forward(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        if invariant:
            mine = torch.stack([p.float() for p in self.partials(x)])
            counts = self.slices_per_rank
            pad = max(counts) - mine.shape[0]
            if pad:  # collectives need one shape on every rank
                mine = torch.cat([mine, mine.new_zeros(pad, *mine.shape[1:])])
            gathered = self.comm.all_gather(mine)
            return sum_in_order(p for g, n in zip(gathered, counts) for p in g[:n]).to(x.dtype)
        partial = row_linear(x, self.weight).float()
        return self.comm.all_reduce_sum(partial).to(x.dtype)


def shard_model(model: CausalLM, plan: ShardPlan, comm: Communicator) -> None:
    """Replace every decoder layer's weights by this rank's share, in place."""
    cfg, local = plan.cfg, plan.local_config()
    g0, g1 = plan.groups.start, plan.groups.stop
    d, per = cfg.head_dim, plan.heads_per_group
    f = plan.features_per_group
    q_rows = torch.arange(g0 * per * d, g1 * per * d)
    kv_rows = torch.arange(g0 * d, g1 * d)
    qkv_rows = torch.cat([q_rows, cfg.q_size + kv_rows, cfg.q_size + cfg.kv_size + kv_rows])
    inter = torch.arange(g0 * f, g1 * f)
    gate_up_rows = torch.cat([inter, cfg.intermediate_size + inter])
    for layer in model.layers:
        attn, mlp = layer.attn, layer.mlp
        for lin in (attn.qkv, attn.o, mlp.gate_up, mlp.down):
            if lin.packed is not None:
                raise ValueError("tensor parallelism shards dense weights: load the model with weight_format bf16")
        if attn.o.bias is not None or mlp.down.bias is not None:  # a row-parallel bias would be added per rank
            raise ValueError("tensor parallelism does not support a bias on attention-out or MLP-down")
        _keep_rows(attn.qkv, qkv_rows)
        _keep_rows(mlp.gate_up, gate_up_rows)
        # the slice widths the unsharded model's invariant path uses (CausalLM._mark_reduction_groups)
        attn.o = RowParallelLinear(attn.o.weight[:, q_rows].contiguous(), attn.o.group_width, plan, comm)
        mlp.down = RowParallelLinear(mlp.down.weight[:, inter].contiguous(), mlp.down.group_width, plan, comm)
        attn.cfg = local


def _keep_rows(lin: nn.Linear, rows: torch.Tensor) -> None:
    lin.weight = nn.Parameter(lin.weight[rows].contiguous(), requires_grad=False)
    if lin.bias is not None:
        lin.bias = nn.Parameter(lin.bias[rows].contiguous(), requires_grad=False)
    lin.out_features = len(rows)
