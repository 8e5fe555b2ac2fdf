"""How many drafts a simulated request is offered each decoding step, and how many of them are accepted.

A step's outcome is drawn once, before the draft length is chosen, as an ``Outcome``: the drafts the proposer
can offer (an n-gram lookup may find nothing) and how long a run of them the target would accept. Verifying
k <= offered drafts then accepts min(run, k). Drawing the run first keeps a step self-consistent whatever k
the policy picks, and lets the controller see the position after the last verified draft, as the engine's
n-gram path does.

Three sources:
- ``TextRuns``: for greedy chains (a draft model, a layer-skip draft), the run the target accepts depends only on
  where in the answer the draft starts: while its drafts match, it reads the answer's own tokens. So each
  position's run, measured once teacher-forced, replays any policy exactly (no censoring: a k never tried is
  still known). ``benchmarks/adaptive_replay.py`` records them.
- ``TraceReplay``: the recorded outcome sequence of each request, in order (records as ``engine.speculation.verify_trace``
  writes them, with (request, 0, 0) for decoding steps that verified nothing). The faithful choice when
  simulating the very requests that were recorded; a request without records falls back to rates.
- ``PositionRates``: per-position conditional acceptance and the share of steps with a proposal, estimated
  from any trace (``rates_from_trace``) or given by hand.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TraceRecord = tuple[str, int, int]  # (request id, drafts verified, drafts accepted), as engine.speculation.verify_trace


@dataclass(frozen=True)
class Outcome:
    offered: int  # drafts the proposer has this step (<= the cap asked for)
    run: int  # leading drafts the target agrees with (<= offered)
    # the draft's entropy (nats) at each offered position, where recorded: what a confidence stop reads
    entropies: tuple[float, ...] = ()

    def accepted(self, k: int) -> int:
        return min(self.run, k)


class AcceptanceModel(ABC):
    @abstractmethod
    def draw(self, request_id: str, cap: int, rng: np.random.Generator, position: int = 0) -> Outcome:
        """This decoding step's outcome for a request that may verify up to `cap` drafts, having emitted
        `position` tokens so far."""

    def free(self, request_id: str) -> None:
        """The request finished."""


@dataclass
class PositionRates(AcceptanceModel):
    """rates[j]: P(draft j+1 accepted | drafts 1..j accepted); beyond the list the last rate holds.
    proposal_share: the share of decoding steps on which the proposer offers drafts at all (n-gram lookups
    miss; 1.0 for a draft model). An offer is always the full cap."""

    rates: tuple[float, ...]
    proposal_share: float = 1.0

    def __post_init__(self) -> None:
        if not self.rates or any(not 0.0 <= a <= 1.0 for a in self.rates):
            raise ValueError(f"acceptance rates must be a non-empty list of numbers in [0, 1], got {self.rates}")
        if not 0.0 <= self.proposal_share <= 1.0:
            raise ValueError(f"proposal share must be in [0, 1], got {self.proposal_share}")

    def rate(self, position: int) -> float:
        return self.rates[min(position, len(self.rates) - 1)]

    def draw(self, request_id: str, cap: int, rng: np.random.Generator, position: int = 0) -> Outcome:
        if cap <= 0 or rng.random() >= self.proposal_share:
            return Outcome(0, 0)
        run = 0
        while run < cap and rng.random() < self.rate(run):
            run += 1
        return Outcome(cap, run)


class TraceReplay(AcceptanceModel):
    """Each request replays its own recorded outcomes in order; requests (or steps) beyond the records draw
    from `fallback`. A recorded outcome offers what was verified then, clipped to today's cap."""

    def __init__(self, records: list[TraceRecord], fallback: PositionRates) -> None:
        self._queues: dict[str, deque[tuple[int, int]]] = defaultdict(deque)
        for rid, num_draft, num_accepted in records:
            self._queues[rid].append((num_draft, num_accepted))
        self.fallback = fallback
        self.replayed = 0  # outcomes taken from the records
        self.drawn = 0  # outcomes drawn from the fallback

    def draw(self, request_id: str, cap: int, rng: np.random.Generator, position: int = 0) -> Outcome:
        queue = self._queues.get(request_id)
        if queue:
            num_draft, num_accepted = queue.popleft()
            self.replayed += 1
            offered = min(num_draft, max(cap, 0))
            return Outcome(offered, min(num_accepted, offered))
        self.drawn += 1
        return self.fallback.draw(request_id, cap, rng)

    def free(self, request_id: str) -> None:
        self._queues.pop(request_id, None)


class TextRuns(AcceptanceModel):
    """runs[request][p]: how many drafts in a row the target accepts when the request drafts after emitting p
    tokens (greedy chains: fixed by the text); entropies[request][p], if given, the draft's entropy for the
    answer's token p. Every step offers the full cap."""

    def __init__(self, runs: dict[str, list[int]], entropies: dict[str, list[float]] | None = None) -> None:
        bad = [rid for rid, r in runs.items() if any(n < 0 for n in r)]
        if bad:
            raise ValueError(f"accepted runs must be >= 0 (requests {bad[:3]})")
        self.runs = runs
        self.entropies = entropies or {}

    def draw(self, request_id: str, cap: int, rng: np.random.Generator, position: int = 0) -> Outcome:
        runs = self.runs[request_id]
        if cap <= 0:
            return Outcome(0, 0)
        run = runs[position] if position < len(runs) else 0
        return Outcome(cap, min(run, cap), tuple(self.entropies.get(request_id, [])[position: position + cap]))


def rates_from_trace(records: list[TraceRecord], max_positions: int = 16) -> PositionRates:
    """Per-position conditional acceptance from recorded verifications, and the share of recorded decoding
    steps that verified drafts at all (records with 0 drafts; 1.0 when the trace has none of those).

    Position j (1-based) was tried in a record of d drafts with m accepted iff d >= j and m >= j - 1, and
    accepted iff m >= j. A position never tried takes the rate before it."""
    if not records:
        raise ValueError("an acceptance trace needs at least one record")
    tried = np.zeros(max_positions)
    kept = np.zeros(max_positions)
    drafting = 0
    for _, d, m in records:
        if d <= 0:
            continue
        drafting += 1
        for j in range(min(d, m + 1, max_positions)):
            tried[j] += 1
            kept[j] += j < m
    if drafting == 0:
        return PositionRates((0.0,), 0.0)
    rates: list[float] = []
    for j in range(max_positions):
        if tried[j] == 0:
            break
        rates.append(float(kept[j] / tried[j]))
    return PositionRates(tuple(rates), drafting / len(records))


def load_trace(path: str | Path) -> list[TraceRecord]:
    """A JSON list of [request_id, drafts, accepted] (or {"trace": [...]})."""
    data = json.loads(Path(path).read_text())
    rows = data["trace"] if isinstance(data, dict) else data
    try:
        records = [(str(r[0]), int(r[1]), int(r[2])) for r in rows]
    except (TypeError, ValueError, IndexError, KeyError) as exc:
        raise ValueError(f"{path}: expected a list of [request_id, drafts, accepted] records ({exc})") from None
    bad = [r for r in records if r[1] < 0 or not 0 <= r[2] <= max(r[1], 0)]
    if bad:
        raise ValueError(f"{path}: records need drafts >= 0 and 0 <= accepted <= drafts, got {bad[:3]}")
    return records
