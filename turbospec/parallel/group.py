"""Rank 0's side of tensor parallelism: start the other ranks, shard its own model, and send every forward's
inputs to the others before running its share.

Only the target model's forward is distributed. The scheduler, sampler, speculation (proposers, controller)
and the LM head run on rank 0 alone, exactly as without tensor parallelism: the other ranks see nothing but
forwards and KV slot copies. A draft model, when one is used, runs whole on rank 0.
"""

from __future__ import annotations

import dataclasses
import logging
import os
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

from ..config import EngineConfig
from ..models.llama import CausalLM
from .comm import Communicator, TensorParallelError, backend_for
from .plan import ShardPlan
from .shard import shard_model
from .worker import STORE_TIMEOUT, WorkerSpec

log = logging.getLogger("turbospec.parallel")

START_TIMEOUT_S = 600.0  # a rank loading a large model on a busy CPU

KVLayers = list[tuple[torch.Tensor, torch.Tensor]]


class TensorParallelGroup:
    def __init__(self, spec: WorkerSpec, model: CausalLM, kv_layers: KVLayers) -> None:
        """Start ranks 1..world-1 (each loads the model itself), then shard `model` as rank 0, whose KV cache is
        `kv_layers`. Blocks until every rank is ready; raises RuntimeError with a rank's traceback if one fails."""
        self.world = spec.world
        self.kv_layers = kv_layers
        self.broken: str | None = None  # why the ranks can no longer run together
        self._in_forward = False
        store = dist.TCPStore(spec.store_host, 0, spec.world, is_master=True, wait_for_workers=False,
                              timeout=STORE_TIMEOUT)
        spec = dataclasses.replace(spec, store_port=store.port)
        # Each rank is a fresh interpreter (`python -m turbospec.parallel.worker`) joined by a socket pair, not a
        # multiprocessing child: spawn would re-run the user's script (scripts without a __main__ guard would
        # start engines recursively) and fork would inherit torch's thread pools in an unknown state. Its own
        # session keeps a terminal's Ctrl-C away from it (rank 0 decides when it stops), and it imports
        # turbospec from wherever this process does.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._procs: list[subprocess.Popen[bytes]] = []
        self._conns: list[Connection] = []
        for rank in range(1, spec.world):
            ours, theirs = socket.socketpair()
            proc = subprocess.Popen([sys.executable, "-m", "turbospec.parallel.worker", str(theirs.fileno())],
                                    pass_fds=(theirs.fileno(),), env=env, start_new_session=True)
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
        model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        model.register_forward_hook(self._after_forward)
        log.info("tensor parallelism: %d ranks (%s), KV-head groups per rank %s", spec.world, spec.backend,
                 [len(r) for r in self.plan.all_groups])

    def _await(self, state: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank, (proc, conn) in enumerate(zip(self._procs, self._conns), start=1):
            try:
                while not conn.poll(0.2):
                    if proc.poll() is not None:
                        raise EOFError
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"tensor-parallel rank {rank} was not {state} after "
                                           f"{START_TIMEOUT_S:.0f} s")
                got, detail = conn.recv()
            except (EOFError, OSError):
                raise RuntimeError(f"tensor-parallel rank {rank} exited (code {proc.wait(timeout=10)}) before it "
                                   f"was {state}; its error is in this process's stderr") from None
            if got == "error":
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start:\n{detail}")
            assert got == state, (got, state)

    def _before_forward(self, _model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        if self._in_forward:  # the last forward stopped on this rank after the others had started it: they
            # wait in one of its collectives, and pairing them with this forward's would mix two steps
            self._fail("a forward was interrupted on rank 0 while the other ranks ran it")
        if self.broken is not None:
            raise TensorParallelError(f"{self.broken}: restart the engine")
        names = ("input_ids", "positions", "meta", "kv_caches", "layer_ids")
        call = {**dict(zip(names, args)), **kwargs}
        if call["kv_caches"] is not self.kv_layers:
            raise RuntimeError("a tensor-parallel model runs over its engine's own KV cache only")
        layer_ids, meta = call.get("layer_ids"), call["meta"]
        if meta.slot_mapping.device.type != "cpu":  # each rank moves it to its own device
            meta = meta.to(torch.device("cpu"))
        self._send(("forward", call["input_ids"].cpu(), call["positions"].cpu(), meta,
                    None if layer_ids is None else list(layer_ids)))
        self._in_forward = True

    def _after_forward(self, *_: Any) -> None:
        self._in_forward = False

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self._send(("copy_slots", src, dst))

    def _send(self, message: tuple[Any, ...]) -> None:
        # every rank alive first: a dead one would leave the others waiting in the first collective
        for rank, proc in enumerate(self._procs, start=1):
            code = proc.poll()
            if code is not None:
                self._fail(f"tensor-parallel rank {rank} exited (code {code})")
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self._conns, start=1):
            try:
                conn.send_bytes(data)
            except OSError as exc:
                self._fail(f"tensor-parallel rank {rank} is gone ({exc})")

    def _fail(self, reason: str) -> None:
        self.broken = self.broken or reason
        for proc in self._procs:  # they may wait in a collective that will never complete: no graceful stop
            proc.kill()
        self.close()
        raise TensorParallelError(f"{self.broken}: this engine cannot run forwards any more; restart it")

    def close(self) -> None:
        """Stop the other ranks (also done when the group is garbage-collected or the process exits); the
        model's later forwards then fail with TensorParallelError."""
        self.broken = self.broken or "the tensor-parallel ranks were stopped"
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
        except subprocess.TimeoutExpired:  # e.g. waiting in a collective rank 0 will never join
            proc.kill()
            proc.wait(timeout=5)


def start_tensor_parallel(config: EngineConfig, model: CausalLM, kv_layers: KVLayers, num_blocks: int,
                          dtype: torch.dtype, compute_dtype: torch.dtype) -> TensorParallelGroup:
    """The other ranks of an engine started with tensor_parallel_size > 1, this process being rank 0."""
    spec = WorkerSpec(model=config.model, dtype=str(dtype).removeprefix("torch."),
                      compute_dtype=str(compute_dtype).removeprefix("torch."), device=config.device,
                      threads=config.threads, world=config.tensor_parallel_size, num_blocks=num_blocks,
                      block_size=config.block_size, store_host="127.0.0.1", store_port=0,
                      backend=backend_for(config.device))
    return TensorParallelGroup(spec, model, kv_layers)
