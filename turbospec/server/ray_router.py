"""Which replica serves a request: a Ray Serve request router (``ray.serve.request_router.RequestRouter``) that
runs inside every handle calling the replica deployment (here: the ingress).

Modes (``--routing``):
- ``fewest-tokens``: the replica with the fewest outstanding tokens (prompt + max_tokens of its in-flight
  requests). The router counts what it sent and has not seen complete (from the moment it picks a replica, so
  a burst does not pile onto one); each replica reports its own count (``record_routing_stats``, every
  ``request_routing_stats_period_s``), and what that report holds beyond this router's share at the time is
  other callers' load.
- ``prefix``: requests whose prompts start alike (the first ``PREFIX_CHARS`` characters) go to the same replica
  (rendezvous hashing, so adding or losing a replica moves only that replica's prefixes) and reuse its prefix
  cache; when that replica holds ``imbalance_tokens`` more than the least loaded one, the least loaded wins.
- ``pow2``: Ray Serve's default, two random replicas and the shorter queue.

A request may also name its replica (``RouteHint.target``): the ingress does that to scrape each replica's
metrics. Ranks returned by ``choose_replicas`` are tried in order; Ray Serve skips a replica whose queue is full.
"""

from __future__ import annotations

import hashlib
import random
import time
import weakref
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

ROUTING_MODES = ("fewest-tokens", "prefix", "pow2")
PREFIX_CHARS = 256  # prompts that share this many leading characters share a replica under "prefix"
DEFAULT_IMBALANCE_TOKENS = 4096
KEEP_DONE_S = 10.0  # completed requests remembered this long (replicas report every request_routing_stats_period_s)

_routers: weakref.WeakSet[TokenAwareRouter] = weakref.WeakSet()  # this process's routers (the ingress's)


@dataclass(frozen=True)
class RouteHint:
    """What the router needs to know about a request, computed by the ingress from its body."""

    cost: int = 0  # estimated prompt tokens + max_tokens
    prefix: str | None = None  # a digest of the prompt's first PREFIX_CHARS characters
    target: str | None = None  # a replica's unique id: send it there and nowhere else


@dataclass
class _Sent:
    """A request this router sent: to which replica, its cost, when it was sent and when it completed."""

    replica: ReplicaID
    cost: int
    sent: float
    done: float | None = None
    done_by: ReplicaID | None = None  # the replica whose completion this was (a late one may be an earlier try's)
    routed: bool = False  # Ray Serve said where it went (else a guess of choose_replicas)


class TokenAwareRouter(RequestRouter):
    def initialize_state(self, mode: str = "fewest-tokens", imbalance_tokens: int = DEFAULT_IMBALANCE_TOKENS,
                         **_: Any) -> None:
        if mode not in ROUTING_MODES:
            raise ValueError(f"unknown routing mode {mode!r}: expected one of {', '.join(ROUTING_MODES)}")
        self.mode = mode
        self.imbalance_tokens = imbalance_tokens
        self._sent: dict[str, _Sent] = {}  # by Ray Serve's internal request id
        # Ray Serve ships this class pickled by value, with a copy of this module's globals: register with the
        # module the ingress imported
        from turbospec.server import ray_router

        ray_router._routers.add(self)

    # --- the load of a replica -----------------------------------------------------------------------------

    def load(self, replica: RunningReplica) -> int:
        """Outstanding tokens: what this router has in flight there now, plus what others had there at the
        replica's last report (the report minus this router's share at that time)."""
        rid, stats = replica.replica_id, replica.routing_stats or {}
        mine = [s for s in self._sent.values() if s.replica == rid]
        now = sum(s.cost for s in mine if s.done is None)
        if "outstanding_tokens" not in stats:
            return now
        as_of = float(stats.get("time", 0.0))
        then = sum(s.cost for s in mine if s.sent <= as_of and (s.done is None or s.done > as_of))
        return now + max(0, int(stats["outstanding_tokens"]) - then)

    def _track(self, pending_request: PendingRequest, replica_id: ReplicaID) -> None:
        """A routing attempt's guess: a new attempt starts pending; another guess for a pending one keeps its
        sent time (Ray Serve may ask again after a full queue)."""
        key = pending_request.metadata.internal_request_id
        previous = self._sent.get(key)
        self._sent[key] = _Sent(replica_id, _hint(pending_request).cost,
                                previous.sent if previous is not None and previous.done is None else time.time())

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """Where it went (choose_replicas guessed its first rank). Ray Serve calls this after awaiting the
        replica's acceptance, and a fast answer (a 400) may have completed by then: it stays completed, or its
        cost would count against that replica for good. A completion from another replica was an earlier try's
        (a retry keeps the request id): this try is pending."""
        sent = self._sent.get(pending_request.metadata.internal_request_id)
        if sent is None:
            self._track(pending_request, replica_id)
            sent = self._sent[pending_request.metadata.internal_request_id]
        elif sent.done is not None and sent.done_by != replica_id:
            sent.done = sent.done_by = None
        sent.replica, sent.routed = replica_id, True

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        now = time.time()
        sent = self._sent.get(internal_request_id)
        if sent is None:  # completed before it was ever tracked: remembered, so a late on_request_routed sees it
            self._sent[internal_request_id] = _Sent(replica_id, 0, now, done=now, done_by=replica_id)
        else:
            sent.done, sent.done_by = now, replica_id
        self._prune(now)

    def _prune(self, now: float) -> None:
        """Completed requests are kept while a replica report may still count them; a guess never routed (its
        caller went away while Ray Serve still queued it: no callback comes) only as long."""
        self._sent = {k: s for k, s in self._sent.items()
                      if (s.done is None and (s.routed or now - s.sent < KEEP_DONE_S))
                      or (s.done is not None and now - s.done < KEEP_DONE_S)}

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._sent = {k: s for k, s in self._sent.items() if s.replica != replica_id}

    # --- choosing --------------------------------------------------------------------------------------------

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # an empty answer waits, never spins
        if not candidate_replicas:
            return []
        self._prune(time.time())
        hint = _hint(pending_request)
        if hint.target is not None:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == hint.target]]
        if self.mode == "pow2":
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        loads = {r.replica_id: self.load(r) for r in candidate_replicas}
        by_load = sorted(candidate_replicas, key=lambda r: (loads[r.replica_id], random.random()))
        if self.mode == "prefix" and hint.prefix is not None:
            home = max(candidate_replicas, key=lambda r: _rendezvous(hint.prefix, r.replica_id.unique_id))
            if loads[home.replica_id] - loads[by_load[0].replica_id] <= self.imbalance_tokens:
                by_load.remove(home)
                by_load.insert(0, home)
        if pending_request is not None:  # counted at once, so concurrent routing sees it (corrected when routed)
            self._track(pending_request, by_load[0].replica_id)
        return [[r] for r in by_load]  # one rank each: the next is tried only when a queue is full


def replica_ids(app_name: str) -> list[str]:
    """The unique ids of the running replicas that this process's routers for `app_name` know (in the ingress:
    the replicas of its one replica deployment)."""
    ids: set[str] = set()
    for router in list(_routers):
        if router.app_name == app_name:
            ids.update(rid.unique_id for rid in router.curr_replicas)
    return sorted(ids)


def prefix_digest(text: str) -> str:
    return hashlib.blake2b(text[:PREFIX_CHARS].encode(), digest_size=8).hexdigest()


def _rendezvous(prefix: str, replica: str) -> bytes:
    return hashlib.blake2b(f"{prefix}/{replica}".encode(), digest_size=8).digest()


def _hint(pending_request: PendingRequest | None) -> RouteHint:
    """The request's hint. Not an isinstance check: this module's RouteHint here may be a by-value copy."""
    hint = None if pending_request is None else pending_request.kwargs.get("hint")
    return RouteHint(getattr(hint, "cost", 0), getattr(hint, "prefix", None), getattr(hint, "target", None))
