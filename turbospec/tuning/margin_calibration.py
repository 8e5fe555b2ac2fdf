"""Calibrate margin-gate's threshold (``turbospec calibrate-margin``), cached per model like the step-time profile.

A fast-path token can only differ from the exact path's token if some competitor's score gap to it moves by
more than the token's margin. The calibration measures how far the gaps move: it decodes held-out prompts on
the fast path in batches of mixed sizes (recording each step's top scores), then recomputes every one of those
positions on the exact path (one invariant pass over the prompt and the fast output: exact KV, the same
tokens) and records per token the fast margin, the gap drift (the largest change of the gap between the top
token and its COMPETITORS nearest rivals) and whether the exact path picks another token. The threshold is
``safety`` times the largest drift seen, so every flip seen had a margin below it.

The prompts are ShareGPT conversations from ``CALIBRATION_SKIP`` onwards: the benchmarks and tests use the
first few hundred, so calibration and evaluation never share a prompt.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from ..config import EngineConfig
from ..determinism.exact import gap_drift
from ..engine import LLMEngine
from ..host import write_text_atomically
from ..sampling_params import SamplingParams
from .profiler import profile_key, profile_path

CALIBRATION_SKIP = 5000
BATCH_SIZES = (1, 3, 8, 16)


@dataclass
class MarginCalibration:
    threshold: float  # nats: margin-gate re-checks tokens whose margin is below this
    safety: float
    max_drift: float  # the largest drift bound seen
    p99_drift: float
    tokens: int  # tokens re-checked during calibration
    flips: int
    max_flip_margin: float  # the largest fast margin of a token that flipped (0 if none did)
    prompts: int
    max_tokens: int
    source: str
    key: dict[str, str]

    def save(self, path: Path) -> None:
        write_text_atomically(path, json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> MarginCalibration | None:
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None


def calibration_key(engine: LLMEngine) -> dict[str, str]:
    key = profile_key(engine)
    key.pop("speculation", None)  # margins do not depend on the proposer
    key.pop("k_limit", None)  # nor on its draft cap
    key.pop("profiler", None)  # nor on the step-time profiler's version
    if "weights" in key:  # the fast path's kernels set the drift: by format, not by the measured crossovers
        key["weights"] = key["weights"].split(":", 1)[0]
    # calibrated on one process (a split engine cannot run the private calibration engine): the all-reduce's
    # extra rounding under tensor parallelism is not in the measured drift
    key.pop("tensor_parallel", None)
    key["deterministic"] = "margin-gate"
    return key


def calibration_path(engine: LLMEngine) -> Path:
    path = profile_path(calibration_key(engine))
    return path.parent.parent / "margin" / path.name


def calibration_prompts(n: int) -> tuple[list[str], str]:
    from ..data.prompts import load_sharegpt

    try:
        prompts = [p.text for p in load_sharegpt(n, max_chars=600, skip=CALIBRATION_SKIP)]
        return prompts, f"sharegpt[{CALIBRATION_SKIP}:]"
    except RuntimeError:  # the data set package is missing: fixed held-out sentences still calibrate something
        return [f"Explain, step by step, topic number {i} of a beginner's course in physics." for i in range(n)], \
            "built-in"


def calibrate(engine: LLMEngine, num_prompts: int = 16, max_tokens: int = 64, safety: float = 2.0,
              progress: bool = True, seed: int = 0) -> MarginCalibration:
    """Measure drift on a private engine that shares `engine`'s weights, and return (not save) the result."""
    from ..runner import SeqInput

    c = engine.config
    config = EngineConfig(c.model, dtype=c.dtype, num_threads=c.num_threads, device=c.device, seed=c.seed,
                          max_model_len=min(engine.max_model_len, 2048), max_num_seqs=max(BATCH_SIZES),
                          kv_cache_memory_gib=0.5, enable_prefix_caching=False)
    private = LLMEngine(config, loaded=engine.loaded, progress=False)
    private.verifier.logit_trace = {}
    texts, source = calibration_prompts(num_prompts)
    tok = private.tokenizer
    ids = [tok.apply_chat_template([{"role": "user", "content": t}]) if getattr(tok, "has_chat_template", False)
           else tok.encode(t) for t in texts]
    ids = [p[-(config.max_model_len - max_tokens - 1):] for p in ids]
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    order = list(range(len(ids)))
    log: list[tuple[float, float, bool]] = []  # (fast margin, gap drift, flipped) per token
    bar = tqdm(total=len(ids), desc="calibrating margin-gate", unit="prompt", disable=not progress)
    while order:
        size = min(rng.choice(BATCH_SIZES), len(order))
        batch, order = order[:size], order[size:]
        finished = {}
        for i in batch:
            private.add_request(ids[i], params, request_id=f"calibrate-{i}")
        while private.has_unfinished_requests():
            finished.update({o.request_id: o for o in private.step() if o.finished})
        for rid, out in finished.items():
            tokens = out.prompt_token_ids + out.outputs[0].token_ids
            n = len(out.outputs[0].token_ids)
            private.blocks.allocate("exact", tokens, len(tokens) - 1)
            exact = private.runner.run([SeqInput("exact", tokens[:-1], 0, n, invariant=True)]).logits
            private.blocks.free("exact")
            for (top_ids, top_scores), row in zip(private.verifier.logit_trace.pop(rid), exact):
                log.append(((top_scores[0] - top_scores[1]).item(), gap_drift(top_ids, top_scores, row),
                            int(row.argmax()) != int(top_ids[0])))
        bar.update(len(batch))
    bar.close()
    drifts = sorted(d for _, d, _ in log) or [0.0]
    flips = [m for m, _, flipped in log if flipped]
    return MarginCalibration(
        threshold=safety * drifts[-1], safety=safety, max_drift=drifts[-1],
        p99_drift=drifts[min(len(drifts) - 1, int(0.99 * len(drifts)))], tokens=len(log), flips=len(flips),
        max_flip_margin=max(flips, default=0.0), prompts=len(ids), max_tokens=max_tokens, source=source,
        key=calibration_key(engine))


def load_or_calibrate(engine: LLMEngine, progress: bool = True) -> MarginCalibration:
    """The cached calibration for this engine's model, or a brief one (saved for next time)."""
    path = calibration_path(engine)
    cached = MarginCalibration.load(path)
    if cached is not None:
        return cached
    result = calibrate(engine, num_prompts=12, max_tokens=48, progress=progress)
    result.save(path)
    return result
