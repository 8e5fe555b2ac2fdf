"""Step times for the simulator: the engine's own ``StepTimeModel`` (a profile measured by ``turbospec
profile``, loaded by path or by the engine's profile key), or one derived from a stated roofline, plus the
per-step overhead a profile does not see.

A roofline is written as a ``StepTimeModel`` on purpose: the goodput controller then reads it exactly as it
reads a measured profile (``spec_cost``), so a projection runs the engine's choice of k unchanged.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ..control.step_time import LinearPart, StepFeatures, StepSample, StepTimeModel


@dataclass(frozen=True)
class StepOverhead:
    """How a served step differs from the profile's prediction for it: seconds beyond ``engine.step()`` (the
    serving loop around it: commands, handing outputs to the event loop) and a speed factor on the whole
    prediction (the machine runs slower or faster than when it was profiled, e.g. other tenants on a shared
    CPU). Calibrated from a separate run (``benchmarks/simulator_validation.py``), never from the run it
    predicts."""

    per_step_s: float = 0.0
    per_request_s: float = 0.0  # per request in the step
    scale: float = 1.0  # served step time / profiled step time

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"the step-time scale must be > 0, got {self.scale}")

    def apply(self, predicted_s: float, f: StepFeatures) -> float:
        return max(0.0, self.scale * predicted_s + self.per_step_s + self.per_request_s * f.batch)


@dataclass
class StepCost:
    model: StepTimeModel
    overhead: StepOverhead = StepOverhead()
    source: str = ""  # where the model came from, for reports

    def seconds(self, f: StepFeatures) -> float:
        return self.overhead.apply(self.model.predict(f), f)


def mean_level(model: StepTimeModel, samples: list[StepSample]) -> float:
    """Measured over predicted total seconds of `samples`: the factor that makes `model` right on average.

    The step-time model minimises relative error (the controller compares ratios), which under right-skewed
    noise (a shared machine's slow steps) sits below the mean: on the validation runs' own steps the fit summed
    to 4-9% less than the steps took. A latency is a sum of step times, so the simulator needs the mean; this
    factor, used as ``StepOverhead.scale``, restores it without changing the fitted shape."""
    if not samples:
        return 1.0
    predicted = sum(model.predict(s.features) for s in samples)
    measured = sum(s.total_s for s in samples)
    return measured / predicted if predicted > 0 and measured > 0 else 1.0


def load_profile(path: str | Path) -> StepTimeModel:
    model = StepTimeModel.load(Path(path))
    if model is None or not model.parts:
        raise ValueError(f"{path} is not a step-time profile (a JSON file written by `turbospec profile`)")
    return model


def profile_for_key(key: dict[str, str]) -> Path:
    """The cache file the engine would use for this profile key (tuning/profiler.py's naming)."""
    from ..tuning.profiler import profile_path  # imports torch: only when a key is given

    if not isinstance(key, dict) or "model" not in key or "dtype" not in key or "threads" not in key:
        raise ValueError("a profile key is a JSON object with at least model, dtype and threads "
                         "(as stored under \"key\" in a profile file)")
    return profile_path({str(k): str(v) for k, v in key.items()})


def find_profiles(profile_dir: Path, model: str) -> list[Path]:
    """Cached profiles whose key names `model`, newest first."""
    found = []
    for path in profile_dir.glob("*.json"):
        try:
            key = json.loads(path.read_text()).get("key", {})
        except (OSError, ValueError):
            continue
        if key.get("model") == model:
            found.append(path)
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


# --- rooflines ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """What a dense decoder's step reads and computes. bytes_per_param / bytes_per_kv: 2 for bf16."""

    name: str
    params: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    bytes_per_param: float = 2.0
    bytes_per_kv: float = 2.0

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_kv  # K and V


@dataclass(frozen=True)
class Accelerator:
    name: str
    hbm_bytes_per_s: float
    dense_flops: float  # peak dense bf16 FLOP/s


@dataclass(frozen=True)
class RooflineAssumptions:
    """The stated factors that turn peaks into step times. Not measured: see the projection's report."""

    bandwidth_efficiency: float = 0.75  # share of peak HBM bandwidth a decode step's reads achieve
    compute_efficiency: float = 0.5  # share of peak FLOP/s the batched matmuls achieve
    step_overhead_s: float = 0.002  # scheduler, sampling, launches per step (CUDA graphs assumed)
    per_request_s: float = 10e-6  # bookkeeping per request in the step


LLAMA3_8B = ModelShape("Llama-3-8B", 8.03e9, 32, 4096, 8, 128)
QWEN25_CODER_15B = ModelShape("qwen2.5-coder-1.5b", 1.54e9, 28, 1536, 2, 128)
H200 = Accelerator("H200", 4.8e12, 989e12)
SHAPES = {s.name: s for s in (LLAMA3_8B, QWEN25_CODER_15B)}


def roofline_model(shape: ModelShape, gpu: Accelerator, a: RooflineAssumptions = RooflineAssumptions()
                   ) -> StepTimeModel:
    """A step-time model from the roofline:

    linear layers: max(weight bytes / bandwidth, 2 x params x tokens / FLOP/s), i.e. flat while the weights'
    reads dominate and linear in tokens past the knee: exactly the profile's 'hinge' form;
    KV reads: each request reads its whole context once: kv x KV bytes per token / bandwidth (added);
    attention math: 4 x layers x hidden FLOPs per (query token x context token) (added).
    Efficiencies scale each peak; the overhead part is the stated constant per step plus per request."""
    bw = gpu.hbm_bytes_per_s * a.bandwidth_efficiency
    flops = gpu.dense_flops * a.compute_efficiency
    weights_s = shape.params * shape.bytes_per_param / bw
    per_token_s = 2 * shape.params / flops
    knee = max(1, round(weights_s / per_token_s))  # tokens where the matmuls become compute bound
    attention_s = 4 * shape.layers * shape.hidden / flops  # per (query token x context token)
    target = LinearPart(("one", f"hinge{knee}", "kv", "attn"),
                        (weights_s, per_token_s, shape.kv_bytes_per_token / bw, attention_s))
    overhead = LinearPart(("one", "batch"), (a.step_overhead_s, a.per_request_s))
    key = {"model": shape.name, "hardware": gpu.name, "source": "roofline estimate, not measured",
           "assumptions": json.dumps(asdict(a))}
    return StepTimeModel({"target": target, "draft": LinearPart(), "overhead": overhead}, key=key)
