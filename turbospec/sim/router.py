"""Which replica gets an arriving request. Routers see only what a real load balancer in front of the
replicas could know at the arrival: who holds how many requests and tokens."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from .replica import Replica
from .workload import SimRequest


class Router(ABC):
    name = "base"

    @abstractmethod
    def pick(self, req: SimRequest, replicas: Sequence[Replica]) -> int:
        """The index of the replica that serves `req`."""


class RoundRobin(Router):
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def pick(self, req: SimRequest, replicas: Sequence[Replica]) -> int:
        i = self._next % len(replicas)
        self._next += 1
        return i


class FewestOutstandingTokens(Router):
    """The replica with the fewest tokens still to compute (prompts left to prefill plus outputs left to
    generate). Output lengths are known to the simulator, not to a real router: a real one would use
    max_tokens or a predicted length, so this is the policy's best case. Ties go to the lowest index."""

    name = "fewest-tokens"

    def pick(self, req: SimRequest, replicas: Sequence[Replica]) -> int:
        return min(range(len(replicas)), key=lambda i: replicas[i].outstanding_tokens)


ROUTERS: dict[str, type[Router]] = {r.name: r for r in (RoundRobin, FewestOutstandingTokens)}


def make_router(name: str) -> Router:
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}: expected one of {', '.join(ROUTERS)}")
    return ROUTERS[name]()
