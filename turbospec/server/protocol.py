"""The OpenAI request bodies the server accepts, as strict pydantic models.

Strict: a string is not a number and a bool is not an int, and a field this server does not know is refused
(``extra="forbid"``) rather than silently ignored. OpenAI fields that exist but are not implemented here
(penalties, logit_bias, best_of != n, suffix, non-text response formats) are accepted only at their neutral
value, so clients that always send them keep working, and refused otherwise with a message that says so.
Extensions follow vLLM's names (top_k, min_p, ignore_eos, stop_token_ids, ...), plus ``speculation``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..sampling_params import MAX_LOGPROBS, SamplingParams
from ..structured.params import StructuredOutputsParams
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


class JsonSchemaFormat(StrictModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    # (named schema_ because pydantic models have a .schema method; sent and read as "schema")
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with type "json_schema", and only there')
        return self

    def ask(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            assert self.json_schema is not None
            schema = self.json_schema.schema_
            return StructuredOutputsParams(json=schema if schema is not None else {"type": "object"})
        return None


class StructuredOutputs(StrictModel):
    """vLLM's request extension: exactly one of these."""

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def ask(self) -> StructuredOutputsParams:
        """Raises UnsupportedValue when the fields do not make one ask."""
        try:
            return StructuredOutputsParams(json=self.json_, json_object=self.json_object, regex=self.regex,
                                           choice=self.choice, grammar=self.grammar)
        except ValueError as exc:
            raise UnsupportedValue("structured_outputs", str(exc)) from None


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
    response_format: ResponseFormat | None = None
    # vLLM's extension: a JSON schema, regex, choice or grammar (Lark or GBNF) the output must match
    structured_outputs: StructuredOutputs | None = None
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
        if self.structured_outputs is not None and self.response_format is not None \
                and self.response_format.type != "text":
            raise UnsupportedValue("structured_outputs", "give response_format or structured_outputs, not both")

    def structured_ask(self) -> StructuredOutputsParams | None:
        """What the output must match, from response_format or structured_outputs (None: free text)."""
        if self.structured_outputs is not None:
            return self.structured_outputs.ask()
        return self.response_format.ask() if self.response_format is not None else None

    @property
    def structured_param(self) -> str:
        """The field an invalid ask came from, for the error's `param`."""
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        structured: StructuredOutputsParams | None = None) -> SamplingParams:
        """Raises ValueError naming the field (SamplingParams validates the combinations); `structured` replaces
        the request's own ask (a tool-call grammar)."""
        return SamplingParams(
            n=1, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            seed=self.seed, max_tokens=max_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, structured_outputs=structured or self.structured_ask(),
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


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON text


class MessageToolCall(StrictModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: which call it answers

    @model_validator(mode="after")
    def _content_or_calls(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant message with tool_calls may leave it out)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def as_template_message(self) -> dict[str, Any]:
        content = self.content
        text = content if isinstance(content, str) or content is None else "".join(p.text for p in content)
        # "developer" is OpenAI's newer name for "system"; chat templates know "system"
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text or ""}
        if self.tool_calls:  # templates write arguments as JSON themselves: give them the object
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class FunctionDefinition(StrictModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: ChosenFunction


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tool_choice is not None and not self.tools and self.tool_choice != "none":
            raise UnsupportedValue("tool_choice", "tool_choice needs tools: give the functions in tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise UnsupportedValue("tool_choice", f"tool_choice names the function "
                                       f"{self.tool_choice.function.name!r}, which is not among the tools "
                                       f"({', '.join(names)})")
        if self.forced_tools and self.structured_ask() is not None:
            raise UnsupportedValue("tool_choice", "a required or named tool_choice already fixes the answer's form: "
                                   "leave out response_format / structured_outputs")
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedValue("top_logprobs", "top_logprobs needs logprobs: true")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise UnsupportedValue("max_completion_tokens", "max_tokens and max_completion_tokens disagree: send one")

    @property
    def calls_tools(self) -> bool:
        """Whether the answer may hold tool calls (to be parsed out of it)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def tool_names(self) -> list[str]:
        return [t.function.name for t in self.tools or []]

    @property
    def forced_tools(self) -> list[dict[str, Any]] | None:
        """The tools the answer must call (tool_choice "required": any of them; a named one: it), or None."""
        if not self.tools or self.tool_choice in (None, "none", "auto"):
            return None
        tools = [t.model_dump(by_alias=True, exclude_none=True) for t in self.tools]
        if isinstance(self.tool_choice, NamedToolChoice):
            return [t for t in tools if t["function"]["name"] == self.tool_choice.function.name]
        return tools

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
