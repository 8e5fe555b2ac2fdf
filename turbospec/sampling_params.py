"""Per-request sampling parameters (vLLM-compatible names and defaults).

This module deliberately imports no torch so that API / CLI layers can build
and validate requests without paying for the torch import.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from .structured.params import StructuredOutputsParams

# Below this temperature sampling is treated as greedy argmax: dividing logits
# by a tiny temperature overflows float32 and gives the same answer anyway.
_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20


def _is_int(value: Any) -> bool:
    # bool is a subclass of int; True as a token budget or seed is a bug.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(name: str, value: Any) -> int:
    if not _is_int(value):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    return value


def _check_float(name: str, value: Any) -> float:
    if not _is_real(value):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


@dataclass
class SamplingParams:
    """How to sample the completion of one request.

    Field names, meanings and defaults follow vLLM's ``SamplingParams``.
    ``__post_init__`` validates every field (raising ``ValueError`` that
    names the field, the bad value and what is allowed) and normalises:
    ``stop`` to ``list[str]``, ``stop_token_ids`` to ``list[int]``,
    ``top_k`` 0 to -1, and numeric fields to ``float`` / ``int``.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0, normalised to -1) disables top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # Number of top log-probs returned per generated token; 0 = only the
    # chosen token's logprob, None = no logprobs at all.
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # the output must match a JSON schema, a regex, a choice or a grammar (structured/params.py)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self.n = _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")

        self.temperature = _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature:g}")

        self.top_p = _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p:g}")

        self.top_k = _check_int("top_k", self.top_k)
        if self.top_k == 0:
            self.top_k = -1
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")

        self.min_p = _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p:g}")

        if self.seed is not None:
            _check_int("seed", self.seed)

        self.max_tokens = _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)

        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(
                    f"logprobs must be None or in [0, {MAX_LOGPROBS}], got {self.logprobs}"
                )

        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")

        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                                 f"{type(self.structured_outputs).__name__}")
            if self.ignore_eos:
                raise ValueError("ignore_eos cannot be combined with structured_outputs: a finished grammar only "
                                 "allows the end of the answer")

    @staticmethod
    def _normalise_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        elif not isinstance(stop, (list, tuple)):
            raise ValueError(
                f"stop must be a str, a list of str or None, got {stop!r} ({type(stop).__name__})"
            )
        out: list[str] = []
        for s in stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must contain only str, got {s!r} ({type(s).__name__})")
            if s == "":
                # An empty stop string would match at every position.
                raise ValueError("stop strings must be non-empty, got ''")
            out.append(s)
        return out  # always a fresh list so clones never share it

    @staticmethod
    def _normalise_stop_token_ids(ids: Any) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)):
            raise ValueError(
                f"stop_token_ids must be a list of int or None, got {ids!r} ({type(ids).__name__})"
            )
        out: list[int] = []
        for t in ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must contain only ints >= 0, got {t!r}")
            out.append(t)
        return out

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature ~ 0)."""
        return self.temperature < _GREEDY_EPS

    def clone(self, **overrides: Any) -> SamplingParams:
        """Return a validated copy with ``overrides`` applied (lists are copied)."""
        return dataclasses.replace(self, **overrides)
