"""A tensor-parallel rank other than 0: loads the model, keeps its share, and runs every forward rank 0 runs.

Rank 0 (the engine) sends each forward's inputs down a socket before running its own share; the ranks then
meet in the collectives inside the layers. The socket is also the life line: when rank 0's process ends, the
read fails and the worker exits (no orphaned ranks waiting on a collective).
"""

from __future__ import annotations

import pickle
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from ..kv.kv_cache import KVCache, copy_slots
from ..models.loader import load_model, parse_dtype
from .comm import Communicator
from .plan import ShardPlan
from .shard import shard_model

STORE_TIMEOUT = timedelta(minutes=5)  # how long ranks wait for each other to start


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank needs to build its share (picklable: it crosses a process spawn)."""

    model: str
    dtype: str
    compute_dtype: str  # the KV cache's and activations' dtype (float32 under LayerCast)
    device: str
    threads: int
    world: int
    num_blocks: int
    block_size: int
    store_host: str
    store_port: int
    backend: str

    def rank_device(self, rank: int) -> str:
        """Rank r's device: the r-th GPU after rank 0's (cuda:1 for rank 0 on cuda:0), or the CPU."""
        if not self.device.startswith("cuda"):
            return self.device
        first = int(self.device.partition(":")[2] or 0)
        return f"cuda:{first + rank}"


def worker_main(conn: Connection) -> None:
    """Build this rank's share as rank 0 says (the first message: the spec and this rank), then serve."""
    spec, rank = conn.recv()
    torch.set_num_threads(spec.threads)
    device = spec.rank_device(rank)
    try:
        if device.startswith("cuda"):
            torch.cuda.set_device(device)  # NCCL binds each rank's communicator to the current device
        loaded = load_model(spec.model, parse_dtype(spec.dtype), device, progress=False, weight_format="bf16")
        plan = ShardPlan(rank, spec.world, loaded.config)
        conn.send(("loaded", None))
        store = dist.TCPStore(spec.store_host, spec.store_port, spec.world, is_master=False, timeout=STORE_TIMEOUT)
        comm = Communicator(store, rank, spec.world, spec.backend)
        shard_model(loaded.model, plan, comm)
        kv = KVCache.allocate(plan.local_config(), spec.num_blocks, spec.block_size, parse_dtype(spec.compute_dtype),
                              device)
        conn.send(("serving", None))
    except BaseException:  # noqa: BLE001 -- rank 0 re-raises it with this rank's traceback
        conn.send(("error", traceback.format_exc()))
        return
    serve(loaded.model, kv, conn, device)


@torch.inference_mode()
def serve(model: torch.nn.Module, kv: KVCache, conn: Connection, device: str) -> None:
    while True:
        try:
            op, *args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # rank 0 is gone
            return
        if op == "forward":
            ids, positions, meta, layer_ids = args
            if device != "cpu":
                ids, positions, meta = ids.to(device), positions.to(device), meta.to(torch.device(device))
            model(ids, positions, meta, kv.layers, layer_ids=layer_ids)
        elif op == "copy_slots":
            copy_slots(kv.layers, *args)
        elif op == "stop":
            return
        else:
            raise RuntimeError(f"unknown tensor-parallel operation {op!r}")


if __name__ == "__main__":  # started by group.py with the socket's file descriptor
    worker_main(Connection(int(sys.argv[1])))
