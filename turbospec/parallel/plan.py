"""Which part of the model each tensor-parallel rank holds.

The unit of sharding is a KV-head group: one KV head, the query heads that share it, and the same fraction of
the MLP's intermediate features. Rank r holds a contiguous run of groups (the first ranks one more when the
count does not divide, so SmolLM2's 3 groups split 2 + 1 over two ranks). Sharding by whole groups keeps
grouped-query attention local to a rank, and gives the two row-parallel linears (attention output, MLP down) a
reduction split that does not depend on the number of ranks: the batch-invariant path adds the groups'
partial products in group order on every rank count (models/layers.RowLinear), so its outputs are the same
bits for TP = 1, 2, ...
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..models.model_config import ModelConfig


def check_tensor_parallel(cfg: ModelConfig, world: int) -> None:
    """Raise ValueError when this model cannot be split over `world` ranks, saying what would work."""
    groups = cfg.num_kv_heads
    if world > groups:
        raise ValueError(f"tensor_parallel_size {world} exceeds the model's {groups} KV heads: each rank needs at "
                         f"least one KV head (use at most {groups})")
    if cfg.intermediate_size % groups:
        raise ValueError(f"the MLP's {cfg.intermediate_size} intermediate features do not split into {groups} KV-head "
                         "groups: this model runs with tensor_parallel_size 1 only")
    per_slice = groups // cfg.reduction_groups  # KV heads per invariant reduction slice: a rank holds whole ones
    if any(r.start % per_slice for r in group_ranges(groups, world)):
        fits = [n for n in range(1, groups + 1) if not any(r.start % per_slice for r in group_ranges(groups, n))]
        raise ValueError(f"tensor_parallel_size {world} would cut the model's reduction slices of {per_slice} KV "
                         f"heads: use one of {fits}")


def group_ranges(num_groups: int, world: int) -> list[range]:
    """Contiguous runs of groups per rank, as even as possible, the larger runs first."""
    base, extra = divmod(num_groups, world)
    out, start = [], 0
    for r in range(world):
        size = base + (r < extra)
        out.append(range(start, start + size))
        start += size
    return out


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    world: int
    cfg: ModelConfig  # the full model's

    def __post_init__(self) -> None:
        check_tensor_parallel(self.cfg, self.world)
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is not in 0..{self.world - 1}")

    @property
    def all_groups(self) -> list[range]:
        """Every rank's groups, in rank order."""
        return group_ranges(self.cfg.num_kv_heads, self.world)

    @property
    def groups(self) -> range:
        return self.all_groups[self.rank]

    @property
    def slices_per_rank(self) -> list[int]:
        """Invariant reduction slices each rank holds (ModelConfig.reduction_groups), in rank order."""
        per_slice = self.cfg.num_kv_heads // self.cfg.reduction_groups
        return [len(r) // per_slice for r in self.all_groups]

    @property
    def heads_per_group(self) -> int:
        return self.cfg.num_heads // self.cfg.num_kv_heads

    @property
    def features_per_group(self) -> int:
        return self.cfg.intermediate_size // self.cfg.num_kv_heads

    def local_config(self) -> ModelConfig:
        """The config of this rank's attention and KV cache: its own heads only."""
        n = len(self.groups)
        return dataclasses.replace(self.cfg, num_heads=n * self.heads_per_group, num_kv_heads=n,
                                   intermediate_size=n * self.features_per_group)
