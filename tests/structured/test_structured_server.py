"""Structured outputs and tool calling over HTTP with the official `openai` client: response_format json_object
and json_schema (chat and completions), vLLM's structured_outputs field, the 400s for asks that cannot run (with
their `param`, the server serving on), and a tool-call round trip on qwen2.5-coder-1.5b, whose chat template has
tools, streamed and not."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
from live_server import LiveServer, live_server

from turbospec.config import EngineConfig
from turbospec.tuning import build_engine

pytestmark = pytest.mark.slow

CONFIG = {"dtype": "float32", "num_threads": 1, "max_model_len": 1024}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                         "country": {"type": "string", "maxLength": 30},
                                         "founded": {"type": "integer", "minimum": -3000, "maximum": 2100}},
        "required": ["city", "country", "founded"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def client_for(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def small() -> Iterator[LiveServer]:
    engine = build_engine(EngineConfig("smollm2-135m", speculative_config={"method": "ngram", "num_speculative_tokens": 4},
                                       **CONFIG), progress=False)
    with live_server(engine, "smollm2-135m") as live:
        yield live


def test_response_format_json_schema_and_object(small: LiveServer) -> None:
    client = client_for(small)
    messages = [{"role": "user", "content": "Tell me about Paris as JSON."}]
    out = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=120, temperature=0,
                                         response_format={"type": "json_schema",
                                                          "json_schema": {"name": "city", "schema": CITY}})
    jsonschema.validate(json.loads(out.choices[0].message.content), CITY)
    out = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=120, temperature=0,
                                         response_format={"type": "json_object"})
    assert out.choices[0].finish_reason in ("stop", "length")
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    stream = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=120, temperature=0,
                                            stream=True, response_format={"type": "json_schema", "json_schema":
                                                                          {"name": "city", "schema": CITY}})
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in stream if c.choices)), CITY)


def test_completions_and_structured_outputs_extension(small: LiveServer) -> None:
    client = client_for(small)
    out = client.completions.create(model="smollm2-135m", prompt="The phone number is", max_tokens=20, temperature=0,
                                    extra_body={"structured_outputs": {"regex": r" [0-9]{3}-[0-9]{4}"}})
    assert out.choices[0].finish_reason == "stop"
    assert len(out.choices[0].text) == 9 and out.choices[0].text[4] == "-"
    out = client.chat.completions.create(model="smollm2-135m", max_tokens=5, temperature=0,
                                         messages=[{"role": "user", "content": "Is the sky blue?"}],
                                         extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert out.choices[0].message.content in ("yes", "no")


@pytest.mark.parametrize("body, param, reason", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format", "strin"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema is required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}}}}, "response_format", "dependentSchemas"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "unclosed group"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"json_object": True}, "response_format": {"type": "json_object"}},
     "structured_outputs", "not both"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}]}, "tools", "objec"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"structured_outputs": {"json_object": True}, "ignore_eos": True}, "ignore_eos", "ignore_eos"),
])
def test_asks_that_cannot_run_are_400_and_the_server_goes_on(small: LiveServer, body: dict, param: str,
                                                             reason: str) -> None:
    request = {"model": "smollm2-135m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **body}
    r = httpx.post(small.v1 + "/chat/completions", json=request, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and reason in error["message"], error
    ok = httpx.post(small.v1 + "/chat/completions", timeout=60,
                    json={"model": "smollm2-135m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status_code == 200


@pytest.fixture(scope="module")
def qwen() -> Iterator[LiveServer]:
    engine = build_engine(EngineConfig("qwen2.5-coder-1.5b", **{**CONFIG, "dtype": "bfloat16", "num_threads": 2}),
                          progress=False)
    with live_server(engine, "qwen2.5-coder-1.5b") as live:
        yield live


def test_tool_call_round_trip(qwen: LiveServer) -> None:
    client = client_for(qwen)
    messages: list = [{"role": "user", "content": "What is the weather in Paris right now? Once the tool has answered, tell me in one sentence."}]
    first = client.chat.completions.create(model="qwen2.5-coder-1.5b", messages=messages, tools=[WEATHER_TOOL, TIME_TOOL],
                                           temperature=0, max_tokens=60)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Paris"
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18, "sky": "cloudy"})}]
    # the final answer: tool_choice "none" (a 1.5B model would otherwise call again)
    second = client.chat.completions.create(model="qwen2.5-coder-1.5b", messages=messages, tools=[WEATHER_TOOL, TIME_TOOL],
                                            tool_choice="none", temperature=0, max_tokens=40)
    assert second.choices[0].finish_reason in ("stop", "length") and not second.choices[0].message.tool_calls
    assert "18" in second.choices[0].message.content


def test_named_tool_choice_streams_its_call(qwen: LiveServer) -> None:
    client = client_for(qwen)
    stream = client.chat.completions.create(
        model="qwen2.5-coder-1.5b", messages=[{"role": "user", "content": "Tell me a joke."}],
        tools=[WEATHER_TOOL, TIME_TOOL], tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=0, max_tokens=40, stream=True)
    calls, finish, content = [], None, ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert [c.function.name for c in calls] == ["get_time"]
    assert "city" in json.loads(calls[0].function.arguments)


def test_required_tool_choice_on_a_template_without_tools(small: LiveServer) -> None:
    # smollm2's template ignores tools: they reach the model in a system turn, and the grammar holds it to a call
    client = client_for(small)
    out = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                         tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required", temperature=0,
                                         max_tokens=120)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    for call in choice.message.tool_calls:
        tool = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
