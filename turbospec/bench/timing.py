"""Timing helpers shared by the benchmark scripts (their numbers are medians: a shared machine's outliers are
slow calls, never fast ones)."""

from __future__ import annotations

import random
import statistics
import time

from ..engine import LLMEngine
from ..sampling_params import SamplingParams


def decode_step_ms(engine: LLMEngine, contexts: list[int], rng: random.Random, steps: int) -> float:
    """Median ms of `steps` decode steps (the first two dropped) of requests with random prompts of these
    lengths, after their prefill; the engine is left idle."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    ids = [engine.add_request([rng.randrange(vocab) for _ in range(n)], params) for n in contexts]
    while any(engine.requests[r].is_prefilling or engine.requests[r].num_computed_tokens == 0 for r in ids):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for r in ids:
        engine.abort_request(r)
    return statistics.median(times[2:]) * 1e3
