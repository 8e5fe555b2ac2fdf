"""The OpenAI-compatible server with a real model behind it and the official `openai` client in front.

One server (smollm2-135m, float32, n-gram speculation under the goodput controller) is shared by the module.
float32 keeps greedy decoding free of the bf16 near-ties that batching changes, so HTTP results can be
compared token for token with offline `LLM.generate`.
"""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest
from live_server import LiveServer, live_server
from spec_prompts import SPEC_PROMPTS

from turbospec import LLM, SamplingParams
from turbospec.config import EngineConfig
from turbospec.engine import LLMEngine
from turbospec.server.async_engine import GIL_SWITCH_INTERVAL_S
from turbospec.tuning import build_engine

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
CONFIG = {"dtype": "float32", "num_threads": 1, "max_model_len": 512}
SPEC = {"method": "ngram", "max_speculative_tokens": 6}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    engine = build_engine(EngineConfig(MODEL, speculative_config=SPEC, **CONFIG), progress=False)
    with live_server(engine, MODEL) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(server: LiveServer) -> LLM:
    """Plain decoding (no speculation) on the same weights."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("turbospec.engine.load_model", lambda *args, **kwargs: server.engine.loaded)
        return LLM(MODEL, progress=False, **CONFIG)


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one series in a Prometheus scrape (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_idle(engine: LLMEngine, timeout: float = 10.0) -> None:
    """Wait until no request is left and every KV block is free (blocks holding only cached prefixes are free)."""
    import time

    deadline = time.monotonic() + timeout
    while engine.requests or engine.blocks.usage() > 0:
        assert time.monotonic() < deadline, f"still busy: {list(engine.requests)}, usage {engine.blocks.usage()}"
        time.sleep(0.05)


# --- the OpenAI client -----------------------------------------------------------------------------------------

def test_models_and_health(client: openai.OpenAI, server: LiveServer) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_a_running_server_hands_the_gil_back_to_its_engine_thread_quickly(server: LiveServer) -> None:
    """The engine thread takes the GIL back after every torch operator; at Python's default switch interval (5 ms)
    the event loop's thread could hold it that long each time (AsyncEngine.start shortens it)."""
    assert sys.getswitchinterval() <= GIL_SWITCH_INTERVAL_S < 0.005


def test_completion_matches_offline_greedy(client: openai.OpenAI, offline: LLM) -> None:
    prompt = SPEC_PROMPTS[0]
    want = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.prompt_tokens == len(offline.get_tokenizer().encode(prompt))


def test_chat_streamed_equals_unstreamed_and_offline(client: openai.OpenAI, offline: LLM) -> None:
    messages = [{"role": "user", "content": "List three primary colours."}]
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0].outputs[0]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0)
    assert full.choices[0].message.content == want.text
    assert full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason


def test_streamed_completion_with_logprobs_and_stop(client: openai.OpenAI, offline: LLM) -> None:
    prompt = SPEC_PROMPTS[2]
    want = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop=[" 9"], logprobs=2),
                            use_tqdm=False)[0].outputs[0]
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=[" 9"],
                                       logprobs=2, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "stop"
    got_lp = [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    want_lp = [step[t].logprob for t, step in zip(want.token_ids, want.logprobs)]
    assert got_lp == pytest.approx(want_lp, abs=1e-4)


def test_sixteen_concurrent_clients_get_offline_greedy_results(server: LiveServer, offline: LLM) -> None:
    prompts = [f"{p} ({i})" for i in range(4) for p in SPEC_PROMPTS[:4]]
    assert len(prompts) == 16
    want = [o.outputs[0].text for o in
            offline.generate(prompts, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)]

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=300) as c:
            async def one(i: int, p: str) -> str:
                if i % 2:  # half streamed, half not
                    stream = await c.completions.create(model=MODEL, prompt=p, max_tokens=20, temperature=0,
                                                        stream=True)
                    return "".join([chunk.choices[0].text async for chunk in stream])
                out = await c.completions.create(model=MODEL, prompt=p, max_tokens=20, temperature=0)
                return out.choices[0].text
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    assert asyncio.run(run()) == want
    wait_idle(server.engine)


def test_n_choices_and_seeds(client: openai.OpenAI, offline: LLM) -> None:
    kw = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "n": 3, "seed": 7}
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1  # seed + j per choice: not three copies
    assert 3 <= a.usage.completion_tokens <= 36
    assert a.usage.prompt_tokens == len(offline.get_tokenizer().encode("Once upon a time"))  # counted once


def test_prompt_batch_echo_and_token_ids(client: openai.OpenAI, offline: LLM) -> None:
    ids = offline.get_tokenizer().encode("The capital of France is")
    texts = client.completions.create(model=MODEL, prompt=["Hello, my name is", "I like"], max_tokens=5,
                                      temperature=0, echo=True)
    assert [c.index for c in texts.choices] == [0, 1]
    assert texts.choices[0].text.startswith("Hello, my name is") and texts.choices[1].text.startswith("I like")
    tokens = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=5, temperature=0, echo=True)
    assert tokens.choices[0].text.startswith(offline.get_tokenizer().decode(ids))
    assert tokens.choices[0].text == tokens.choices[1].text


def test_chat_logprobs_shape(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                         temperature=0, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the chosen token is top-1


def test_tokenize_roundtrip(server: LiveServer, offline: LLM) -> None:
    text = "Speculative decoding is fun."
    tok = httpx.post(server.url + "/tokenize", json={"prompt": text}).json()
    assert tok["tokens"] == offline.get_tokenizer().encode(text) and tok["count"] == len(tok["tokens"])
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": text}]}).json()
    assert chat["tokens"] == offline.get_tokenizer().apply_chat_template([{"role": "user", "content": text}])
    back = httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json()
    assert back["prompt"] == text


# --- speculation and metrics ------------------------------------------------------------------------------------

def test_metrics_count_what_the_clients_saw(client: openai.OpenAI, server: LiveServer) -> None:
    before = httpx.get(server.url + "/metrics").text
    outs = [client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0) for p in SPEC_PROMPTS[:3]]
    after = httpx.get(server.url + "/metrics").text
    generated = sum(o.usage.completion_tokens for o in outs)
    prompt = sum(o.usage.prompt_tokens for o in outs)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("turbospec:generation_tokens_total") == generated
    assert delta("turbospec:prompt_tokens_total") == prompt
    assert delta("turbospec:time_to_first_token_seconds_count") == 3
    assert delta("turbospec:e2e_request_latency_seconds_count") == 3
    assert delta("turbospec:request_queue_time_seconds_count") == 3
    # every token after the first has an inter-token latency
    assert delta("turbospec:inter_token_latency_seconds_count") == generated - 3
    reasons = delta("turbospec:request_success_total", finished_reason="length") + \
        delta("turbospec:request_success_total", finished_reason="stop")
    assert reasons == 3
    # speculation: the repetition prompt gives the n-gram proposer material; the controller reports its choices
    drafts, accepted = delta("turbospec:spec_decode_num_draft_tokens_total"), \
        delta("turbospec:spec_decode_num_accepted_tokens_total")
    assert drafts >= accepted > 0
    per_pos = sum(metric(after, "turbospec:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
                  for p in range(8))
    assert per_pos == metric(after, "turbospec:spec_decode_num_accepted_tokens_total")
    assert delta("turbospec:spec_decode_chosen_k_count") >= generated / 7  # one per decoding request-step
    assert 0 < metric(after, "turbospec:spec_decode_acceptance_estimate") <= 1
    assert re.search(r'^turbospec:num_requests_running\{model_name="smollm2-135m"\} 0\.0$', after, re.MULTILINE)


def test_speculation_can_be_turned_off_per_request(server: LiveServer) -> None:
    engine = server.engine
    body = {"model": MODEL, "prompt": SPEC_PROMPTS[1], "max_tokens": 40, "temperature": 0}
    on = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
    drafts = engine.speculation.stats.num_draft_tokens
    off = httpx.post(server.url + "/v1/completions", json={**body, "speculation": False}, timeout=120).json()
    assert engine.speculation.stats.num_draft_tokens == drafts  # not one draft verified for it
    assert off["choices"][0]["text"] == on["choices"][0]["text"]



def _stream_events(server: LiveServer, path: str, body: dict) -> list[dict]:
    import json

    with httpx.stream("POST", server.url + path, json={"model": MODEL, "stream": True, **body}, timeout=120) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_stream_chunks_say_how_many_of_their_tokens_were_accepted_drafts(server: LiveServer) -> None:
    """An extension field OpenAI clients ignore: per chunk, the accepted drafts among its tokens; their sum is the
    server's accepted-token count for the request, and a request without speculation has none."""
    engine = server.engine

    def stream(extra: dict) -> list[int]:
        body = {"prompt": SPEC_PROMPTS[1], "max_tokens": 40, "temperature": 0}
        events = _stream_events(server, "/v1/completions", {**body, **extra})
        return [e["choices"][0]["accepted_draft_tokens"] for e in events if e["choices"]]

    before = engine.speculation.stats.num_accepted_tokens
    counts = stream({})
    assert sum(counts) == engine.speculation.stats.num_accepted_tokens - before > 0  # the prompt repeats itself
    assert max(counts) >= 1 and min(counts) >= 0
    assert sum(stream({"speculation": False})) == 0


def test_stream_chunks_mark_each_tokens_text_as_accepted_draft_or_target(server: LiveServer) -> None:
    """Each chunk is one engine step: its tokens are the accepted drafts first, then the target's own token. Its
    text_origins cut its text at exactly that boundary (checked against the chunk's per-token log-prob entries),
    and proposed_draft_tokens sums to the drafts the server verified for the request."""
    stats = server.engine.speculation.stats
    before = stats.num_draft_tokens, stats.num_accepted_tokens
    messages = [{"role": "user", "content": SPEC_PROMPTS[1]}]
    events = _stream_events(server, "/v1/chat/completions",
                            {"messages": messages, "max_tokens": 40, "temperature": 0, "logprobs": True})
    steps = [c for e in events for c in e["choices"] if "proposed_draft_tokens" in c]
    hidden = {server.engine.tokenizer.token_text(t) for t in server.engine.tokenizer.eos_token_ids}  # no text
    for c in steps:
        tokens = [t["token"] if t["token"] not in hidden else "" for t in c["logprobs"]["content"]]
        drafts = c["accepted_draft_tokens"]
        by_origin = {o: "".join(r["text"] for r in c["text_origins"] if r["origin"] == o) for o in ("draft", "target")}
        assert by_origin == {"draft": "".join(tokens[:drafts]), "target": "".join(tokens[drafts:])}, c
        assert "".join(r["text"] for r in c["text_origins"]) == c["delta"].get("content", "")
        assert 0 <= drafts <= c["proposed_draft_tokens"]
    assert sum(c["proposed_draft_tokens"] for c in steps) == stats.num_draft_tokens - before[0]
    assert sum(c["accepted_draft_tokens"] for c in steps) == stats.num_accepted_tokens - before[1] > 0
    assert any(r["origin"] == "draft" for c in steps for r in c["text_origins"])
    echoed = _stream_events(server, "/v1/completions", {"prompt": SPEC_PROMPTS[1], "max_tokens": 8, "echo": True})
    first = echoed[0]["choices"][0]
    assert first["text_origins"][0] == {"text": SPEC_PROMPTS[1], "origin": "prompt"}
    assert all("".join(r["text"] for r in e["choices"][0]["text_origins"]) == e["choices"][0]["text"] for e in echoed)


def test_a_character_split_between_drafts_and_the_target_token_is_the_targets(server: LiveServer) -> None:
    """Incremental detokenising holds back a character whose bytes are not all there yet: when the accepted drafts
    end inside one, the target token that completes it gets the whole character."""
    from turbospec.models.tokenizer import IncrementalDetokenizer
    from turbospec.output_assembly import OutputAssembler
    from turbospec.request import Request

    tok = server.engine.tokenizer
    ids = tok.encode(" the cat \U0001f408 sat", add_special_tokens=False)
    cut = max(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))  # drafts end mid-character
    assembler = OutputAssembler(tok, None, 512, lambda _: None)  # (no stop, no finish: nothing reaches them)
    req = Request("r", [1], SamplingParams(max_tokens=64), IncrementalDetokenizer(tok), None)
    out = assembler.append(req, [(t, None) for t in ids[:cut + 1]], 0.0, accepted_drafts=cut, proposed_drafts=5)
    assert tok.decode(ids[:cut + 1]).endswith("\U0001f408") and out.delta_text == tok.decode(ids[:cut + 1])
    drafted = "".join(t for t, d in out.delta_text_runs if d)
    assert drafted and "\ufffd" not in drafted and out.delta_text.startswith(drafted)
    target = out.delta_text_runs[-1]
    assert target == (out.delta_text[len(drafted):], False) and "\U0001f408" in target[0]
    assert (out.delta_accepted_drafts, out.delta_proposed_drafts) == (cut, 5)
    rest = assembler.append(req, [(t, None) for t in ids[cut + 1:]], 0.0)
    assert rest.delta_text_runs == [(rest.delta_text, False)] and rest.delta_text.endswith("sat")


def test_the_page_at_root_is_self_contained_and_its_stats_route_counts_drafts(server: LiveServer) -> None:
    """GET / serves the chat page with nothing loaded from elsewhere (no CDN); GET /stats, which the page polls,
    counts the tokens and accepted drafts the server produced."""
    import re

    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    assert "<script>" in html and "/v1/chat/completions" in html and "accepted_draft_tokens" in html
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html), "the page loads something from elsewhere"
    before = httpx.get(server.url + "/stats").json()
    body = {"model": MODEL, "prompt": SPEC_PROMPTS[1], "max_tokens": 24, "temperature": 0}
    httpx.post(server.url + "/v1/completions", json=body, timeout=120).raise_for_status()
    after = httpx.get(server.url + "/stats").json()
    assert after["model"] == MODEL and after["speculation"].startswith("ngram")
    assert after["generation_tokens"] - before["generation_tokens"] == 24
    assert after["accepted_tokens"] > before["accepted_tokens"] and after["running"] == 0


# --- bad input ----------------------------------------------------------------------------------------------------

BAD_REQUESTS = [
    ("/v1/completions", b'{"prompt": "x", ', None, "not valid JSON"),
    ("/v1/completions", b'["a list"]', None, "JSON object"),
    ("/v1/completions", {"max_tokens": 3}, "prompt", "required"),
    ("/v1/chat/completions", {"model": MODEL}, "messages", "required"),
    ("/v1/chat/completions", {"messages": []}, "messages", "at least 1"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", "user"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content", ""),
    ("/v1/completions", {"prompt": 42}, "prompt", "must be a string"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature", "number"),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens", "integer"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p", "less than or equal to 1"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature", "greater than or equal to 0"),
    ("/v1/completions", {"prompt": "x", "n": 100}, "n", "less than or equal to 16"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, "logprobs", "less than or equal to 20"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop", "non-empty"),
    ("/v1/completions", {"prompt": "x", "stop": [1, 2]}, "stop", "must be a string"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10_000}, "max_tokens", "max_model_len"),
    ("/v1/completions", {"prompt": "word " * 600}, "prompt", "context"),
    ("/v1/completions", {"prompt": [10**9]}, "prompt", "token ids"),
    ("/v1/completions", {"prompt": []}, "prompt", "empty"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 0.5}, "frequency_penalty", "not supported"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 5}}, "logit_bias", "not supported"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1}, "echo", "prompt log-probs"),
    ("/v1/completions", {"prompt": "x", "tools": []}, "tools", "unsupported field"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, None, "only allowed"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs",
     "needs logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_xml"}}, "response_format.type", "json_schema"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, None, "exactly one"),
    ("/detokenize", {"tokens": [10**7]}, "tokens", "ids in"),
]


@pytest.mark.parametrize(("path", "body", "param", "words"), BAD_REQUESTS,
                         ids=[f"{p}:{(b if isinstance(b, bytes) else str(b))[:40]!r}" for p, b, _, _ in BAD_REQUESTS])
def test_bad_input_gets_400_with_openai_error(server: LiveServer, path: str, body: object, param: str | None,
                                              words: str) -> None:
    if isinstance(body, bytes):
        r = httpx.post(server.url + path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = httpx.post(server.url + path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert words.lower() in error["message"].lower()


def test_unknown_model_is_404_and_unknown_route_is_openai_shaped(client: openai.OpenAI, server: LiveServer) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-5", prompt="x", max_tokens=2)
    assert "does not exist" in str(info.value)
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "message" in r.json()["error"]


# --- disconnects ----------------------------------------------------------------------------------------------------

def aborted(server: LiveServer) -> float:
    return metric(httpx.get(server.url + "/metrics").text, "turbospec:request_success_total", finished_reason="abort")


def test_disconnect_mid_stream_aborts_and_frees_kv(server: LiveServer) -> None:
    wait_idle(server.engine)
    before = aborted(server)
    body = {"model": MODEL, "prompt": "Count forever:", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", server.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            assert server.engine.requests  # running
        # leaving the block closes the connection mid-stream; 400 tokens would take far longer than 3 s
    wait_idle(server.engine, timeout=3)
    assert aborted(server) == before + 1


def test_disconnect_while_waiting_for_a_full_response_aborts(server: LiveServer) -> None:
    wait_idle(server.engine)
    before = aborted(server)
    body = {"model": MODEL, "prompt": "Count forever:", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=1.0)
    wait_idle(server.engine, timeout=3)
    assert aborted(server) == before + 1
