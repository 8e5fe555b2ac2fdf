"""The event loop: arrivals go to a replica through the router; each replica runs steps back to back while it
has work and sleeps otherwise. Time jumps from event to event (an arrival, or the end of some replica's step),
so a run of thousands of requests takes seconds and the same seed gives the same numbers."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .draft_outcomes import AcceptanceModel
from .metrics import RequestTimes, request_times, run_summary
from .replica import Replica, SpecPolicy
from .router import make_router
from .step_cost import StepCost
from .workload import SimRequest


@dataclass(frozen=True)
class Deployment:
    """What is simulated besides the traffic: replicas behind a router, each an engine with these limits."""

    replicas: int = 1
    router: str = "round-robin"
    max_num_seqs: int = 32  # the engine's defaults (EngineConfig)
    max_num_batched_tokens: int = 512
    policy: SpecPolicy = field(default_factory=SpecPolicy)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        make_router(self.router)  # validates the name


@dataclass
class SimResult:
    times: list[RequestTimes]
    summary: dict[str, Any]
    replicas: list[Replica]

    def per_replica(self) -> list[dict[str, float]]:
        end = max((t.arrival_s + t.e2el_s for t in self.times), default=0.0)
        return [{"requests": sum(t.replica == i for t in self.times), "steps": r.num_steps,
                 "utilisation": r.busy_s / end if end > 0 else 0.0} for i, r in enumerate(self.replicas)]


def simulate(requests: list[SimRequest], cost: StepCost, acceptance: AcceptanceModel | None,
             deployment: Deployment = Deployment(), record_steps: bool = False) -> SimResult:
    """Serve `requests` (any order; by arrival time) on the deployment; every request finishes."""
    if not requests:
        raise ValueError("no requests to simulate")
    d = deployment
    replicas = [Replica(cost, acceptance, d.policy, d.max_num_seqs, d.max_num_batched_tokens, seed=d.seed + i,
                        record_steps=record_steps) for i in range(d.replicas)]
    router = make_router(d.router)
    pending = sorted(requests, key=lambda r: r.arrival_s)
    where: dict[str, int] = {}
    times: list[RequestTimes] = []
    i = 0
    while True:
        next_arrival = pending[i].arrival_s if i < len(pending) else math.inf
        busy = [(r.busy_until, j) for j, r in enumerate(replicas) if r.busy_until is not None]
        step_end, j = min(busy) if busy else (math.inf, -1)
        if next_arrival <= step_end and i < len(pending):  # an arrival at a step's end joins the next step
            req = pending[i]
            i += 1
            j = router.pick(req, replicas)
            where[req.request_id] = j
            replicas[j].add(req)
            if replicas[j].busy_until is None:
                replicas[j].start_step(req.arrival_s)
        elif busy:
            for live in replicas[j].finish_step(step_end):
                times.append(request_times(live, j))
            replicas[j].start_step(step_end)
        else:
            break
    if len(times) != len(pending):
        raise RuntimeError(f"{len(pending) - len(times)} requests never finished")  # a bug, not an input error
    return SimResult(times, run_summary(times, sum(r.prompt_tokens for r in pending)), replicas)
