"""Jobs above the engine that measure something once per machine and model and hand the engine the result: the
step-time model (profiler.py) for the goodput controller, the margin-gate threshold (margin_calibration.py) and
the layers a layer-skip draft skips (layer_search.py). Each is cached under $TURBOSPEC_HOME; `LLM`, the CLI and
the server build engines through `build_engine`, which loads what is cached and measures what is not."""

from __future__ import annotations

import dataclasses
import logging

from ..config import EngineConfig
from ..engine import LLMEngine
from ..models.loader import LoadedModel
from .layer_search import load_or_search
from .margin_calibration import MarginCalibration, calibration_path, load_or_calibrate
from .profiler import load_or_profile

log = logging.getLogger("turbospec.tuning")


def build_engine(config: EngineConfig, loaded: LoadedModel | None = None, progress: bool = True) -> LLMEngine:
    """An engine with every input its config needs: the layer-skip plan (searched when none is cached), the
    margin-gate threshold (a cached one whenever there is one, calibrated when the engine runs margin-gate), and
    the step-time model when speculation is "auto". Searches and calibrations that need the whole model run on a
    plain one-process engine first (a tensor-parallel engine holds only its shard); their results do not depend
    on the split, while the step-time profile measures the engine as built."""
    spec = config.speculative_config
    search_layers = spec is not None and spec.method == "layer-skip" and spec.skip_layers is None
    calibrate_first = (config.deterministic == "margin-gate" and config.margin_threshold is None
                       and config.tensor_parallel_size > 1)
    if search_layers or calibrate_first:
        plain = LLMEngine(dataclasses.replace(config, speculative_config=None, tensor_parallel_size=1), loaded,
                          progress)
        if search_layers:
            assert spec is not None
            plan = load_or_search(plain, progress)
            log.info("layer-skip draft skips layers %s (searched: acceptance %.2f, cost %.2f of a step)",
                     plan.skip, plan.agreement, plan.cost_fraction)
            config = dataclasses.replace(config, speculative_config=dataclasses.replace(spec, skip_layers=plan.skip))
        if calibrate_first:
            config = dataclasses.replace(config, margin_threshold=load_or_calibrate(plain, progress).threshold)
        if config.tensor_parallel_size == 1:
            loaded = plain.loaded  # the same weights: loaded once
        del plain  # (its KV cache goes before the engine's is allocated)
    engine = LLMEngine(config, loaded, progress)
    if not engine.exact.has_threshold():
        if config.deterministic == "margin-gate":
            ensure_margin_threshold(engine, progress)
        else:  # a request may still ask for margin-gate: offer it when this model was calibrated before
            engine.exact.threshold_lookup = lambda: _cached_threshold(engine)
    if engine.speculation.mode == "auto":
        ensure_controller(engine, progress)
    return engine


def _cached_threshold(engine: LLMEngine) -> float | None:
    cached = MarginCalibration.load(calibration_path(engine))
    return None if cached is None else cached.threshold


def ensure_controller(engine: LLMEngine, progress: bool = True) -> None:
    """Give the engine its goodput controller (from the cached step-time profile, or a brief one measured now),
    so that it can speculate in "auto" mode."""
    if engine.speculation.controller is None and engine.speculation.proposer is not None:
        engine.speculation.attach_step_time_model(load_or_profile(engine, progress))


def ensure_margin_threshold(engine: LLMEngine, progress: bool = True) -> None:
    """Give the engine a margin-gate threshold: the cached calibration for its model, or one measured now on a
    private engine over the same weights (saved for next time)."""
    if not engine.exact.has_threshold():
        engine.exact.set_threshold(load_or_calibrate(engine, progress).threshold)


def set_speculation(engine: LLMEngine, value: int | str, progress: bool = True) -> None:
    """engine.set_speculation, first giving the engine its controller when `value` is "auto"."""
    if value == "auto":
        ensure_controller(engine, progress)
    engine.set_speculation(value)
