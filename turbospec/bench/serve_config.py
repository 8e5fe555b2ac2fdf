"""What `turbospec bench serve` is asked to do: its flags, resolved and validated once."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
ENDPOINTS = ("chat", "completions")
DATASETS = ("mtbench", "humaneval", "sharegpt", "mixed", "random")
SLO_METRICS = ("ttft", "tpot", "e2el")
DEFAULT_MAX_TOKENS = 256  # output cap for the non-random data sets
DEFAULT_RANDOM_INPUT_LEN = 256
DEFAULT_RANDOM_OUTPUT_LEN = 128


@dataclass(frozen=True)
class BenchConfig:
    """Every flag of ``turbospec bench serve``, resolved (max_tokens is the cap actually sent). Validated on
    construction: a bad value raises ValueError naming the flag and what is allowed."""

    base_url: str = DEFAULT_BASE_URL
    model: str | None = None  # None: the first id of GET /v1/models
    endpoint: str = "chat"
    dataset: str = "mtbench"
    num_prompts: int = 80
    random_input_len: int = DEFAULT_RANDOM_INPUT_LEN
    random_output_len: int = DEFAULT_RANDOM_OUTPUT_LEN
    max_tokens: int = DEFAULT_MAX_TOKENS
    ignore_eos: bool = False
    temperature: float = 0.0
    request_rates: tuple[float, ...] = (math.inf,)
    burstiness: float = 1.0
    max_concurrency: int | None = None
    warmup: int = 0
    seed: int = 0
    goodput: dict[str, float] = field(default_factory=dict)  # SLO metric -> limit in ms
    extra_body: dict[str, Any] = field(default_factory=dict)
    timeout: float = 600.0
    output: str | None = None
    label: str | None = None

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://, got {self.base_url!r}")
        object.__setattr__(self, "base_url", self.base_url.rstrip("/"))
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if self.dataset not in DATASETS:
            raise ValueError(f"--dataset must be one of {', '.join(DATASETS)}, got {self.dataset!r}")
        for flag, value, lowest in (("--num-prompts", self.num_prompts, 1), ("--max-tokens", self.max_tokens, 1),
                                    ("--random-input-len", self.random_input_len, 1),
                                    ("--random-output-len", self.random_output_len, 1),
                                    ("--warmup", self.warmup, 0)):
            if value < lowest:
                raise ValueError(f"{flag} must be an integer >= {lowest}, got {value}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1 (or omitted for no limit), got {self.max_concurrency}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"--temperature must be a finite number >= 0, got {self.temperature}")
        if not (math.isfinite(self.burstiness) and self.burstiness > 0):
            raise ValueError(f"--burstiness must be a finite number > 0 (1.0 = Poisson), got {self.burstiness}")
        if not (math.isfinite(self.timeout) and self.timeout > 0):
            raise ValueError(f"--timeout must be a finite number of seconds > 0, got {self.timeout}")
        if not self.request_rates or any(not r > 0 for r in self.request_rates):  # `not r > 0` also catches NaN
            raise ValueError(f"--request-rate values must be > 0 requests/s or inf, got {list(self.request_rates)}")
        for name, limit in self.goodput.items():
            if name not in SLO_METRICS or not (math.isfinite(limit) and limit > 0):
                raise ValueError(f"--goodput SLO {name}:{limit} is invalid: expected one of "
                                 f"{', '.join(SLO_METRICS)} with a finite limit > 0 ms")
        if not isinstance(self.extra_body, dict):
            # ValueError, not TypeError: every bad flag value is a ValueError (the CLI's usage error)
            kind = type(self.extra_body).__name__
            raise ValueError(f"--extra-body must be a JSON object, got {kind}")  # noqa: TRY004
        if "stream" in self.extra_body:  # the client only reads server-sent events
            raise ValueError("--extra-body must not set 'stream': the benchmark always streams")
