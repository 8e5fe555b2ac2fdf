"""turbospec: LLM inference and serving with goodput-steered speculative decoding."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import cpu_path

cpu_path.apply()  # before anything imports torch: a forced CPU path works through environment switches

from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .llm import LLM

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # LLM pulls in torch: imported on first use, so that the CLI's argument parsing and the `bench serve`
    # client (which may run on a machine that only sends requests) start without it
    if name == "LLM":
        from .llm import LLM

        return LLM
    raise AttributeError(f"module 'turbospec' has no attribute {name!r}")
