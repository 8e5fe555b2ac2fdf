"""The collectives a tensor-parallel forward needs, on a torch.distributed process group of its own.

The group is built directly from a TCPStore (gloo on CPU, NCCL on CUDA) rather than through
``init_process_group``: no process-wide default group, so two engines in one process (a test, a draft next to
a target) never share or clobber one.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

# a forward's collectives wait this long for the slowest rank (a long prefill chunk on a busy CPU is seconds)
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


class TensorParallelError(RuntimeError):
    """The ranks can no longer run forwards together (a rank died, a collective failed, or a forward was cut
    short on rank 0 and left the others waiting): the engine has to be restarted."""


class Communicator:
    def __init__(self, store: dist.Store, rank: int, world: int, backend: str) -> None:
        self.rank, self.world = rank, world
        if backend == "nccl":
            self.group = dist.ProcessGroupNCCL(store, rank, world)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, world, COLLECTIVE_TIMEOUT)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (gloo's order is its own: only the non-invariant path uses this)."""
        self._wait(self.group.allreduce([tensor]))
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's tensor (same shape on all), in rank order."""
        out = [torch.empty_like(tensor) for _ in range(self.world)]
        self._wait(self.group.allgather([out], [tensor]))
        return out

    @staticmethod
    def _wait(work: dist.Work) -> None:
        try:
            work.wait()
        except RuntimeError as exc:  # a peer died or timed out: no later collective can pair up reliably
            raise TensorParallelError(f"a tensor-parallel collective failed: {exc}") from exc
