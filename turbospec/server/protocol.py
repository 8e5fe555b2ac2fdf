"""The OpenAI request bodies the server accepts, as strict pydantic models.

Strict: a string is not a number and a bool is not an int, and a field this server does not know is refused
(``extra="forbid"``) rather than silently ignored. OpenAI fields that exist but are not implemented here
(penalties, logit_bias, best_of != n, suffix, non-text response formats) are accepted only at their neutral
value, so clients that always send them keep working, and refused otherwise with a message that says so.
Extensions follow vLLM's names (top_k, min_p, ignore_eos, stop_token_ids, ...), plus ``speculation``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..sampling_params import MAX_LOGPROBS, SamplingParams
from ..verification.policies import ACCEPTANCE_POLICIES

MAX_N = 16  # completions per request: each is a full engine request


class UnsupportedValue(ValueError):
    """A known OpenAI field set to a value this server does not implement."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictModel):
    include_usage: bool = False


class ResponseFormat(StrictModel):
    type: str


class _SamplingFields(StrictModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = -1
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # turbospec: false keeps this request at k = 0 (no drafts) whatever the server's speculation policy
    speculation: bool = True
    # turbospec: make this request deterministic (llm42 or margin-gate on any server; batch-invariant only on a
    # server started with --deterministic batch-invariant); absent: the server's --deterministic mode
    deterministic: Literal["batch-invariant", "llm42", "margin-gate"] | None = None
    # turbospec: this request's acceptance policy (verification/policies.py); absent: the server's. typical, adasd and
    # adasd-verification are LOSSY (the answer is no longer the model's own); responses then carry "acceptance"
    acceptance: Literal[ACCEPTANCE_POLICIES] | None = None  # type: ignore[valid-type]
    user: str | None = None  # an end-user id for abuse tracking: carries no behaviour, so accepting it is safe
    # OpenAI fields accepted only at their neutral values
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def check_supported(self) -> None:
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) != 0.0:
                raise UnsupportedValue(name, f"{name} is not supported by this server: send 0 or leave it out")
        if self.logit_bias:
            raise UnsupportedValue("logit_bias", "logit_bias is not supported by this server: leave it out")

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the field (SamplingParams validates the combinations)."""
        return SamplingParams(
            n=1, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            seed=self.seed, max_tokens=max_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


PromptField = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingFields):
    prompt: PromptField
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedValue("best_of", "best_of other than n is not supported: leave it out")
        if self.suffix:
            raise UnsupportedValue("suffix", "suffix (insertion) is not supported: leave it out")
        if self.echo and self.logprobs is not None:
            raise UnsupportedValue("echo", "echo with logprobs would need prompt log-probs, which this server "
                                           "does not compute: use one or the other")

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise UnsupportedValue("prompt", "prompt is an empty list: give a string, strings or token ids")
        if all(isinstance(t, int) for t in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_message(self) -> dict[str, Any]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        # "developer" is OpenAI's newer name for "system"; chat templates know "system"
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    response_format: ResponseFormat | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedValue("top_logprobs", "top_logprobs needs logprobs: true")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise UnsupportedValue("max_completion_tokens", "max_tokens and max_completion_tokens disagree: send one")
        if self.response_format is not None and self.response_format.type != "text":
            raise UnsupportedValue("response_format", f"response_format {self.response_format.type!r} is not "
                                                      "supported: only {\"type\": \"text\"}")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(StrictModel):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]
