"""Which layers the layer-skip draft skips (``turbospec search-layers``), searched once and cached per model.

Self-SpecDec searches the skipped set by Bayesian optimisation over measured speed. We search greedily over a
cheaper score that predicts it:
1. The target answers held-out prompts greedily (ShareGPT from CALIBRATION_SKIP on, as margin-gate's
   calibration; built-in sentences when the data set package is absent).
2. A skipped set S is scored by the share of answer positions where the target without S predicts the
   target's own next token, each position seeing the full model's K/V for everything before it, as the live
   draft's first token does (`_Scorer`): an estimate of the draft's per-token acceptance a.
3. Each layer alone is scored first; then layers are added one at a time, each round trying the
   ``candidates_per_round`` least harmful layers not yet skipped and keeping the best.
4. Every set met is valued by the expected speedup of greedy speculation with its best k,
   ``(1 - a^(k+1)) / ((1 - a) (1 + k c))`` where c is the draft step's cost relative to a target step, from
   timing decode steps through all layers and through half of them (a fixed part plus a cost per layer); on
   this CPU verifying k + 1 tokens costs about one step. The set with the highest value wins.

Later draft tokens also read the draft's own K/V for the drafts before them, so a is optimistic for them; it
ranks sets, and the benchmark measures the real rate.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..attention import AttentionMetadata, AttnGroup
from ..config import EngineConfig
from ..engine import LLMEngine
from ..host import write_text_atomically
from ..kv.block_manager import BlockManager
from ..kv.kv_cache import KVCache
from ..proposers.layer_skip import SkippingModel, kept_layers
from ..runner import ModelRunner, SeqInput
from ..sampling_params import SamplingParams
from .margin_calibration import calibration_prompts
from .profiler import profile_key, profile_path

log = logging.getLogger(__name__)


@dataclass
class LayerSkipPlan:
    skip: list[int]
    agreement: float  # teacher-forced share of answer tokens the draft predicts (its acceptance proxy)
    cost_fraction: float  # a draft step relative to a target step (timed)
    best_k: int
    expected_speedup: float
    num_layers: int
    tokens: int  # answer positions scored
    prompts: int
    source: str
    seconds: float
    key: dict[str, str]
    trials: list[dict[str, object]] = field(default_factory=list)  # every set scored: skip, agreement, speedup

    def save(self, path: Path) -> None:
        write_text_atomically(path, json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> LayerSkipPlan | None:
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None


def plan_key(engine: LLMEngine) -> dict[str, str]:
    key = profile_key(engine)
    key.pop("speculation", None)
    key.pop("k_limit", None)  # the draft cap the controller may use: the same plan
    key.pop("profiler", None)  # the step-time profiler's version: the search has its own ("search" below)
    key.pop("threads", None)  # the search reads acceptance, not time
    key.pop("weights", None)  # packed or dense, the same model up to rounding: the same plan
    key.pop("tensor_parallel", None)  # searched on one process; the split model computes the same one
    key["search"] = "layer-skip-v1"
    return key


def plan_path(engine: LLMEngine) -> Path:
    path = profile_path({**plan_key(engine), "threads": "any"})
    return path.parent.parent / "layer_skip" / path.name


def expected_speedup(agreement: float, cost_fraction: float, k_max: int = 8) -> tuple[float, int]:
    """Best (speedup, k >= 1) of greedy speculation with per-token acceptance `agreement` and draft cost c; below
    1 when drafting does not pay at all (the set is still ranked; the controller then picks k = 0)."""
    a = min(max(agreement, 0.0), 0.999)
    best = (0.0, 1)
    for k in range(1, k_max + 1):
        gain = (1 - a ** (k + 1)) / (1 - a) / (1 + k * cost_fraction)
        best = max(best, (gain, k))
    return best


class _Scorer:
    """Agreement of the target without a layer set with the target's own greedy tokens, as the live draft's
    first token sees it: every earlier position holds the full model's K/V (one full forward), and each
    position's own K/V is the draft's. The draft's K/V go to a second copy of the sequence's slots and a mask
    lets query j see full slots 0..j-1 and its own copy only, so one forward scores every answer position at
    once (only those run: the prompt's positions predict nothing scored)."""

    def __init__(self, engine: LLMEngine, sequences: list[tuple[list[int], int]]) -> None:
        self.model = engine.loaded.model
        self.device = torch.device(engine.config.device)
        self.sequences = sequences  # (prompt + answer ids, prompt length)
        bs = engine.config.block_size
        blocks = sum(-(-2 * len(s) // bs) for s, _ in sequences) + 1
        self.kv = KVCache.allocate(engine.model_config, blocks, bs, engine.dtype, engine.config.device)
        self.blocks = BlockManager(blocks, bs, enable_prefix_caching=False)
        runner = ModelRunner(self.model, self.kv, self.blocks, engine.config.device)
        self.slots: list[torch.Tensor] = []
        for i, (ids, _) in enumerate(sequences):
            self.blocks.allocate(f"s{i}", ids + ids, 2 * len(ids))
            runner.run([SeqInput(f"s{i}", ids, 0, 0)])  # the full model's K/V in the first copy
            self.slots.append(runner.slot_table(f"s{i}", 2 * len(ids)))
        self.tokens = sum(len(ids) - p for ids, p in sequences)

    @torch.inference_mode()
    def agreement(self, skip: list[int]) -> float:
        kept = kept_layers(len(self.model.layers), skip)
        hits = 0
        for (ids, plen), slots in zip(self.sequences, self.slots):
            # only the positions whose next token is an answer token run the draft: the prompt's positions are
            # never scored, and each query reads the full model's K/V before it, not the draft's
            n = len(ids) - 1  # positions 0..n-1 predict tokens 1..n
            pos = torch.arange(plen - 1, n)
            m = len(pos)
            mask = torch.zeros(m, 2 * len(ids), dtype=torch.bool)
            mask[:, :n] = pos[:, None] > torch.arange(n)[None, :]
            mask[torch.arange(m), len(ids) + pos] = True
            group = AttnGroup(torch.arange(m)[None], torch.ones(1, m, dtype=torch.bool), slots[None],
                              mask[None, None], pos[None], token_range=(0, m))
            meta = AttentionMetadata(slots[len(ids) + pos], [group], m)
            meta = meta.to(self.device) if self.device.type != "cpu" else meta
            hidden = self.model(torch.tensor(ids[plen - 1:n], device=self.device), pos.to(self.device), meta,
                                self.kv.layers, layer_ids=kept)
            logits = self.model.compute_logits(hidden)
            hits += int((logits.argmax(-1).cpu() == torch.tensor(ids[plen:])).sum())
        return hits / self.tokens

    @torch.inference_mode()
    def step_seconds(self, kept: list[int], repeats: int = 9) -> float:
        """Median time of a one-token decode step through `kept` (the last position of the first sequence: a
        key no score reads)."""
        ids = self.sequences[0][0]
        runner = ModelRunner(SkippingModel(self.model, kept), self.kv, self.blocks, self.device)  # type: ignore[arg-type]
        item = [SeqInput("s0", [ids[-1]], len(ids) - 1, 1)]
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            runner.run(item)
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])


def measured_cost(scorer: _Scorer, num_layers: int) -> tuple[float, float]:
    """(fixed, per layer) seconds of a decode step, from timing all layers and the first half: on a small model
    the fixed part (LM head, sampling rows, Python) is large, so skipping layers saves less than their share."""
    full = scorer.step_seconds(list(range(num_layers)))
    half = scorer.step_seconds(list(range(num_layers // 2)))
    per_layer = max(full - half, 0.0) / (num_layers - num_layers // 2)
    return max(full - num_layers * per_layer, 0.0), per_layer


def answered_prompts(engine: LLMEngine, num_prompts: int, max_tokens: int) -> tuple[list[tuple[list[int], int]], str]:
    """The target's own greedy answers to held-out prompts, on a private engine sharing its weights."""

    c = engine.config
    config = EngineConfig(c.model, dtype=c.dtype, num_threads=c.num_threads, device=c.device, seed=c.seed,
                          max_model_len=min(engine.max_model_len, 1024), max_num_seqs=num_prompts,
                          kv_cache_memory_gib=0.5, enable_prefix_caching=False)
    private = LLMEngine(config, loaded=engine.loaded, progress=False)
    texts, source = calibration_prompts(num_prompts)
    tok = private.tokenizer
    ids = [tok.apply_chat_template([{"role": "user", "content": t}]) if getattr(tok, "has_chat_template", False)
           else tok.encode(t) for t in texts]
    ids = [p[-(config.max_model_len - max_tokens - 1):] for p in ids]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(ids):
        private.add_request(p, params, request_id=f"search-{i}")
    done = {}
    while private.has_unfinished_requests():
        done.update({o.request_id: o for o in private.step() if o.finished})
    outs = [done[f"search-{i}"] for i in range(len(ids))]
    return [(o.prompt_token_ids + o.outputs[0].token_ids, len(o.prompt_token_ids)) for o in outs], source


def search_skip_layers(engine: LLMEngine, num_prompts: int = 8, max_tokens: int = 48, max_skip_fraction: float = 0.5,
                       candidates_per_round: int = 3, progress: bool = True) -> LayerSkipPlan:
    """Search the skipped set for `engine`'s model (see the module docstring); returns it, does not save it."""
    if not 0 < max_skip_fraction < 1:
        raise ValueError(f"max_skip_fraction must be in (0, 1), got {max_skip_fraction}")
    start = time.perf_counter()
    sequences, source = answered_prompts(engine, num_prompts, max_tokens)
    scorer = _Scorer(engine, sequences)
    n = len(engine.loaded.model.layers)
    inner = list(range(1, n - 1))  # the first and last layers are never skipped (every study finds them vital)
    max_skip = max(1, int(n * max_skip_fraction))
    trials: list[dict[str, object]] = []

    fixed, per_layer = measured_cost(scorer, n)

    def score(skip: list[int]) -> float:
        a = scorer.agreement(skip)
        c = (fixed + (n - len(skip)) * per_layer) / (fixed + n * per_layer)
        gain, k = expected_speedup(a, c)
        trials.append({"skip": sorted(skip), "agreement": round(a, 4), "cost_fraction": round(c, 4),
                       "expected_speedup": round(gain, 4), "k": k})
        return a

    bar = tqdm(total=len(inner) + max_skip * candidates_per_round, desc="searching layers to skip", unit="trial",
               disable=not progress)
    alone = {}
    for layer in inner:
        alone[layer] = score([layer])
        bar.update(1)
    skip: list[int] = []
    while len(skip) < max_skip:
        left = sorted((layer for layer in inner if layer not in skip), key=lambda i: -alone[i])[:candidates_per_round]
        if not left:
            break
        scored = [(score(skip + [layer]), layer) for layer in left]
        bar.update(len(left))
        skip.append(max(scored)[1])
    bar.close()
    best = max(trials, key=lambda t: t["expected_speedup"])  # type: ignore[arg-type,return-value]
    return LayerSkipPlan(
        skip=list(best["skip"]), agreement=float(best["agreement"]),  # type: ignore[call-overload,arg-type]
        cost_fraction=float(best["cost_fraction"]), best_k=int(best["k"]),  # type: ignore[call-overload,arg-type]
        expected_speedup=float(best["expected_speedup"]), num_layers=n,  # type: ignore[arg-type]
        tokens=scorer.tokens, prompts=len(sequences), source=source, seconds=time.perf_counter() - start,
        key=plan_key(engine), trials=trials)


def load_or_search(engine: LLMEngine, progress: bool = True) -> LayerSkipPlan:
    """The cached plan for this engine's model, or a search (saved for next time)."""
    path = plan_path(engine)
    cached = LayerSkipPlan.load(path)
    if cached is not None and cached.num_layers == len(engine.loaded.model.layers):
        return cached
    # an engine loaded with progress=False shows no bar, and INFO is not shown by default: say why its start
    # takes minutes (12 for a 1.5B on 2 AVX2 cores)
    log.warning("no layer-skip plan cached for %s: searching the layers to skip once (cached at %s)",
                engine.config.model, path)
    plan = search_skip_layers(engine, progress=progress)
    plan.save(path)
    log.info("layer-skip search done in %.0f s (%d trials)", plan.seconds, len(plan.trials))
    return plan
