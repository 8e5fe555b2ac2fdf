"""The emit stage: appending a step's tokens to their requests, stop conditions (EOS, stop ids, max_tokens, stop
strings, checked token by token), incremental detokenising, log-probs attached, and the RequestOutput each step hands out."""

from __future__ import annotations

import time
from collections.abc import Callable

from .models.tokenizer import Tokenizer
from .outputs import CompletionOutput, Emitted, RequestMetrics, RequestOutput
from .request import Request
from .scheduler import Scheduler


class OutputAssembler:
    def __init__(self, tokenizer: Tokenizer, scheduler: Scheduler, max_model_len: int,
                 release: Callable[[Request], None]) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.release = release  # a finished request's KV, proposer and controller state

    def append(self, req: Request, tokens: Emitted, now: float, accepted_drafts: int = 0,
               proposed_drafts: int = 0) -> RequestOutput:
        """Append sampled tokens, checking stop conditions after each; returns the request's delta output (which
        says how many of its tokens were accepted drafts: the first `accepted_drafts` of `tokens`, out of the
        `proposed_drafts` this step verified)."""
        if req.first_token_time is None:
            req.first_token_time = now
        added: list[int] = []
        for i, (tok, lp) in enumerate(tokens):
            req.output_token_ids.append(tok)
            added.append(tok)
            if lp is not None and req.logprobs is not None:
                req.logprobs.append(lp)
                req.cumulative_logprob += lp[tok].logprob
            self._check_stop_token(req, tok)
            # token by token, as plain decoding does: no token after a stop string is kept, and each character
            # is known to come from an accepted draft or from the target
            self._check_stop_strings(req, self._detokenize(req, tok, i < accepted_drafts))
            if req.is_finished:
                break
        if req.is_finished:
            self.release(req)
        out = self.output(req, added)
        out.delta_accepted_drafts, out.delta_proposed_drafts = min(accepted_drafts, len(added)), proposed_drafts
        return out

    def _detokenize(self, req: Request, tok: int, drafted: bool) -> str:
        """Add `tok` to the request's text; for an accepted draft, record the characters it completed."""
        shown = self.text_ids(req, [tok])
        if not shown:
            return ""
        start = len(req.detokenizer.text)
        delta = req.detokenizer.add(shown)
        if drafted and delta:
            spans = req.drafted_chars
            if spans and spans[-1][1] == start:
                spans[-1] = (spans[-1][0], start + len(delta))
            else:
                spans.append((start, start + len(delta)))
        return delta

    @staticmethod
    def text_ids(req: Request, ids: list[int]) -> list[int]:
        """The ids whose text is shown: never EOS, and a stop token id only if the user asked for it (as vLLM)."""
        hide_stop = isinstance(req.stop_reason, int) and not req.params.include_stop_str_in_output
        stop_tok = req.stop_reason if hide_stop else None
        return [t for t in ids if t not in req.eos_token_ids and t != stop_tok]

    def _check_stop_token(self, req: Request, tok: int) -> bool:
        p = req.params
        reason: tuple[str, str | int | None] | None = None
        if tok in req.eos_token_ids:
            reason = ("stop", None)
        elif tok in p.stop_token_ids:
            reason = ("stop", tok)
        elif len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            reason = ("length", None)
        if reason:
            self.scheduler.finish(req, *reason)
        return reason is not None

    def _check_stop_strings(self, req: Request, delta: str) -> None:
        """Cut the text at the first stop string that the new delta completes, and finish the request."""
        if not req.params.stop or not delta:
            return
        text = req.detokenizer.text
        search_from = max(0, len(text) - len(delta) - max(len(s) for s in req.params.stop) + 1)
        hits = [(text.find(s, search_from), s) for s in req.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return
        idx, stop = min(hits)
        req.detokenizer.text = text[:idx + len(stop) if req.params.include_stop_str_in_output else idx]
        if not req.is_finished:
            self.scheduler.finish(req, "stop", stop)
        else:
            req.finish_reason, req.stop_reason = "stop", stop

    def output(self, req: Request, added: list[int]) -> RequestOutput:
        text = req.detokenizer.text
        if req.is_finished and not isinstance(req.stop_reason, str):
            # the windowed decode can hold back an incomplete character at the very end; settle it now
            text = self.tokenizer.decode(self.text_ids(req, req.output_token_ids), req.params.skip_special_tokens)
        # While a stop string could still complete, its possible start is held back: a stream must never send
        # text that the stop string later cuts away.
        hold = 0 if req.is_finished or not req.params.stop else max(len(s) for s in req.params.stop) - 1
        end = max(req.num_sent_chars, len(text) - hold)
        delta, start, req.num_sent_chars = text[req.num_sent_chars:end], req.num_sent_chars, end
        runs = text_runs(delta, start, req.drafted_chars)
        req.drafted_chars = [s for s in req.drafted_chars if s[1] > end]  # only unsent text needs its origin
        completion = CompletionOutput(
            index=0, text=text, token_ids=list(req.output_token_ids),
            cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
            logprobs=req.logprobs, finish_reason=req.finish_reason, stop_reason=req.stop_reason,
        )
        metrics = RequestMetrics(req.arrival_time, req.first_token_time,
                                 time.monotonic() if req.is_finished else None, req.num_cached_tokens,
                                 req.num_preemptions, req.first_scheduled_time)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion], req.is_finished,
                             metrics, delta, added, delta_text_runs=runs, acceptance=req.acceptance,
                             relaxed_tokens=req.relaxed_tokens)


def text_runs(text: str, offset: int, drafted: list[tuple[int, int]]) -> list[tuple[str, bool]]:
    """`text`, which starts at character `offset` of the output, cut into runs: (piece, True) where accepted drafts
    produced it, (piece, False) where the target did. `drafted`: sorted, disjoint [start, end) character spans."""
    runs: list[tuple[str, bool]] = []
    pos, end = offset, offset + len(text)
    for a, b in drafted:
        a, b = max(a, pos), min(b, end)
        if a >= b:
            continue
        if a > pos:
            runs.append((text[pos - offset:a - offset], False))
        runs.append((text[a - offset:b - offset], True))
        pos = b
    if pos < end:
        runs.append((text[pos - offset:], False))
    return runs
