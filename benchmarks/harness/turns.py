"""Side-by-side rows: engines loaded together take turns prompt by prompt, the order alternating, so the drift of
a shared machine (10-25% between processes here) falls on every row alike."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from tqdm import tqdm

from . import stats

T = TypeVar("T")


def alternating(items: Sequence[T], turn: int) -> list[T]:
    """`items` in order on even turns and reversed on odd ones: neither row always runs first."""
    return list(items) if turn % 2 == 0 else list(items)[::-1]


def warm_up(llm: Any, ids: list[int], tokens: int = 4) -> None:
    """One short greedy generation before timing (kernels built, caches and the controller's profile loaded)."""
    from turbospec import SamplingParams

    llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=tokens), use_tqdm=False)


def prefill_seconds(llm: Any, prompts: list[list[int]]) -> float:
    """The same prompts again for one token each: the prefill's part of a set's time."""
    from turbospec import SamplingParams

    total = 0.0
    for ids in prompts:
        start = time.perf_counter()
        llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        total += time.perf_counter() - start
    return total


def set_result(outputs: list[list[int]], seconds: float, first_token_seconds: float,
               spec: dict[str, Any]) -> dict[str, Any]:
    """One row's numbers on one set of prompts, every rate and tau from harness/stats.py."""
    tokens = sum(map(len, outputs))
    return {"outputs": outputs, "seconds": seconds, "first_token_seconds": first_token_seconds, "tokens": tokens,
            "tau": stats.tau(spec), "acceptance_by_position": stats.acceptance_by_position(spec),
            "mean_k": spec.get("mean_k"), "k_histogram": spec.get("k_histogram"),
            "controller": spec.get("controller")}  # its own time among them


def run_sets(llms: dict[str, Any], data: dict[str, list[list[int]]], params: Any, *, desc: str = "",
             on_output: Callable[[str, str, Any], None] | None = None, measure_prefill: bool = False,
             leave: bool = True) -> dict[str, dict[str, dict[str, Any]]]:
    """{row: {set: set_result}}: every engine of `llms` (already warmed up) generates every prompt of each set
    with `params`, the rows taking turns prompt by prompt (alternating()). Each engine's speculation counters are
    reset at the start of a set; `on_output(row, set, output)` sees every RequestOutput; `measure_prefill` adds
    `prefill_seconds` (prefill_seconds()) after the set."""
    results: dict[str, dict[str, dict[str, Any]]] = {row: {} for row in llms}
    for name, prompts in data.items():
        outputs: dict[str, list[list[int]]] = {row: [] for row in llms}
        seconds = dict.fromkeys(llms, 0.0)
        first_token = dict.fromkeys(llms, 0.0)  # from arrival to the first token, per row
        for llm in llms.values():
            llm.engine.reset_spec_stats()
        bar = tqdm(prompts, desc=f"{desc or '+'.join(llms)} {name}", unit="prompt", leave=leave)
        for i, ids in enumerate(bar):
            for row in alternating(list(llms), i):
                start = time.perf_counter()
                out = llms[row].generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
                seconds[row] += time.perf_counter() - start
                first_token[row] += out.metrics.first_token_time - out.metrics.arrival_time
                outputs[row].append(out.outputs[0].token_ids)
                if on_output is not None:
                    on_output(row, name, out)
            bar.set_postfix({f"{row} tok/s": f"{sum(map(len, outputs[row])) / seconds[row]:.2f}" for row in llms})
        for row, llm in llms.items():
            results[row][name] = set_result(outputs[row], seconds[row], first_token[row], llm.spec_stats())
            if measure_prefill:
                results[row][name]["prefill_seconds"] = prefill_seconds(llm, prompts)
    return results
