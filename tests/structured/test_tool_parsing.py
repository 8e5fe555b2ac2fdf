"""Reading tool calls out of an answer, and streaming an answer whose calls must not leak out as content."""

from __future__ import annotations

import json

from turbospec.structured.tools import ToolCallStream, parse_tool_calls

NAMES = ["get_weather", "get_time"]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_tagged_calls_and_the_text_before_them() -> None:
    content, calls = parse_tool_calls("Let me check.\n" + CALL + "\n" + CALL.replace("weather", "time"), NAMES)
    assert content == "Let me check."
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"} and calls[0].id != calls[1].id


def test_untagged_and_fenced_calls_of_known_functions_only() -> None:
    bare = '{"name": "get_time", "arguments": {"city": "Oslo"}}'
    assert parse_tool_calls(bare, NAMES)[1][0].name == "get_time"
    assert parse_tool_calls(f"```json\n{bare}\n```", NAMES)[1][0].name == "get_time"
    assert parse_tool_calls(bare.replace("get_time", "rm_rf"), NAMES) == (bare.replace("get_time", "rm_rf"), [])
    assert parse_tool_calls('{"name": "get_time", "arguments": [1]}', NAMES)[1] == []
    assert parse_tool_calls("<tool_call>\n{broken\n</tool_call>", NAMES) == (None, [])


def stream(pieces: list[str]) -> tuple[str, list[str]]:
    s = ToolCallStream(NAMES)
    sent = "".join(s.feed(p) for p in pieces)
    rest, calls = s.finish()
    return sent + rest, [c.name for c in calls]


def test_a_stream_never_sends_call_markup_as_content() -> None:
    text = "Let me check. " + CALL
    pieces = [text[i: i + 3] for i in range(0, len(text), 3)]
    assert stream(pieces) == ("Let me check. ", ["get_weather"])


def test_a_stream_without_calls_sends_everything() -> None:
    for text in ["Plain answer with a < sign and <tool", "{not a call}", "```python\nprint(1)\n```"]:
        pieces = [text[i: i + 2] for i in range(0, len(text), 2)]
        assert stream(pieces) == (text, [])


def test_a_plain_answer_streams_as_it_comes() -> None:
    s = ToolCallStream(NAMES)
    assert s.feed("Hello ") == "Hello " and s.feed("world <to") == "world " and s.feed("day") == "<today"
