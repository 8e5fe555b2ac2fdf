"""Rank 0's side of tensor parallelism: start the other ranks, shard its own model, and send every forward's
inputs to the others before running its share.

Only the target model's forward is distributed. The scheduler, sampler, speculation (proposers, controller)
and the LM head run on rank 0 alone, exactly as without tensor parallelism: the other ranks see nothing but
forwards and KV slot copies. A draft model, when one is used, runs whole on rank 0.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from ..models.llama import CausalLM
from .comm import Communicator
from .plan import ShardPlan
from .shard import shard_model
from .worker import STORE_TIMEOUT, WorkerSpec

log = logging.getLogger("turbospec.parallel")

START_TIMEOUT_S = 600.0  # a rank loading a large model on a busy CPU


class TensorParallelGroup:
    def __init__(self, spec: WorkerSpec, model: CausalLM) -> None:
        """Start ranks 1..world-1 (each loads the model itself), then shard `model` as rank 0. Blocks until every
        rank is ready; raises RuntimeError with a rank's traceback if one fails to start."""
        self.world = spec.world
        store = dist.TCPStore(spec.store_host, 0, spec.world, is_master=True, wait_for_workers=False,
                              timeout=STORE_TIMEOUT)
        spec = dataclasses.replace(spec, store_port=store.port)
        # Each rank is a fresh interpreter (`python -m turbospec.parallel.worker`) joined by a socket pair, not a
        # multiprocessing child: spawn would re-run the user's script (scripts without a __main__ guard would
        # start engines recursively) and fork would inherit torch's thread pools in an unknown state.
        self._procs: list[subprocess.Popen[bytes]] = []
        self._conns: list[Connection] = []
        for rank in range(1, spec.world):
            ours, theirs = socket.socketpair()
            proc = subprocess.Popen([sys.executable, "-m", "turbospec.parallel.worker", str(theirs.fileno())],
                                    pass_fds=(theirs.fileno(),))
            theirs.close()
            conn = Connection(ours.detach())
            conn.send((spec, rank))
            self._procs.append(proc)
            self._conns.append(conn)
        self._stop = weakref.finalize(self, _stop_workers, self._procs, self._conns)
        try:
            self._await("loaded")
            self.comm = Communicator(store, 0, spec.world, spec.backend)
            self.plan = ShardPlan(0, spec.world, model.cfg)
            shard_model(model, self.plan, self.comm)
            self._await("serving")
        except BaseException:
            self.close()
            raise
        self._store = store  # the other ranks' rendezvous: kept alive with the group
        self.kv_layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        log.info("tensor parallelism: %d ranks (%s), KV-head groups per rank %s", spec.world, spec.backend,
                 [len(r) for r in self.plan.all_groups])

    def _await(self, state: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank, (proc, conn) in enumerate(zip(self._procs, self._conns), start=1):
            while not conn.poll(0.2):
                if proc.poll() is not None:
                    raise RuntimeError(f"tensor-parallel rank {rank} exited (code {proc.returncode}) before it was "
                                       f"{state}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel rank {rank} was not {state} after {START_TIMEOUT_S:.0f} s")
            got, detail = conn.recv()
            if got == "error":
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start:\n{detail}")
            assert got == state, (got, state)

    def _before_forward(self, _model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        ids, positions, meta, kv_caches = args[:4]
        if kv_caches is not self.kv_layers:
            raise RuntimeError("a tensor-parallel model runs over its engine's own KV cache only")
        layer_ids = args[4] if len(args) > 4 else kwargs.get("layer_ids")
        self._send(("forward", ids.cpu(), positions.cpu(), meta, None if layer_ids is None else list(layer_ids)))

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self._send(("copy_slots", src, dst))

    def _send(self, message: tuple[Any, ...]) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, (proc, conn) in enumerate(zip(self._procs, self._conns), start=1):
            # a dead rank would leave this one waiting in the first collective: fail the step now instead
            code = proc.poll()
            if code is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} exited (code {code}): this engine cannot run "
                                   "forwards any more; restart it")
            try:
                conn.send_bytes(data)
            except OSError as exc:
                raise RuntimeError(f"tensor-parallel rank {rank} is gone ({exc}): restart the engine") from exc

    def close(self) -> None:
        """Stop the other ranks (also done when the group is garbage-collected or the process exits)."""
        self._stop()


def _stop_workers(procs: list[subprocess.Popen[bytes]], conns: list[Connection]) -> None:
    data = pickle.dumps(("stop",))
    for conn in conns:
        try:
            conn.send_bytes(data)
            conn.close()
        except OSError:
            pass
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
