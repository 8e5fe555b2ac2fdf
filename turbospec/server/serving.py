"""What the completion endpoints do between the HTTP layer and the async engine: turn a validated request into
engine jobs (one per prompt and choice), run them, and shape the results as a response or a stream."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from ..structured.grammar import GrammarError
from ..structured.params import StructuredOutputsParams
from ..structured.tools import ToolCallStream, call_schema, parse_tool_calls, system_prompt, tool_grammar
from .async_engine import AsyncEngine, EngineDead, EngineOverloaded, RequestFailed, RequestTooLarge, Reservation
from .errors import APIError, bad_request, error_body, param_of
from .protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, UnsupportedValue, _SamplingFields
from .responses import chat_logprobs, completion_logprobs, sse, usage

log = logging.getLogger("turbospec.server")

DISCONNECT_POLL_S = 0.5
SHUTTING_DOWN = "the request was aborted: the server is shutting down"
GENERATION_FAILED = "generation failed inside the server (its log has the details); other requests are unaffected"
SAMPLING_FIELDS = set(SamplingParams.__dataclass_fields__)
IsDisconnected = Callable[[], Awaitable[bool]]


@dataclass
class Job:
    """One engine request: a prompt and one of its n choices."""

    index: int  # the choice index in the response
    prompt_index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    echo: str = ""  # completions with echo: the prompt text, put before the first delta


@dataclass
class _ChoiceState:
    text_len: int = 0  # characters sent so far (the logprobs' text offsets)
    tokens: int = 0
    started: bool = False


@dataclass
class _Run:
    jobs: list[Job]
    speculate: bool
    arrival: float
    deterministic: str | None = None
    acceptance: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    reservation: Reservation | None = None  # the engine seats its jobs were admitted with


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len

    # --- validation ---------------------------------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist: this server serves {self.model_name!r}",
                           "not_found_error", "model", "model_not_found")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except Exception as exc:  # a tokenizer failure is this request's problem only
            log.info("tokenizer refused a prompt: %s: %s", type(exc).__name__, exc)
            raise bad_request("the prompt could not be tokenized: it must be valid Unicode text (no lone surrogate "
                              "code points)", "prompt") from exc

    def chat_ids(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                 tools: list[dict[str, Any]] | None = None) -> list[int]:
        turns = [m.as_template_message() for m in messages]
        if tools and not self.tokenizer.template_has_tools:  # the template ignores tools: say them in a system turn
            if turns[0]["role"] == "system":
                turns[0] = {**turns[0], "content": f"{turns[0]['content']}\n\n{system_prompt(tools)}"}
            else:
                turns.insert(0, {"role": "system", "content": system_prompt(tools)})
            tools = None
        try:
            return self.tokenizer.apply_chat_template(turns, add_generation_prompt=add_generation_prompt, tools=tools)
        except Exception as exc:  # templates raise for bad role orders and more
            raise bad_request(f"the chat template refused these messages: {exc}", "messages") from exc

    def make_jobs(self, req: _SamplingFields, prompts: list[list[int]], logprobs: int | None,
                  max_tokens: int | None, echo: list[str] | None = None,
                  tool_ask: StructuredOutputsParams | None = None) -> list[Job]:
        try:
            req.check_supported()
            ask = tool_ask or req.structured_ask()
        except UnsupportedValue as exc:
            raise bad_request(str(exc), exc.param) from exc
        try:
            determinism = self.engine.engine.request_determinism(req.deterministic)
        except ValueError as exc:
            raise bad_request(str(exc), "deterministic") from exc
        try:
            self.engine.engine.request_acceptance(req.acceptance, determinism)
        except ValueError as exc:
            raise bad_request(str(exc), "acceptance") from exc
        base = uuid.uuid4().hex
        jobs: list[Job] = []
        for p, ids in enumerate(prompts):
            if len(ids) >= self.max_model_len:
                raise bad_request(f"the prompt has {len(ids)} tokens, but this server's context is "
                                  f"{self.max_model_len} tokens (prompt plus output)", "prompt")
            try:
                # no max_tokens: whatever the context leaves, as vLLM does
                params = req.sampling_params(max_tokens or self.max_model_len - len(ids), logprobs, ask)
                self.engine.engine.check_prompt(ids, params)
                if p == 0 and ask is not None:  # (the same ask for every prompt)
                    self.engine.engine.check_structured(params, determinism)
            except GrammarError as exc:
                raise bad_request(str(exc), "tools" if tool_ask else req.structured_param) from exc
            except ValueError as exc:
                message = str(exc)
                raise bad_request(message, param_of(message, SAMPLING_FIELDS) or
                                  ("max_tokens" if "max_tokens" in message else "prompt")) from exc
            for j in range(req.n):
                seed = None if req.seed is None else req.seed + j  # n seeded choices must differ
                jobs.append(Job(p * req.n + j, p, f"{base}-{p}-{j}", ids,
                                params if req.n == 1 else params.clone(seed=seed), echo[p] if echo else ""))
        return jobs

    def admit(self, run: _Run) -> _Run:
        """Hold engine seats for every job of the run now, or refuse the whole request (on the event loop: the
        seats are counted there)."""
        try:
            run.reservation = self.engine.reserve(len(run.jobs))
        except RequestTooLarge as exc:
            raise bad_request(str(exc), "n") from exc
        except (EngineOverloaded, EngineDead) as exc:
            raise _engine_error(exc) from exc
        return run

    # --- running jobs ----------------------------------------------------------------------------------------

    async def _outputs(self, run: _Run) -> AsyncIterator[tuple[Job, RequestOutput]]:
        """Every job's outputs, interleaved as they come. Leaving early cancels (and so aborts) all of them."""
        merged: asyncio.Queue[tuple[Job, RequestOutput] | BaseException | None] = asyncio.Queue()

        async def pump(job: Job) -> None:
            try:
                async for out in self.engine.generate(job.request_id, job.prompt_ids, job.params,
                                                      run.speculate, run.arrival, run.deterministic,
                                                      run.acceptance, run.reservation):
                    merged.put_nowait((job, out))
            except Exception as exc:  # handed to the consumer, which decides
                merged.put_nowait(exc)
            finally:
                merged.put_nowait(None)

        tasks = [asyncio.create_task(pump(job)) for job in run.jobs]
        try:
            remaining = len(tasks)
            while remaining:
                item = await merged.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if run.reservation is not None:
                run.reservation.release()

    async def collect(self, run: _Run, is_disconnected: IsDisconnected) -> list[RequestOutput]:
        """Run to completion, one final output per job; abort everything if the client goes away."""
        finals: dict[int, RequestOutput] = {}

        async def consume() -> None:
            async for job, out in self._outputs(run):
                if out.finished:
                    finals[job.index] = out

        task = asyncio.create_task(consume())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if not task.done() and await is_disconnected():
                    task.cancel()
                    raise APIError(499, "the client disconnected", "client_closed_request")
            task.result()
        except APIError:
            raise
        except Exception as exc:  # the engine's refusals and failures, in the client's terms
            raise _engine_error(exc) from exc
        finally:
            if not task.done():
                task.cancel()
        outs = [finals[job.index] for job in run.jobs]
        for out in outs:
            reason = out.outputs[0].finish_reason
            if reason == "error":
                log.error("request %s failed: %s", out.request_id, out.error)
                raise APIError(500, GENERATION_FAILED, "internal_server_error")
            if reason == "abort":
                raise APIError(503, SHUTTING_DOWN, "server_error")
        return outs

    # --- /v1/completions ------------------------------------------------------------------------------------

    def completion_run(self, req: CompletionRequest, arrival: float) -> _Run:
        self.check_model(req.model)
        try:
            raw = req.prompts()
        except UnsupportedValue as exc:
            raise bad_request(str(exc), exc.param) from exc
        prompts = [self.encode(p) if isinstance(p, str) else p for p in raw]
        echo = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in raw] if req.echo else None
        return _Run(self.make_jobs(req, prompts, req.logprobs, req.max_tokens, echo), req.speculation, arrival,
                    req.deterministic, req.acceptance)

    async def completion(self, req: CompletionRequest, run: _Run, is_disconnected: IsDisconnected) -> dict[str, Any]:
        outs = await self.collect(run, is_disconnected)
        choices = []
        for job, out in zip(run.jobs, outs):
            c = out.outputs[0]
            choices.append({
                "index": job.index, "text": job.echo + c.text,
                "logprobs": None if c.logprobs is None else
                completion_logprobs(c.token_ids, c.logprobs, self.tokenizer.token_text, len(job.echo)),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
            })
        return {**self._envelope("cmpl", "text_completion", run), "choices": choices, "usage": self._usage(run, outs),
                **_acceptance_meta(outs)}

    async def completion_stream(self, req: CompletionRequest, run: _Run) -> AsyncIterator[str]:
        states = {job.index: _ChoiceState() for job in run.jobs}
        chunk = self._chunker("cmpl", "text_completion", run, req)

        async for job, out in self._guarded(run):
            if isinstance(out, str):
                yield out
                return
            st, c = states[job.index], out.outputs[0]
            text = out.delta_text if st.started else job.echo + out.delta_text
            logprobs = None
            if c.logprobs is not None and out.delta_token_ids:
                n = len(out.delta_token_ids)
                logprobs = completion_logprobs(out.delta_token_ids, c.logprobs[len(c.logprobs) - n:],
                                               self.tokenizer.token_text, st.text_len)
            origins = _text_origins(out)
            if not st.started and job.echo:
                origins.insert(0, _origin(job.echo, "prompt"))
            st.started, st.text_len, st.tokens = True, st.text_len + len(text), len(c.token_ids)
            if text or out.finished or out.delta_token_ids:  # (logprobs come with tokens)
                yield chunk([{"index": job.index, "text": text, "logprobs": logprobs,
                              "finish_reason": c.finish_reason if out.finished else None,
                              "stop_reason": c.stop_reason if out.finished else None, **_step_fields(out, origins)}],
                            _acceptance_meta([out]) if out.finished else None)
        if req.include_usage:
            yield chunk([], {"usage": self._stream_usage(run, states)})
        yield sse("[DONE]")

    # --- /v1/chat/completions -------------------------------------------------------------------------------

    def chat_run(self, req: ChatCompletionRequest, arrival: float) -> _Run:
        self.check_model(req.model)
        tools = [t.model_dump(by_alias=True, exclude_none=True) for t in req.tools] if req.tools else None
        for i, tool in enumerate(tools or []):  # a bad parameters schema is refused even where nothing forces calls
            try:
                self.engine.engine.check_structured(
                    SamplingParams(structured_outputs=StructuredOutputsParams(json=call_schema(tool))))
            except ValueError as exc:
                raise bad_request(f"tools[{i}] ({tool['function']['name']}): its parameters are not a usable JSON "
                                  f"schema: {exc}", "tools") from exc
        forced = req.forced_tools
        ids = self.chat_ids(req.messages, req.add_generation_prompt, tools)  # ("none" too: the history may call them)
        tool_ask = tool_grammar(forced, self.tokenizer, many=req.tool_choice == "required") if forced else None
        return _Run(self.make_jobs(req, [ids], req.num_logprobs, req.requested_max_tokens, tool_ask=tool_ask),
                    req.speculation, arrival, req.deterministic, req.acceptance)

    async def chat(self, req: ChatCompletionRequest, run: _Run, is_disconnected: IsDisconnected) -> dict[str, Any]:
        outs = await self.collect(run, is_disconnected)
        choices = []
        for job, out in zip(run.jobs, outs):
            c = out.outputs[0]
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            finish_reason = c.finish_reason
            if req.calls_tools:
                content, calls = parse_tool_calls(c.text, req.tool_names)
                if calls:
                    message = {"role": "assistant", "content": content,
                               "tool_calls": [call.as_openai() for call in calls]}
                    finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
            choices.append({
                "index": job.index, "message": message,
                "logprobs": None if c.logprobs is None else
                chat_logprobs(c.token_ids, c.logprobs, self.tokenizer.token_text, req.top_logprobs or 0),
                "finish_reason": finish_reason, "stop_reason": c.stop_reason,
            })
        return {**self._envelope("chatcmpl", "chat.completion", run), "choices": choices,
                "usage": self._usage(run, outs), **_acceptance_meta(outs)}

    async def chat_stream(self, req: ChatCompletionRequest, run: _Run) -> AsyncIterator[str]:
        states = {job.index: _ChoiceState() for job in run.jobs}
        chunk = self._chunker("chatcmpl", "chat.completion.chunk", run, req)
        calls = {job.index: ToolCallStream(req.tool_names) for job in run.jobs} if req.calls_tools else {}

        for job in run.jobs:  # the role comes first, as OpenAI sends it
            yield chunk([{"index": job.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None, "stop_reason": None}])
        async for job, out in self._guarded(run):
            if isinstance(out, str):
                yield out
                return
            st, c = states[job.index], out.outputs[0]
            logprobs = None
            if c.logprobs is not None and out.delta_token_ids:
                n = len(out.delta_token_ids)
                logprobs = chat_logprobs(out.delta_token_ids, c.logprobs[len(c.logprobs) - n:],
                                         self.tokenizer.token_text, req.top_logprobs or 0)
            st.tokens = len(c.token_ids)
            delta: dict[str, Any] = {"content": out.delta_text} if out.delta_text else {}
            origins = _text_origins(out)
            finish_reason = c.finish_reason
            if job.index in calls:  # tool calls: content up to the first call, the calls once complete
                stream = calls[job.index]
                text, found = stream.feed(out.delta_text), []
                if out.finished:
                    rest, found = stream.finish()
                    text += rest
                delta = {"content": text} if text else {}
                if found:
                    delta["tool_calls"] = [call.as_openai(i) for i, call in enumerate(found)]
                    finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
                if text != out.delta_text:  # (held or released text: its origins are no longer this step's)
                    origins = [_origin(text, "target")] if text else []
            if delta or out.finished or logprobs or out.delta_token_ids:
                yield chunk([{"index": job.index, "delta": delta,
                              "logprobs": logprobs, "finish_reason": finish_reason if out.finished else None,
                              "stop_reason": c.stop_reason if out.finished else None,
                              **_step_fields(out, origins)}],
                            _acceptance_meta([out]) if out.finished else None)
        if req.include_usage:
            yield chunk([], {"usage": self._stream_usage(run, states)})
        yield sse("[DONE]")

    # --- shared ------------------------------------------------------------------------------------------------

    def _envelope(self, id_prefix: str, object_name: str, run: _Run) -> dict[str, Any]:
        return {"id": f"{id_prefix}-{uuid.uuid4().hex}", "object": object_name, "created": run.created,
                "model": self.model_name}

    def _chunker(self, id_prefix: str, object_name: str, run: _Run, req: _SamplingFields
                 ) -> Callable[[list[dict[str, Any]], dict[str, Any] | None], str]:
        """One SSE chunk per call, all under the same id; with include_usage, OpenAI puts "usage": null on every
        chunk but the last, which carries the totals (passed as `extra`)."""
        envelope = self._envelope(id_prefix, object_name, run)

        def chunk(choices: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> str:
            extra = extra or {}
            usage_field = {} if "usage" in extra or not req.include_usage else {"usage": None}
            return sse({**envelope, "choices": choices, **usage_field, **extra})

        return chunk

    async def _guarded(self, run: _Run) -> AsyncIterator[tuple[Job, RequestOutput | str]]:
        """The run's outputs for a stream; a failure becomes an error event and the stream's end, because
        the 200 status has already been sent."""
        try:
            async for job, out in self._outputs(run):
                reason = out.outputs[0].finish_reason
                if reason in ("error", "abort"):
                    if reason == "error":
                        log.error("request %s failed: %s", out.request_id, out.error)
                    message = GENERATION_FAILED if reason == "error" else SHUTTING_DOWN
                    yield job, sse(error_body(message, "server_error")) + sse("[DONE]")
                    return
                yield job, out
        except Exception as exc:  # (any failure: a stream must end with an error event, never just stop)
            err = _engine_error(exc)
            yield run.jobs[0], sse(err.body()) + sse("[DONE]")

    @staticmethod
    def _usage(run: _Run, outs: list[RequestOutput]) -> dict[str, int]:
        return usage(_prompt_tokens(run), sum(len(o.outputs[0].token_ids) for o in outs))

    @staticmethod
    def _stream_usage(run: _Run, states: dict[int, _ChoiceState]) -> dict[str, int]:
        return usage(_prompt_tokens(run), sum(s.tokens for s in states.values()))


def _step_fields(out: RequestOutput, origins: list[dict[str, str]]) -> dict[str, Any]:
    """Extension fields on a streamed choice, which OpenAI clients ignore. Every engine step that produced tokens
    sends a chunk (its text may be empty while held back), so these count per step: the drafts it verified, those
    accepted (the first of its tokens), and its text in runs by origin ("draft": accepted drafts, "target": the
    target's own token; "prompt": a completion's echo), which concatenate to the chunk's text."""
    return {"accepted_draft_tokens": out.delta_accepted_drafts, "proposed_draft_tokens": out.delta_proposed_drafts,
            "text_origins": origins}


def _text_origins(out: RequestOutput) -> list[dict[str, str]]:
    return [_origin(text, "draft" if drafted else "target") for text, drafted in out.delta_text_runs]


def _origin(text: str, origin: str) -> dict[str, str]:
    return {"text": text, "origin": origin}


def _acceptance_meta(outs: list[RequestOutput]) -> dict[str, Any]:
    """A response under any acceptance policy but the lossless default says which, whether it is lossless, and
    how many tokens were kept only by its relaxed rule (streams: on each choice's last chunk)."""
    if not outs or outs[0].acceptance == "exact":
        return {}
    return {"acceptance": {"policy": outs[0].acceptance, "lossless": outs[0].lossless,
                           "relaxed_tokens": sum(o.relaxed_tokens for o in outs)}}


def _prompt_tokens(run: _Run) -> int:
    """Each prompt's tokens count once in usage, however many choices it has."""
    return sum({job.prompt_index: len(job.prompt_ids) for job in run.jobs}.values())


def _engine_error(exc: Exception) -> APIError:
    if isinstance(exc, RequestFailed):
        return APIError(400, str(exc), "invalid_request_error")
    if isinstance(exc, EngineDead):
        return APIError(503, str(exc), "server_error", code="engine_dead")
    if isinstance(exc, EngineOverloaded):
        return APIError(503, str(exc), "overloaded_error", code="server_overloaded")
    log.exception("request failed inside the server", exc_info=exc)
    return APIError(500, "the server failed while generating this request", "internal_server_error")
