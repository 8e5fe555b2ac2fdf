"""Profile the real engine's step time over a grid and cache the fitted model per model, dtype, threads and
hardware (``turbospec profile``, or a brief run the first time the controller needs one).

Every grid point runs real ``engine.step()`` calls: B requests with their own random prompts, of lengths
spread evenly over [C/2, 3C/2] (mean C), each verifying k drafts per step. Served requests share neither KV
blocks nor context lengths: one prompt for all would make steps faster than served ones and hide the padding
attention pays for unequal contexts (attention_groups.py); served steps of 7+ requests then ran 35-50% over the
profile. Every step the engine runs is a sample, the prefill
chunks included, so the fit also covers prefill-heavy steps. During profiling:
- acceptance is synthetic and 0, so contexts grow one token per step whatever the drafts say;
- the n-gram proposer is replaced by one that always proposes k tokens. Real lookups often find no match,
  and the verify cost does not depend on the draft's values.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from .. import kernels
from ..attention_choice import choice_summary
from ..control.step_time import StepSample, StepTimeModel
from ..draft import Draft
from ..engine import LLMEngine
from ..host import hardware_name, turbospec_home
from ..proposers.base import Proposer
from ..request import Request
from ..sampling_params import SamplingParams

log = logging.getLogger("turbospec.tuning")


@dataclass(frozen=True)
class ProfileGrid:
    batch_sizes: tuple[int, ...]
    contexts: tuple[int, ...]
    ks: tuple[int, ...]
    repeats: int  # steps measured per (B, C, k)


GRIDS = {
    "brief": ProfileGrid((1, 4, 12), (128,), (0, 1, 2, 4, 6), 3),
    "full": ProfileGrid((1, 2, 4, 8, 16, 32), (64, 512, 1024), (0, 1, 2, 4, 8), 3),
}
# The profile the controller measures for itself reaches the largest decode batch the engine can run, up to this
# batch. At saturation every seat decodes, and a profile that stopped short (the brief grid's 12) priced those
# steps by extrapolation: the controller then drafted at batches no step of the profile had shown.
TOP_BATCH = 32


def largest_decode_batch(engine: LLMEngine) -> int:
    """The most requests one step can decode: a seat each, a token of the step's budget each."""
    return min(engine.config.max_num_seqs, engine.config.max_num_batched_tokens)


# Part of every profile's key: a profile cached by another version of this profiler (other step features, another
# grid, fits not monotone in work, disturbed steps kept) is measured again rather than trusted.
PROFILER_VERSION = "9"
# A recorded step this much slower than the fastest of its grid point's rounds at the same k was disturbed: noise
# only adds time. With a smollm2-135m brief profile measured while a test ran beside it, the adaptive DART row chose
# 1-node trees: 0.91x / 0.96x of fixed 8 nodes (benchmarks/results/proposer_zoo/archive/2026-12-03-proposer_zoo_smollm2_zen5_disturbed_profile.md).
# A synthetic co-runner did not reproduce that (benchmarks/profile_disturbance.py): the drop's benefit is unmeasured.
DISTURBED = 1.25


class RepeatProposer(Proposer):
    """Proposes k copies of the last token: a stand-in whose only job is to fill k verify slots."""

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[Draft]:
        return [Draft([r.all_token_ids[-1]] * k) for r, k in zip(requests, num_tokens)]


def profile_key(engine: LLMEngine) -> dict[str, str]:
    spec = engine.spec
    key = {
        "profiler": PROFILER_VERSION,
        "model": engine.config.model,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "threads": str(engine.config.threads),
        "hardware": hardware_name(engine.config.device),
        "torch": torch.__version__,
        "speculation": "none" if spec is None else spec.method + (f":{spec.model}" if spec.model else ""),
    }
    if spec is not None:  # the profile measures up to the controller's cap (profile_ks)
        key["k_limit"] = str(spec.k_limit)
    weights = engine.loaded.weights
    if weights is not None and weights.packed_linears:  # packed kernels: other step times, and a kink at the
        # rows where each linear switches to dense (absent for dense models: old caches stay valid)
        key["weights"] = weights.format + ":" + ",".join(f"{s}={r}" for s, r in sorted(weights.crossover.items()))
    bf16_rows = kernels.bf16_rows_limit() if engine.config.dtype in ("bfloat16", "bf16") else 0
    if bf16_rows:  # dense bf16 linears run our kernel here, up to these rows
        key["bf16_rows"] = str(bf16_rows) + kernels.bf16_rows_key_suffix()
    if bf16_rows or (weights is not None and weights.packed_linears):
        key["kernels"] = kernels.build_id()  # our kernels' version (or the int8 fallback) sets step times too
    mc = engine.model_config
    short_queries = (choice_summary(mc.num_heads, mc.num_kv_heads, mc.head_dim, engine.dtype)
                     if engine.config.device == "cpu" else "none")
    if short_queries != "none":  # a single sequence's short queries attend by our matmuls or fused kernel rather
        # than SDPA at these counts, measured faster here (attention_choice.py; absent otherwise)
        key["attention"] = short_queries
    if engine.config.tensor_parallel_size > 1:  # other processes, collectives in every layer
        key["tensor_parallel"] = str(engine.config.tensor_parallel_size)
    if engine.config.deterministic:  # other kernels, other step times (absent otherwise: old caches stay valid)
        key["deterministic"] = engine.config.deterministic
    return key


def profile_path(key: dict[str, str]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", key["model"])[-48:]
    return turbospec_home() / "profiles" / f"{stem}-{key['dtype']}-t{key['threads']}-{digest}.json"


def prompt_lengths(context: int, batch: int) -> list[int]:
    """A grid point's prompt lengths: spread evenly over [C/2, 3C/2], so their mean is C."""
    if batch == 1:
        return [context]
    return [max(1, round(context * (0.5 + i / (batch - 1)))) for i in range(batch)]


def profile_ks(engine: LLMEngine, grid: ProfileGrid) -> tuple[int, ...]:
    """The draft lengths to measure: the grid's and the most the controller may choose (k_limit), so its costs
    near the cap are measured, not extrapolated. Ad hoc: a brief profile that stopped at k = 6 priced the 1.5B
    target's 9-token EAGLE verify at 0.8x a plain step (a step-down column fitted where no step was measured),
    and the controller then always chose it. Packed linears switch kernels at their crossover rows: single
    requests are measured on both sides of it."""
    if engine.speculation.proposer is None or engine.spec is None:
        return (0,)
    ks = set(grid.ks) | {engine.spec.k_limit}
    weights = engine.loaded.weights
    if weights is not None and weights.crossover:
        ks |= {k for r in weights.crossover.values() for k in (r - 1, r) if 0 <= k <= max(ks)}
    return tuple(sorted(ks))


def _grid_points(engine: LLMEngine, grid: ProfileGrid, ks: tuple[int, ...]) -> list[tuple[int, int]]:
    """(context, batch) pairs that fit the engine's limits. Acceptance is synthetic and 0, so a request grows one
    token per step (its prefill's included) and its last step needs k_max slots beyond that; a few steps spare.
    Counting k_max + 1 tokens a step instead asked the brief grid for ~380 positions, so a user's k = "auto" engine
    with max_model_len 256 could not be profiled at all."""
    k_max = max(ks)
    steps = len(ks) * (grid.repeats + 1) + 4
    points = []
    for ctx in grid.contexts:
        for b in grid.batch_sizes:
            lengths = [n + steps + k_max + 1 for n in prompt_lengths(ctx, b)]
            blocks = sum(-(-n // engine.config.block_size) for n in lengths)
            if max(lengths) <= engine.max_model_len and b <= largest_decode_batch(engine) and \
                    blocks <= engine.kv.num_blocks:
                points.append((ctx, b))
    return points


def drop_disturbed(recorded: list[tuple[int, StepSample]]) -> list[StepSample]:
    """One grid point's recorded (k, sample) rounds, in order, without the steps more than DISTURBED times slower
    than the fastest at the same k."""
    fastest: dict[int, float] = {}
    for k, sample in recorded:
        fastest[k] = min(fastest.get(k, float("inf")), sample.total_s)
    return [sample for k, sample in recorded if sample.total_s <= DISTURBED * fastest[k]]


def profile_engine(engine: LLMEngine, grid: ProfileGrid, progress: bool = True, seed: int = 0) -> list[StepSample]:
    """Run the grid on an idle engine and return its steps' samples: every prefill step, and the decode rounds
    drop_disturbed keeps. The engine is left idle as found."""
    if engine.has_unfinished_requests():
        raise RuntimeError("profiling needs an idle engine")
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    # its steps (synthetic acceptance 0) must not show in the user's speculation statistics
    saved = (engine.speculation.proposer, engine.speculation.synthetic_acceptance, engine.speculation.mode, engine.sample_steps, engine.speculation.stats)
    engine.speculation.stats = type(engine.speculation.stats)()
    if engine.spec is not None and engine.spec.method == "ngram":
        engine.speculation.proposer = RepeatProposer()
    engine.speculation.synthetic_acceptance = 0.0
    engine.sample_steps = True
    samples: list[StepSample] = []
    ks = profile_ks(engine, grid)
    points = _grid_points(engine, grid, ks)
    if not points:
        raise ValueError(f"no profile grid point fits this engine (max_model_len {engine.max_model_len}, "
                         f"max_num_seqs {engine.config.max_num_seqs}, {engine.kv.num_blocks} KV blocks) with drafts "
                         f"up to k = {max(ks)}: raise max_model_len or lower max_speculative_tokens")
    bar = tqdm(total=len(points) * len(ks), desc="profiling step time", unit="pt", disable=not progress)

    def step() -> None:
        engine.step()
        if engine.last_sample is not None:
            samples.append(engine.last_sample)

    try:
        for ctx, batch in points:
            ids = [engine.add_request([rng.randrange(vocab) for _ in range(n)],
                                      SamplingParams(temperature=0, max_tokens=engine.max_model_len - n - 1,
                                                     ignore_eos=True))
                   for n in prompt_lengths(ctx, batch)]
            # prompts in without drafts: under the last point's k, the decodes' drafts could take a small token
            # budget (max_num_batched_tokens) before a prompt still prefilling got any, and this loop never ended
            engine.set_speculation(0)
            while any(engine.requests[r].is_prefilling or engine.requests[r].num_computed_tokens == 0 for r in ids):
                step()
            # the ks in turn, `repeats` rounds, so a machine drifting over the point's seconds moves every k alike
            # rather than tilting the cost of k; a first round unrecorded: the first step at new row counts pays for
            # shapes torch and our kernels meet for the first time (what measuring k by k cost the controller:
            # docs/ARCHITECTURE.md, the profiler)
            recorded: list[tuple[int, StepSample]] = []
            for round_ in range(grid.repeats + 1):
                for k in ks:
                    engine.set_speculation(k)
                    engine.step()
                    if round_ and engine.last_sample is not None:
                        recorded.append((k, engine.last_sample))
            samples += drop_disturbed(recorded)
            bar.update(len(ks))
            for rid in ids:
                engine.abort_request(rid)
    finally:
        bar.close()
        for rid in list(engine.requests):
            engine.abort_request(rid)
        engine.speculation.proposer, engine.speculation.synthetic_acceptance, engine.speculation.mode, engine.sample_steps, engine.speculation.stats = saved
    return samples


def build_model(engine: LLMEngine, grid: ProfileGrid, progress: bool = True) -> StepTimeModel:
    key = profile_key(engine)
    model = StepTimeModel.fit(profile_engine(engine, grid, progress), key)
    model.save(profile_path(key))
    return model


def reaching_seats(engine: LLMEngine, grid: ProfileGrid) -> ProfileGrid:
    """The grid with the engine's largest decode batch (up to TOP_BATCH) among its batch sizes (those above it are
    left out when the grid's points are chosen: _grid_points)."""
    top = min(largest_decode_batch(engine), TOP_BATCH)
    return grid if top in grid.batch_sizes else replace(grid, batch_sizes=tuple(sorted({*grid.batch_sizes, top})))


def load_or_profile(engine: LLMEngine, progress: bool = True, grid: str = "brief") -> StepTimeModel:
    """The cached model for this engine, or a profile over `grid` reaching the engine's seats (saved for next
    time) when there is none, or when the cached one stops at fewer decoding requests than this engine can run
    (an engine with fewer seats then keeps using the larger profile)."""
    chosen = reaching_seats(engine, GRIDS[grid])
    model = StepTimeModel.load(profile_path(profile_key(engine)))
    if model is not None:
        reachable = max((b for _, b in _grid_points(engine, chosen, profile_ks(engine, chosen))), default=0)
        if model.max_profiled_batch >= reachable:
            return model
        # (a profile measured with `turbospec profile --batch-sizes` that stops short is replaced too: say so)
        log.warning("the cached step-time profile measured batches up to %d, and this engine can be measured up to "
                    "%d: measuring a %s profile (saved over it)", model.max_profiled_batch, reachable, grid)
    return build_model(engine, chosen, progress)
