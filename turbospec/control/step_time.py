"""The step-time model: predicted seconds for one engine step from what the step contains.

A step has three parts, each a least-squares fit on its own features:
- target: the target model's forward over every batched token (prefill chunks, decodes, drafts);
- draft: the draft model's k autoregressive steps, or the draft heads' tree per request (zero for n-gram,
  whose proposals are nearly free);
- overhead: scheduling, sampling, verification and bookkeeping.

For each part several feature sets are tried. The one with the lowest held-out relative error (5-fold)
wins. On this CPU a kinked form ("hinge": flat while weight-bandwidth bound, then linear in tokens) often
beats a single line, which is why the knot is part of the search. Fits minimise relative error: step times
span two orders of magnitude, and the controller compares ratios. They are monotone: no coefficient of work, and no
slope after a knot, may be negative (monotone_fit.py), since a noisy profile otherwise draws dips the controller
then exploits.

The profile's samples are kept. Online, every measured step is added to a bounded window and every
`refit_every` steps each part is rescaled to it (its level, not its shape: `rescale`), so the model follows
drift (thermal, other tenants). This improves accuracy only; any model, however stale, gives correct outputs.
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..attention_groups import gathered_slots
from ..host import write_text_atomically
from .monotone_fit import monotone_lstsq

PARTS = ("target", "draft", "overhead")


@dataclass
class StepFeatures:
    """What one step computes. Built by the engine from the scheduler's output and the drafts."""

    batch: int = 0  # requests in the target forward
    tokens: int = 0  # batched target tokens: prefill chunks + decodes + draft tokens verified
    kv: int = 0  # sum of context lengths after the step
    attn: int = 0  # sum over requests of query tokens x context length (attention work)
    spec_tokens: int = 0  # sum of k_i
    draft_steps: int = 0  # max k_i: autoregressive draft forwards
    draft_tokens: int = 0  # tokens the draft model processes (catch-up + k_i - 1 per drafting request)
    draft_kv: int = 0  # sum over drafting requests of k_i x context length
    # requests a draft network ran for: draft heads (Medusa, Hydra, EAGLE) grow one candidate tree per request,
    # and k only picks how many of its nodes are verified
    drafting_requests: int = 0
    # levels those trees grew: one batched draft pass each, min(the drafter's depth, max k_i). qwen2.5-coder-1.5b's
    # EAGLE draft (depth 4): 2.3, 4.3, 7.8 and 7.1 ms for k = 1, 2, 4 and 8 (benchmarks/results/eagle_draft_cost/eagle_draft_cost.md)
    draft_levels: int = 0
    # cache slots attention reads, padding included: requests padded to the longest context of their attention
    # group (attention_groups.py). Computed from the requests added when first read (gathered_slots())
    gathered: int = 0

    def __post_init__(self) -> None:
        self._lens: tuple[list[int], list[int]] = ([], [])  # (query, context) per request added, not serialised
        self._gathered_stale = False

    def add(self, start: int, num_new: int, k: int = 0) -> None:
        """Count one request's share of the step: num_new known tokens from position `start`, then k drafts
        verified after them (the draft model's tokens, draft_tokens, are the caller's to count)."""
        q = num_new + k
        ctx = start + q
        self._lens[0].append(q)
        self._lens[1].append(ctx)
        self._gathered_stale = True
        self.batch += 1
        self.tokens += q
        self.kv += ctx
        self.attn += q * ctx
        if k:
            self.spec_tokens += k
            self.draft_steps = max(self.draft_steps, k)
            self.draft_kv += k * ctx

    def gathered_slots(self) -> int:
        """`gathered`, planned once after the last add (a sort of the step's requests)."""
        if self._gathered_stale:
            self.gathered = gathered_slots(*self._lens)
            self._gathered_stale = False
        return self.gathered


@dataclass
class StepSample:
    features: StepFeatures
    target_s: float
    draft_s: float
    overhead_s: float

    @property
    def total_s(self) -> float:
        return self.target_s + self.draft_s + self.overhead_s

    def part(self, name: str) -> float:
        return {"target": self.target_s, "draft": self.draft_s, "overhead": self.overhead_s}[name]


def _feature(f: StepFeatures, name: str) -> float:
    """Named columns; 'hinge<N>' is max(0, tokens - N), 'jump<N>' 1 if tokens > N, 'one' the intercept, 'drafting'
    1 if any draft."""
    if name == "one":
        return 1.0
    if name == "drafting":
        return 1.0 if f.draft_steps > 0 else 0.0
    if name.startswith("hinge"):
        return float(max(0, f.tokens - int(name[5:])))
    if name.startswith("jump"):
        return 1.0 if f.tokens > int(name[4:]) else 0.0
    if name == "gathered":
        return float(f.gathered_slots())
    return float(getattr(f, name))


HINGE_KNOTS = (4, 8, 16, 32, 64, 128)
# Packed weights (models/weight_format.py) make a second kink: time grows with rows while linears run their
# packed kernels, flattens where they switch to dense at their crossover (a few rows), and grows again
# once the dense kernels fill. Two hinges, the first at a small knot, describe that shape.
PACKED_KNOTS = (2, 3, 4, 5, 6, 8)
_TARGET_FORMS: list[tuple[str, ...]] = [
    ("one", "tokens", "kv"),
    ("one", "batch", "tokens", "kv"),
    ("one", "batch", "tokens", "kv", "attn"),
    *[("one", "tokens", f"hinge{k}", "kv") for k in HINGE_KNOTS],
    *[("one", "tokens", f"hinge{k}", "kv", "attn") for k in HINGE_KNOTS],
    *[("one", "tokens", f"hinge{a}", f"hinge{b}", "kv") for a in PACKED_KNOTS for b in (16, 32, 64)],
    # the switch itself can be a step up: a smollm2 single decode took 45 ms at 4 tokens (int4) and 74 ms at 5
    # (dense) on a Xeon, 1 thread (benchmarks/results/simulator_validation/simulator_validation_profile.json), a jump no hinge fits
    *[("one", "tokens", f"jump{a}", f"hinge{a}", f"hinge{b}", "kv") for a in PACKED_KNOTS for b in (16, 32, 64)],
]
CANDIDATES: dict[str, list[tuple[str, ...]]] = {
    # each form with the context read as the sum of contexts (kv), or as the padded slots attention really reads
    # (gathered: equal when a step's contexts are alike, far apart when one long request pads short ones)
    "target": [("one", "tokens"), *_TARGET_FORMS,
               *[tuple("gathered" if c == "kv" else c for c in form) for form in _TARGET_FORMS]],
    "draft": [
        ("draft_steps", "draft_tokens"),
        ("draft_steps", "draft_tokens", "draft_kv"),
        ("drafting", "draft_steps", "draft_tokens", "draft_kv"),
        ("drafting_requests",),  # draft heads: a tree per request
        ("drafting", "drafting_requests"),
        ("draft_levels", "drafting_requests"),  # ... grown level by level, as deep as the largest k needs
        ("drafting", "draft_levels", "drafting_requests"),
    ],
    "overhead": [
        ("one", "batch"),
        ("one", "batch", "spec_tokens"),
        ("one", "batch", "spec_tokens", "tokens"),
    ],
}


@dataclass
class LinearPart:
    """time = sum(coef * feature), never below zero."""

    columns: tuple[str, ...] = ()
    coef: tuple[float, ...] = ()

    def predict(self, f: StepFeatures) -> float:
        return max(0.0, sum(c * _feature(f, n) for n, c in zip(self.columns, self.coef)))


def _design(samples: list[StepFeatures], columns: tuple[str, ...]) -> np.ndarray:
    return np.array([[_feature(s, c) for c in columns] for s in samples], dtype=np.float64)


def _fit(x: np.ndarray, y: np.ndarray, columns: tuple[str, ...], weight: np.ndarray | None = None) -> np.ndarray:
    """Least squares in relative error (each row weighted by 1 / y, floored so near-zero times do not dominate),
    with the time non-decreasing in every column of work (monotone_fit.py)."""
    w = 1.0 / np.maximum(y, max(float(np.median(y)) * 0.05, 1e-5))
    if weight is not None:
        w = w * weight
    return monotone_lstsq(x * w[:, None], y * w, columns)


def _relative_error(pred: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.abs(np.maximum(pred, 0.0) - y) / np.maximum(y, 1e-6)))


def _r2(pred: np.ndarray, y: np.ndarray) -> float:
    ss = float(np.sum((y - y.mean()) ** 2))
    return 1.0 - float(np.sum((y - pred) ** 2)) / ss if ss > 0 else 1.0


@dataclass
class FitReport:
    part: str
    columns: tuple[str, ...]
    heldout_mre: float  # mean relative error on held-out folds
    r2: float  # in-sample
    num_samples: int

    def line(self) -> str:
        return (f"{self.part:8s} {' + '.join(self.columns):42s} held-out MRE {self.heldout_mre * 100:5.1f}%  "
                f"R^2 {self.r2:.3f}  ({self.num_samples} steps)")


def select_form(samples: list[StepSample], part: str, folds: int = 5, seed: int = 0) -> tuple[LinearPart, FitReport]:
    """Fit every candidate feature set for `part`, keep the one with the lowest held-out relative error."""
    feats = [s.features for s in samples]
    y = np.array([s.part(part) for s in samples], dtype=np.float64)
    if part == "draft" and not np.any(y > 0):
        return LinearPart(), FitReport(part, (), 0.0, 1.0, len(samples))
    order = np.random.default_rng(seed).permutation(len(samples))
    fold_of = np.empty(len(samples), dtype=np.int64)
    fold_of[order] = np.arange(len(samples)) % folds
    best: tuple[float, tuple[str, ...]] | None = None
    for columns in CANDIDATES[part]:
        x = _design(feats, columns)
        if np.linalg.matrix_rank(x) < len(columns):
            continue  # a column the profile never varied: its coefficient would be arbitrary
        errors = []
        for k in range(folds):
            train, test = fold_of != k, fold_of == k
            if test.any() and train.sum() > len(columns):
                errors.append(_relative_error(x[test] @ _fit(x[train], y[train], columns), y[test]))
        err = float(np.mean(errors)) if errors else math.inf
        if best is None or err < best[0] - 1e-9:
            best = (err, columns)
    if best is None:  # too few samples for any form: a constant
        mean = float(y.mean()) if len(y) else 0.0
        return LinearPart(("one",), (mean,)), FitReport(part, ("one",), math.inf, 0.0, len(samples))
    columns = best[1]
    x = _design(feats, columns)
    coef = _fit(x, y, columns)
    return LinearPart(columns, tuple(float(c) for c in coef)), FitReport(part, columns, best[0], _r2(x @ coef, y),
                                                                         len(samples))


@dataclass
class StepTimeModel:
    parts: dict[str, LinearPart] = field(default_factory=dict)
    reports: list[FitReport] = field(default_factory=list)
    samples: list[StepSample] = field(default_factory=list)  # the profile's
    key: dict[str, str] = field(default_factory=dict)  # model, dtype, threads, hardware the profile was made on
    refit_every: int = 32
    window: int = 256

    def __post_init__(self) -> None:
        self._online: deque[StepSample] = deque(maxlen=self.window)
        self._since_refit = 0
        self._fitted = dict(self.parts)  # the shape online learning rescales (refit() replaces it)

    @classmethod
    def fit(cls, samples: list[StepSample], key: dict[str, str] | None = None) -> StepTimeModel:
        parts, reports = {}, []
        for name in PARTS:
            parts[name], report = select_form(samples, name)
            reports.append(report)
        return cls(parts, reports, list(samples), dict(key or {}))

    @property
    def max_profiled_batch(self) -> int:
        """The largest decode batch the profile measured: beyond it, predictions are extrapolations."""
        decodes = [s.features for s in self.samples if s.features.tokens == s.features.batch + s.features.spec_tokens]
        return max((f.batch for f in decodes), default=0)

    def predict(self, f: StepFeatures) -> float:
        return sum(self.parts[p].predict(f) for p in PARTS if p in self.parts)

    def predict_part(self, part: str, f: StepFeatures) -> float:
        return self.parts[part].predict(f) if part in self.parts else 0.0

    def per_drafting_request_s(self) -> float:
        """Seconds each request adds by drafting at all (its `drafting_requests` coefficients). spec_cost leaves
        them out, as it sees only the drafts' sums: the controller adds them per request (activation)."""
        return max(0.0, sum(c for part in self.parts.values() for n, c in zip(part.columns, part.coef)
                            if n == "drafting_requests"))

    def spec_cost(self, base: StepFeatures, tree_levels: int = 0) -> Callable[[int, int, int], float]:
        """Predicted step time as a function of the speculative part only, with everything else fixed at `base`.

        Each draft token adds one verified token and one draft token and attends to its request's context; the
        longest draft sets the number of draft forwards, and a tree drafter's levels (at most `tree_levels`,
        its depth). Evaluated hundreds of times per step, so the features are resolved once here into
        a few coefficients of (sum k, sum k x context, max k) and the kinks.
        """
        # cost = const + per_k sum_k + per_kctx sum_kctx + per_draft_step max_k, plus the tree levels, the
        # any-draft switch and the kinks (knots in the batch's tokens)
        const = per_k = per_kctx = per_draft_step = per_level = per_drafting = 0.0
        kinks: list[tuple[float, float, bool]] = []  # (coef, base tokens past the knot, a jump rather than a hinge)
        for part in self.parts.values():
            for name, coef in zip(part.columns, part.coef):
                if name == "one":
                    const += coef
                elif name == "batch":
                    const += coef * base.batch
                elif name in ("tokens", "kv", "spec_tokens", "draft_tokens"):
                    const += coef * getattr(base, name)
                    per_k += coef
                elif name == "gathered":  # drafts lengthen contexts by a few slots: taken as the base's
                    const += coef * base.gathered_slots()
                elif name in ("attn", "draft_kv"):
                    const += coef * getattr(base, name)
                    per_kctx += coef
                elif name == "draft_steps":
                    const += coef * base.draft_steps
                    per_draft_step += coef
                elif name == "draft_levels":
                    per_level += coef
                elif name == "drafting":
                    per_drafting += coef
                elif name.startswith("hinge"):
                    kinks.append((coef, float(base.tokens - int(name[5:])), False))
                elif name.startswith("jump"):
                    kinks.append((coef, float(base.tokens - int(name[4:])), True))
                # drafting_requests: per drafting request, the controller's activation cost (not here)

        # Python operators only, so that it prices an int or an array of allocations alike (choose_lengths prices
        # many at once); a comparison times a price adds that price where the comparison holds and 0.0 elsewhere
        def cost(sum_k, max_k, sum_kctx):
            t = const + per_k * sum_k + per_kctx * sum_kctx + per_draft_step * max_k
            if per_level or per_drafting:
                levels = tree_levels - (tree_levels - max_k) * (max_k < tree_levels)  # min(tree_levels, max_k)
                t = t + (max_k > 0) * (per_level * levels + per_drafting)
            for coef, past, jump in kinks:
                x = past + sum_k
                t = t + (x > 0) * (coef if jump else coef * x)
            return np.maximum(t, 1e-6) if isinstance(t, np.ndarray) else max(t, 1e-6)

        return cost

    def observe(self, sample: StepSample) -> None:
        """Add a measured step; every `refit_every` steps rescale each part to the recent steps (`rescale`)."""
        self._online.append(sample)
        self._since_refit += 1
        if self._since_refit >= self.refit_every:
            self._since_refit = 0
            self.rescale()

    def rescale(self) -> None:
        """Online learning: each part's fitted form times the median ratio of measured to predicted time over
        the recent steps. Only the level moves, not the shape. The recent steps are the ones the controller
        chose, so they cannot tell slopes apart: a controller settled on one k sees that k and prefill chunks,
        nothing in between. A least-squares refit on them (as `refit` does) raised the price of a verified node
        many times over (qwen2.5-coder-1.5b, EAGLE, batch 1, where verifying 1 to 8 nodes costs the same:
        benchmarks/results/eagle_draft_cost/eagle_draft_cost.md), and the controller then cut 8-node trees to 2 nodes on every
        HumanEval step (benchmarks/results/proposer_zoo/archive/2026-12-03-proposer_zoo_qwen_zen5_eagle8.json) and lost their accepted tokens. A
        machine that slows down or speeds up moves
        every step alike, which the level follows. The median: one step stalled by the OS does not move it."""
        for name, fitted in self._fitted.items():
            ratios = [s.part(name) / p for s in self._online
                      if s.part(name) > 0 and (p := fitted.predict(s.features)) > 1e-6]
            if ratios:
                scale = float(np.median(ratios))
                self.parts[name] = LinearPart(fitted.columns, tuple(c * scale for c in fitted.coef))

    def refit(self) -> None:
        """Refit the forms' coefficients on the profile and the online window, for calibration runs that vary
        batch and draft length (benchmarks/simulator_validation.py); the engine itself only rescales online. As
        the window fills, the profile's weight falls to a tenth: the calibration decides, the profile anchors the
        rest."""
        data = self.samples + list(self._online)
        profile_weight = max(0.1, 1.0 - len(self._online) / self.window)
        weight = np.array([profile_weight] * len(self.samples) + [1.0] * len(self._online))
        for name, part in self.parts.items():
            if not part.columns:
                continue
            x = _design([s.features for s in data], part.columns)
            y = np.array([s.part(name) for s in data], dtype=np.float64)
            if len(y) > len(part.columns) and np.linalg.matrix_rank(x) == len(part.columns):
                self.parts[name] = LinearPart(part.columns, tuple(float(c) for c in _fit(x, y, part.columns, weight)))
        self._fitted = dict(self.parts)

    # --- cache ----------------------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {
            "key": self.key,
            "parts": {n: {"columns": list(p.columns), "coef": list(p.coef)} for n, p in self.parts.items()},
            "reports": [asdict(r) for r in self.reports],
            "samples": [{**asdict(s.features), "gathered": s.features.gathered_slots(), "target_s": s.target_s,
                         "draft_s": s.draft_s, "overhead_s": s.overhead_s} for s in self.samples],
        }

    @classmethod
    def from_json(cls, data: dict) -> StepTimeModel:
        names = set(StepFeatures.__dataclass_fields__)
        samples = [StepSample(StepFeatures(**{k: v for k, v in row.items() if k in names}),
                              row["target_s"], row["draft_s"], row["overhead_s"]) for row in data["samples"]]
        parts = {n: LinearPart(tuple(p["columns"]), tuple(p["coef"])) for n, p in data["parts"].items()}
        reports = [FitReport(r["part"], tuple(r["columns"]), r["heldout_mre"], r["r2"], r["num_samples"])
                   for r in data.get("reports", [])]
        return cls(parts, reports, samples, dict(data.get("key", {})))

    def save(self, path: Path) -> None:
        write_text_atomically(path, json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: Path) -> StepTimeModel | None:
        try:
            model = cls.from_json(json.loads(path.read_text()))
            for part in model.parts.values():  # a form from another version may name a feature gone since
                part.predict(StepFeatures())
            return model
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None  # a missing, corrupt or outdated cache only costs a re-profile
