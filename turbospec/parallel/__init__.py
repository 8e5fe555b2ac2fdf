"""Tensor parallelism inside one engine: the decoder layers split over processes by KV-head group
(plan.py), sharded linears with their collectives (shard.py, comm.py), rank 0's driver (group.py) and the
other ranks' loop (worker.py)."""
