"""Engine-wide options, validated once. Every user-facing engine option lives here (no torch import)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from . import cpu_path
from .control.acceptance_estimators import DEFAULT_ESTIMATOR, ESTIMATORS
from .verification.policies import LOSSLESS_POLICIES, TYPICAL_DELTA, TYPICAL_EPSILON, check_policy

DTYPE_NAMES = ("bfloat16", "bf16", "float32", "fp32", "float16", "fp16")
WEIGHT_FORMATS = ("auto", "bf16", "int4", "int8", "auto-q8act")  # models/weight_format.py says what each keeps
DETERMINISTIC_MODES = ("batch-invariant", "llm42", "margin-gate", "layercast")
# the modes a single request may ask for (the others change every row's kernels or the KV dtype: engine-wide)
REQUEST_DETERMINISTIC_MODES = ("batch-invariant", "llm42", "margin-gate")


@dataclass
class EngineConfig:
    """How the engine batches, caches and runs. Names follow vLLM where vLLM has the option."""

    model: str
    dtype: str = "bfloat16"
    # "auto": packed low-bit kernels for few-row calls where the GGUF's blocks can be held exactly, dense for
    # the rest; "bf16": dense only; "int4" / "int8": packed only (least memory); "auto-q8act": auto with the packed
    # products' activations quantised to int8 (lossy, faster for a few rows). See models/weight_format.py.
    weight_format: str = "auto"
    max_model_len: int | None = None  # default: the model's context length, capped at 4096 on CPU
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    block_size: int = 16
    enable_prefix_caching: bool = True
    # KV cache size in GiB; None sizes it to hold max_num_seqs full-length sequences, capped at 4 GiB.
    kv_cache_memory_gib: float | None = None
    num_threads: int | None = None  # per process: with tensor parallelism, each rank uses this many threads
    device: str = "cpu"
    # ranks the decoder layers are split over (parallel/): processes on this machine, gloo on CPU, NCCL on CUDA
    tensor_parallel_size: int = 1
    seed: int = 0
    # None, a SpeculativeConfig, a dict, or its JSON text (see SpeculativeConfig)
    speculative_config: SpeculativeConfig | dict | str | None = None
    # None (fastest); "batch-invariant": a request's tokens and log-probs are bitwise the same whatever else is
    # batched with it, however its prompt is chunked or cached, and with or without speculation; "layercast":
    # bf16 weights with float32 compute and KV, a reference point that makes drift rarer but does not remove it;
    # "llm42": fast decoding, windows of verify_window tokens replayed on the invariant path (same output as
    # batch-invariant); "margin-gate": only tokens whose top-1/top-2 margin is below margin_threshold are
    # re-checked (see determinism/exact.py)
    deterministic: str | None = None
    # llm42: unverified tokens a request holds before its window is replayed, or "auto": the window that
    # minimises replay cost plus tokens wasted after mismatches, from measured rates (at most 64)
    verify_window: int | str = 64
    # margin-gate: re-check tokens whose margin (nats) is below this; None: the calibrated value for the model
    # (`turbospec calibrate-margin`, run briefly on first use when there is none)
    margin_threshold: float | None = None

    def __post_init__(self) -> None:
        forced = cpu_path.problem()
        if forced is not None:
            raise ValueError(forced)
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"unknown dtype {self.dtype!r}: expected one of bfloat16, float32, float16")
        if self.weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"unknown weight_format {self.weight_format!r}: expected one of "
                             f"{', '.join(WEIGHT_FORMATS)}")
        if self.weight_format in ("int4", "int8") and self.deterministic:
            raise ValueError(f"deterministic={self.deterministic!r} runs dense kernels with a fixed reduction order; "
                             f"weight_format {self.weight_format!r} keeps no dense weights: use auto or bf16")
        check_positive("max_num_seqs", self.max_num_seqs)
        check_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        check_positive("block_size", self.block_size)
        if self.max_model_len is not None:
            check_positive("max_model_len", self.max_model_len)
        if self.kv_cache_memory_gib is not None and not self.kv_cache_memory_gib > 0:
            raise ValueError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib}")
        if self.num_threads is not None:
            check_positive("num_threads", self.num_threads)
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"unknown device {self.device!r}: expected 'cpu' or 'cuda[:N]'")
        check_positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.tensor_parallel_size > 1 and self.weight_format in ("int4", "int8", "auto-q8act"):
            raise ValueError(f"tensor parallelism splits dense weights; weight_format {self.weight_format!r} keeps "
                             "packed ones only: use auto (dense under tensor parallelism) or bf16")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.deterministic not in (None, *DETERMINISTIC_MODES):
            raise ValueError(f"unknown deterministic mode {self.deterministic!r}: expected one of "
                             f"{', '.join(DETERMINISTIC_MODES)} (or leave it unset)")
        if self.verify_window != "auto":
            check_positive("verify_window", self.verify_window, 'or "auto"')
        m = self.margin_threshold
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or not m >= 0):
            raise ValueError(f"margin_threshold must be a number >= 0 (nats) or None (calibrated), got {m!r}")
        spec = self.speculative_config
        if self.deterministic and spec is not None and spec.acceptance not in LOSSLESS_POLICIES:
            raise ValueError(f"acceptance {spec.acceptance!r} is lossy: it cannot be combined with deterministic="
                             f"{self.deterministic!r}, whose output must be the model's own (use 'exact')")
        if self.deterministic == "layercast" and self.dtype not in ("bfloat16", "bf16"):
            raise ValueError(f"layercast keeps bfloat16 weights and computes in float32: it needs dtype bfloat16, "
                             f"got {self.dtype!r}")

    @property
    def threads(self) -> int:
        """Threads per process: num_threads, or this machine's cores shared by the tensor-parallel ranks."""
        return self.num_threads or max(1, (os.cpu_count() or 1) // self.tensor_parallel_size)


def int_list(flag: str, text: str, lowest: int = 1) -> tuple[int, ...]:
    """Comma-separated integers >= lowest from a command-line flag, or ValueError saying what is allowed."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if min(values) < lowest:
        raise ValueError(f"{flag} must be integers >= {lowest}, got {text!r}")
    return values


def check_positive(name: str, value: object, alternative: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1{' ' + alternative if alternative else ''}, got {value!r}")


SPEC_METHODS = ("ngram", "draft", "layer-skip", "medusa", "hydra", "eagle", "dart", "lookahead")
# methods that draft from the target's hidden states with a trained file (heads/)
HEAD_METHODS = ("medusa", "hydra", "eagle", "dart")
DRAFT_STOPS = ("confidence", "none")  # SpeculativeConfig.draft_stop
DRAFT_VOCAB_METHODS = ("draft", "layer-skip")  # the proposers that run a model's own LM head


@dataclass
class SpeculativeConfig:
    """vLLM-shaped speculative decoding options (``LLM(..., speculative_config={...})``)."""

    method: str
    # "auto": the goodput controller chooses 0..max_speculative_tokens per request and step; an int fixes k.
    num_speculative_tokens: int | str = "auto"
    max_speculative_tokens: int = 8
    model: str | None = None  # the draft model, for method "draft"
    # method "layer-skip": the layers the target skips when it drafts for itself; None: the searched set
    # (`turbospec search-layers`, run on first use and cached per model)
    skip_layers: list[int] | None = None
    # methods "medusa" / "hydra" / "eagle" / "dart": the trained file; None: heads/<model>-<method>.safetensors
    heads: str | None = None
    # heads: children tried per expanded node when a request's drafts may branch (1: chains only)
    tree_branch: int = 4
    # heads: draft steps per tree, i.e. its deepest level; None: one per head (Medusa, Hydra), the EAGLE layer's
    # trained depth or DART's positions per pass. EAGLE may go deeper: its layer reads its own outputs at every
    # step, trained depth or not; DART may not (one pass predicts a fixed number of positions).
    tree_depth: int | None = None
    # method "lookahead": Jacobi window length and n-gram size of its pool (proposers/lookahead.py)
    lookahead_window: int = 4
    lookahead_ngram: int = 3
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    acceptance_estimator: str = DEFAULT_ESTIMATOR  # see control/acceptance_estimators.py
    # For studies only: accept each draft token with this fixed probability whatever it is (TurboSpec's
    # microbenchmarks). Outputs are then NOT the model's; step costs and the controller's choices are real.
    synthetic_acceptance: float | None = None
    # which drafts are kept: "exact" (lossless rejection sampling, the default), or a policy of
    # verification/lossy.py. "typical", "adasd" and "adasd-verification" are LOSSY: output is no longer the
    # target's own. A request may pick another policy (LLMEngine.add_request(acceptance=), HTTP "acceptance").
    acceptance: str = "exact"
    # methods "draft" / "layer-skip" in auto mode: "confidence" (the default) lets the draft stop where it turns
    # unsure (verification/lossy.py, AdaptiveThresholds.draft_more; lossless), the controller's k being the cap;
    # "none": the controller's k is the draft length. A fixed k is always drafted in full.
    draft_stop: str = "confidence"
    typical_epsilon: float = TYPICAL_EPSILON  # typical acceptance: p(x) > min(epsilon, delta * exp(-H(p)))
    typical_delta: float = TYPICAL_DELTA
    # methods "draft" / "layer-skip": the draft's LM head scores this many frequent tokens plus each request's own
    # (proposers/draft_vocab.py, lossless); "auto": 32768 for vocabularies of 64k tokens or more; null / 0: all
    draft_vocab_size: int | str | None = "auto"
    # method "draft": "int4" rounds the draft model's wider GGUF blocks (Q5_0, Q8_0, Q6_K) to 4 bits, groups of 32
    # (gguf_blocks.requantize_int4): fewer bytes per draft token; lossy for the draft only, so the output stays
    # exact. null: the file's own values.
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}: expected one of {', '.join(SPEC_METHODS)}")
        if self.num_speculative_tokens != "auto":
            check_positive("num_speculative_tokens", self.num_speculative_tokens, "or \"auto\"")
        check_positive("max_speculative_tokens", self.max_speculative_tokens)
        if self.acceptance_estimator not in ESTIMATORS:
            raise ValueError(f"unknown acceptance_estimator {self.acceptance_estimator!r}: expected one of "
                             f"{', '.join(ESTIMATORS)}")
        a = self.synthetic_acceptance
        if a is not None and (isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0):
            raise ValueError(f"synthetic_acceptance must be a number in [0, 1] or null, got {a!r}")
        check_policy(self.acceptance, self.method)
        for name in ("typical_epsilon", "typical_delta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < v <= 1.0:
                raise ValueError(f"{name} must be a number in (0, 1], got {v!r}")
        if self.method == "draft" and not self.model:
            raise ValueError("speculative method 'draft' needs a draft model: add \"model\": \"<name or path>\"")
        if self.skip_layers is not None:
            if self.method != "layer-skip":
                raise ValueError(f"skip_layers only applies to method 'layer-skip', not {self.method!r}")
            s = self.skip_layers
            if not isinstance(s, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in s):
                raise ValueError(f"skip_layers must be a list of layer indices (integers >= 0), got {s!r}")
        if self.method == "lookahead":
            check_positive("lookahead_window", self.lookahead_window)
            check_positive("lookahead_ngram", self.lookahead_ngram)
            if self.lookahead_ngram < 2:
                raise ValueError(f"lookahead_ngram must be >= 2 (a key and what follows it), got "
                                 f"{self.lookahead_ngram}")
        if self.method in HEAD_METHODS:
            check_positive("tree_branch", self.tree_branch)
            if self.tree_depth is not None:
                check_positive("tree_depth", self.tree_depth, "or null (the heads' own depth)")
        else:
            for name in ("heads", "tree_depth"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} only applies to methods {', '.join(HEAD_METHODS)}, not {self.method!r}")
        v = self.draft_vocab_size
        if v not in ("auto", None) and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError(f"draft_vocab_size must be \"auto\", null or an integer >= 0 (0: the full vocabulary), "
                             f"got {v!r}")
        if v not in ("auto", None, 0) and self.method not in DRAFT_VOCAB_METHODS:
            raise ValueError(f"draft_vocab_size only applies to methods {', '.join(DRAFT_VOCAB_METHODS)}, not "
                             f"{self.method!r}")
        if self.draft_stop not in DRAFT_STOPS:
            raise ValueError(f"draft_stop must be one of {', '.join(DRAFT_STOPS)}, got {self.draft_stop!r}")
        if self.quantization not in (None, "int4"):
            raise ValueError(f"quantization must be null (the draft file's own values) or \"int4\", got "
                             f"{self.quantization!r}")
        if self.quantization is not None and self.method != "draft":
            raise ValueError(f"quantization applies to a separate draft model (method \"draft\"), not {self.method!r}")
        if self.method == "ngram":
            check_positive("prompt_lookup_min", self.prompt_lookup_min)
            check_positive("prompt_lookup_max", self.prompt_lookup_max)
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                                 f"({self.prompt_lookup_max})")

    @property
    def is_auto(self) -> bool:
        return self.num_speculative_tokens == "auto"

    @property
    def confidence_stop(self) -> bool:
        """Whether a draft model's drafts end where it turns unsure when the engine is in auto mode (draft_stop)."""
        return self.draft_stop == "confidence" and self.method in DRAFT_VOCAB_METHODS

    @property
    def k_limit(self) -> int:
        """The most drafts one request verifies in a step."""
        return self.max_speculative_tokens if self.is_auto else int(self.num_speculative_tokens)

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """Accept a config, a dict, or the JSON the CLI takes; unknown keys are refused, not ignored."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative config is not valid JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise ValueError(f"speculative config must be a JSON object, got {type(value).__name__}")
        if "method" not in value:
            raise ValueError(f"speculative config needs \"method\" (one of {', '.join(SPEC_METHODS)})")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative config key(s) {unknown}: expected some of {sorted(known)}")
        return cls(**value)
