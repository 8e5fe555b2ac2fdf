"""OpenAI tool calling in the Hermes format that Qwen2.5's chat template teaches its models:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

tool_choice "auto" lets the model choose and reads the calls out of its answer; "required" and a named function
hold the answer to such calls with a grammar (the arguments to each function's parameters schema); "none"
parses nothing. A template that does not format tools itself gets them in a system message of the same format."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from ..models.tokenizer import Tokenizer
from .params import StructuredOutputsParams

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|$)", re.S)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """What one call of this function looks like as JSON."""
    function = tool["function"]
    return {"type": "object", "properties": {"name": {"const": function["name"]},
                                             "arguments": function.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_grammar(tools: list[dict[str, Any]], tokenizer: Tokenizer, many: bool) -> StructuredOutputsParams:
    """A grammar for calls of these tools: one or more (tool_choice "required"), or exactly one (a named one)."""
    schema = call_schema(tools[0]) if len(tools) == 1 else {"anyOf": [call_schema(t) for t in tools]}
    opener, closer = _marker(tokenizer, OPEN), _marker(tokenizer, CLOSE)
    start = 'start: call ("\\n" call)*' if many else "start: call"
    lark = (f'{start}\ncall: {opener} "\\n" body "\\n" {closer}\n'
            f"body: %json {json.dumps(schema)}\n")
    return StructuredOutputsParams(grammar=lark)


def _marker(tokenizer: Tokenizer, text: str) -> str:
    """The Lark for a marker: its token where the vocabulary has it as one added token (llguidance then treats it
    as special: it only matches by id), else its text."""
    hf = getattr(tokenizer, "hf", None)
    if hf is not None and text in getattr(hf, "get_added_vocab", dict)():
        return f"<[{hf.convert_tokens_to_ids(text)}]>"
    return json.dumps(text)


def system_prompt(tools: list[dict[str, Any]]) -> str:
    """The tools for a template that does not format them: the Hermes prompt Qwen2.5's template writes."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
            f"function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\nFor each function "
            "call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
            f'{OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}')


def parse_tool_calls(text: str, names: list[str]) -> tuple[str | None, list[ToolCall]]:
    """The answer's text before its first call (None if empty) and its well-formed calls of these functions. Small
    models often answer with the call's JSON alone, bare or in a code fence, without the tags: an answer that is
    exactly such an object naming one of the functions is read as that call (as llama.cpp's server does)."""
    start = text.find(OPEN)
    if start < 0:
        call = _call(_FENCE.sub("", text.strip()), names)
        return (None, [call]) if call else (text, [])
    calls = [call for body in _CALL.findall(text[start:]) if (call := _call(body, names))]
    content = text[:start].strip()
    return content or None, calls


_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$")


def _call(body: str, names: list[str]) -> ToolCall | None:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or call.get("name") not in names or not isinstance(call.get("arguments", {}), (dict, str)):
        return None
    arguments = call.get("arguments", {})
    return ToolCall(call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))


class ToolCallStream:
    """Streams an answer's text up to its first tool call and holds the rest, so no client sees the call's
    markup as content; the calls go out once the answer is complete."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.sent = 0
        self.text = ""
        self.calling = False

    def feed(self, delta: str) -> str:
        """The part of the answer's text that can be sent as content now."""
        self.text += delta
        if self.calling:
            return ""
        head = self.text.lstrip()
        if self.sent == 0 and (head.startswith(("{", "```")) or "```".startswith(head)):
            return ""  # it may be an untagged call (parse_tool_calls): held until the end
        start = self.text.find(OPEN)
        if start >= 0:
            self.calling = True
            end = start
        else:  # hold back what could still become the opener
            end = len(self.text)
            for n in range(min(len(OPEN) - 1, len(self.text)), 0, -1):
                if OPEN.startswith(self.text[-n:]):
                    end = len(self.text) - n
                    break
        out, self.sent = self.text[self.sent: end], max(self.sent, end)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end: the content not yet sent, and the calls."""
        _, calls = parse_tool_calls(self.text, self.names)
        if not calls:  # no call after all: everything held back is content
            rest, self.sent = self.text[self.sent:], len(self.text)
            return rest, []
        start = self.text.find(OPEN)
        return self.text[self.sent: start] if start > self.sent else "", calls
