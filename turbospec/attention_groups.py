"""Which sequences of a step share one padded attention call, and how many cache slots that call reads.

A group pads every member to its longest context: the gather and both matmuls cost (members x longest
context), not the sum of the contexts. One decode group for a whole batch made a step with one 950-token and
fifteen 50-token requests slower than sixteen 500-token ones (benchmarks/results/attention_groups/attention_groups.md). So
short queries are sorted by context and split wherever padding a sequence to its group's longest context
would cost more than another group call does.

Pure Python on purpose: the runner (attention.build_metadata), the step-time features (control/step_time.py)
and the simulator plan the same groups from (query length, context length) pairs, so the step-time model
sees the padded work the kernels really do.
"""

from __future__ import annotations

# Queries of up to this many tokens are padded into shared groups; a longer prefill chunk attends alone,
# so a 512-token chunk never pads 15 decodes to 512 rows.
MAX_GROUP_QUERY = 16

# Start a new group when a sequence's context is this many slots shorter than its group's longest: an extra
# group call costs about as much per layer as attending this many padded slots for one sequence
# (benchmarks/attention_groups.py measures both on this CPU).
GROUP_BREAK_SLOTS = 256


def plan_groups(query_lens: list[int], context_lens: list[int], members: list[int] | None = None
                ) -> list[list[int]]:
    """Groups of sequence indices (each in ascending order, so contiguous queries stay contiguous): the short
    queries in as few groups as the padding rule allows, then each long query on its own."""
    members = list(range(len(query_lens))) if members is None else members
    short = sorted((i for i in members if query_lens[i] <= MAX_GROUP_QUERY), key=lambda i: -context_lens[i])
    groups: list[list[int]] = []
    current: list[int] = []
    for i in short:
        if current and context_lens[current[0]] - context_lens[i] > GROUP_BREAK_SLOTS:
            groups.append(sorted(current))
            current = []
        current.append(i)
    if current:
        groups.append(sorted(current))
    return groups + [[i] for i in members if query_lens[i] > MAX_GROUP_QUERY]


def gathered_slots(query_lens: list[int], context_lens: list[int]) -> int:
    """Cache slots the step's attention reads per layer and KV head, padding included."""
    return sum(len(g) * max(context_lens[i] for i in g) for g in plan_groups(query_lens, context_lens))
