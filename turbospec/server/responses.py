"""OpenAI response and stream-chunk bodies built from engine outputs."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ..outputs import Logprob

TokenText = Callable[[int], str]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def completion_logprobs(token_ids: list[int], steps: list[dict[int, Logprob]], token_text: TokenText,
                        text_offset: int) -> dict[str, Any]:
    """The legacy completions shape: parallel lists of tokens, their log-probs, the top alternatives and the
    character offset of each token in the completion text."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = text_offset
    for tok, step in zip(token_ids, steps):
        text = token_text(tok)
        tokens.append(text)
        token_logprobs.append(step[tok].logprob)
        top.append({token_text(t): lp.logprob for t, lp in step.items()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(token_ids: list[int], steps: list[dict[int, Logprob]], token_text: TokenText,
                  num_top: int) -> dict[str, Any]:
    """The chat shape: one entry per token with its top alternatives ordered by rank."""
    content = []
    for tok, step in zip(token_ids, steps):
        ranked = sorted(((lp.rank, t, lp) for t, lp in step.items() if lp.rank is not None), key=lambda e: e[0])
        content.append({
            **_chat_token(token_text(tok), step[tok].logprob),
            "top_logprobs": [_chat_token(token_text(t), lp.logprob) for _, t, lp in ranked[:num_top]],
        })
    return {"content": content}


def _chat_token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

