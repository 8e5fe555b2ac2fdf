"""The offline API, shaped like vLLM's so users can switch: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from tqdm import tqdm

from .config import EngineConfig
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams
from .tuning import build_engine, set_speculation

PromptInput = str | list[int] | dict[str, Any]
Conversation = list[dict[str, Any]]


class LLM:
    """A model plus an engine that batches every prompt given to one call continuously.

    Engine options are EngineConfig's fields (``dtype``, ``max_model_len``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``block_size``, ``enable_prefix_caching``, ``kv_cache_memory_gib``,
    ``num_threads``, ``device``, ``seed``, ``speculative_config``, ``deterministic``, ``verify_window``,
    ``margin_threshold``, ``tensor_parallel_size``).
    """

    def __init__(self, model: str, progress: bool = True, **kwargs: Any) -> None:
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown LLM option(s) {unknown}: expected some of {sorted(known - {'model'})}")
        self.config = EngineConfig(model=model, **kwargs)
        self.progress = progress
        self.engine = build_engine(self.config, progress=progress)
        self._counter = 0

    def shutdown(self) -> None:
        """Stop what outlives a call (the other tensor-parallel ranks); also done when the LLM is collected."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *_: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def set_speculation(self, value: int | str) -> None:
        """0 turns speculation off, k >= 1 fixes the draft length, "auto" hands it to the goodput controller (its
        step-time model loaded, or profiled once, the first time)."""
        set_speculation(self.engine, value, self.progress)

    def spec_stats(self) -> dict[str, Any]:
        """Cumulative speculative decoding statistics (all zero when speculation is off), and the goodput
        controller's (chosen k distribution, acceptance estimate, predicted vs measured step time) when it runs."""
        return self.engine.spec_stats_dict()

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt; a prompt is a string, a list of token ids, or {"prompt_token_ids": [...]}."""
        batch = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(batch))
        entries = []
        for prompt, p in zip(batch, params):
            if isinstance(prompt, dict):
                if "prompt_token_ids" not in prompt and "prompt" not in prompt:
                    raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
                prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
            entries.append((prompt, p))
        return self._run(entries, use_tqdm)

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation and complete it."""
        if not messages:
            raise ValueError("messages is empty: give a list of {'role', 'content'} dicts")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        for conv in conversations:
            for m in conv:
                if not isinstance(m, dict) or "role" not in m or "content" not in m:
                    raise ValueError(f"each message needs 'role' and 'content', got {m!r}")
        tok = self.engine.tokenizer
        ids = [tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt) for c in conversations]
        return self.generate([{"prompt_token_ids": i} for i in ids], sampling_params, use_tqdm)

    def _run(self, entries: list[tuple[str | list[int], SamplingParams]], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        # n > 1 fans out into n engine requests (seeded ones get seed + j) and is merged back below.
        groups: list[list[str]] = []
        try:
            for prompt, p in entries:
                ids = []
                for j in range(p.n):
                    sub = p if p.n == 1 else p.clone(n=1, seed=None if p.seed is None else p.seed + j)
                    self._counter += 1
                    ids.append(engine.add_request(prompt, sub, request_id=f"llm-{self._counter}"))
                groups.append(ids)
        except Exception:
            for ids in groups:
                for rid in ids:
                    engine.abort_request(rid)
            raise
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=sum(len(g) for g in groups), desc="generate", unit="req", disable=not use_tqdm)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [_merge([final[rid] for rid in ids]) for ids in groups]


def _merge(parts: list[RequestOutput]) -> RequestOutput:
    first = parts[0]
    outs: list[CompletionOutput] = []
    for j, part in enumerate(parts):
        c = part.outputs[0]
        c.index = j
        outs.append(c)
    return RequestOutput(first.request_id, first.prompt, first.prompt_token_ids, outs, True, first.metrics,
                         acceptance=first.acceptance, relaxed_tokens=sum(p.relaxed_tokens for p in parts))


def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # type: ignore[arg-type]
    if isinstance(prompts, Sequence) and prompts:
        return list(prompts)
    raise ValueError("prompts is empty: give a string, a list of strings, or token id lists")


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts: give one, or one per prompt")
    return list(params)
