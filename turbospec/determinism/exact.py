"""Exact tokens for requests in a deterministic mode: positional sampling, LLM-42 replays, MarginGate re-checks.

Every request in a deterministic mode ("batch-invariant", "llm42", "margin-gate") samples the token at
position n with noise keyed by (its seed, n) and verifies drafts by equality with that sample, so its tokens do
not depend on how many tokens a step produced (k drafts, a replayed window) or on batch-mates' generators.
For one-hot drafts this rule accepts draft x with probability p(x), as rejection sampling does; a draft model's
own distribution is ignored (lower acceptance when sampling, never a different output).

- batch-invariant: every step runs the invariant kernels (the runner's flag); nothing else is needed.
- llm42 (LLM-42): decode on the fast path into ``Request.unverified_token_ids``. When a request holds
  ``window`` unverified tokens, or one of them would finish it, the window is replayed in one invariant pass
  over positions V-1 .. N-2 (V: verified tokens, N: all tokens), which overwrites their KV; the output is cut
  at the first token the replay disagrees with and continues from the replay's token. The KV before the last
  verified token is always the invariant path's, so the result equals the batch-invariant mode's output.
- margin-gate (MarginGate): fast-path tokens whose margin (top-1 minus top-2 score, in nats) is at least the
  calibrated threshold are final at once; a token below it is re-computed on the invariant path at its
  position (its KV column is overwritten) and replaced if the re-check disagrees. Exact only as far as the
  calibration holds: see determinism/calibrate.py.

Prefill chunks of llm42 and margin-gate requests run on the invariant path (the step is marked invariant),
and their prefix-cache blocks live under their own salt, so their context starts exact.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..outputs import Logprob, RequestOutput
from ..request import Request
from ..runner import SeqInput
from ..sampler import SamplingBatch, positional_sample, processed_probs

if TYPE_CHECKING:
    from ..engine import LLMEngine

VERIFIED_MODES = ("llm42", "margin-gate")
AUTO_WINDOW_MAX = 64
AUTO_WINDOW_MIN = 4
# prior for the auto window: one mismatch in PRIOR_TOKENS replayed tokens, replays costing PRIOR_STEPS steps
PRIOR_TOKENS = 200
PRIOR_STEPS = 2.0
COMPETITORS = 8  # calibration: the runner-up tokens whose gaps to the top token are watched
Emitted = list[tuple[int, "dict[int, Logprob] | None"]]


@dataclass
class PickedRows:
    """One request's logit rows in a step: rows start .. start + num_rows - 1 predict the tokens at positions
    first_position .. first_position + num_rows - 1."""

    request: Request
    row_start: int
    num_rows: int
    first_position: int

    def input_token(self, j: int) -> int:
        """The token fed at the position whose output row is j (the last known token, then the drafts)."""
        return self.request.all_token_ids[self.first_position - 1] if j == 0 else self.request.spec_token_ids[j - 1]


@dataclass
class DeterminismStats:
    fast_tokens: int = 0  # tokens of llm42 / margin-gate requests sampled on the fast path
    rechecks: int = 0  # margin-gate: tokens re-computed on the invariant path (triggers)
    flips: int = 0  # margin-gate: re-checks that changed the token
    replays: int = 0  # llm42: windows replayed
    replayed_tokens: int = 0
    rollbacks: int = 0  # llm42: windows cut at a mismatch
    # calibration only: (fast margin, drift bound, flipped) per re-check
    recheck_log: list[tuple[float, float, bool]] | None = field(default=None, repr=False)

    def as_dict(self) -> dict[str, float | int]:
        return {
            "fast_tokens": self.fast_tokens, "rechecks": self.rechecks, "flips": self.flips,
            "trigger_rate": self.rechecks / self.fast_tokens if self.fast_tokens else 0.0,
            "replays": self.replays, "replayed_tokens": self.replayed_tokens, "rollbacks": self.rollbacks,
            "replayed_fraction": self.replayed_tokens / self.fast_tokens if self.fast_tokens else 0.0,
        }


class ExactDecoding:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.fixed_window = None if engine.config.verify_window == "auto" else int(engine.config.verify_window)
        # measured for the auto window: seconds per replay pass and per regular step (running means)
        self.replay_seconds = self.step_seconds = 0.0
        self.num_replay_passes = self.num_steps = 0
        self._threshold = engine.config.margin_threshold
        self.stats = DeterminismStats()
        self.due: set[str] = set()  # llm42 requests whose window must be replayed before they go on
        # calibration: re-checks leave the fast path's KV in place, as it is between margin-gate's triggers
        self.calibrating = False

    @property
    def threshold(self) -> float:
        """The margin below which margin-gate re-checks a token: the configured one, or the calibrated one
        (calibrated now, and cached, when this model has none)."""
        if self._threshold is None:
            from .calibrate import load_or_calibrate  # runs the engine: only when margin-gate is used

            self._threshold = load_or_calibrate(self.engine).threshold
        return self._threshold

    def has_threshold(self) -> bool:
        """Whether margin-gate can start without calibrating (a configured or cached threshold)."""
        if self._threshold is not None:
            return True
        from .calibrate import MarginCalibration, calibration_path

        return MarginCalibration.load(calibration_path(self.engine)) is not None

    # --- sampling and verification ---------------------------------------------------------------------------

    def sample(self, rows: list[PickedRows], logits: torch.Tensor, row_index: list[int] | None = None
               ) -> tuple[list[int], torch.Tensor]:
        """Positional samples and margins of the given requests' rows (logits rows in `row_index` order)."""
        reqs = [p.request for p in rows for _ in range(p.num_rows)]
        keys = [None if p.request.params.greedy else (p.request.noise_seed, p.first_position + j)
                for p in rows for j in range(p.num_rows)]
        if row_index is not None:
            logits = logits[torch.tensor(row_index, device=logits.device)]
        batch = SamplingBatch.build([r.params for r in reqs], [r.generator for r in reqs], logits.shape[-1],
                                    device=logits.device)
        return positional_sample(logits, processed_probs(logits, batch), keys)

    def verify(self, rows: list[PickedRows], logits: torch.Tensor, invariant_step: bool
               ) -> dict[str, tuple[Emitted, int]]:
        """Accept each request's drafts while they equal its positional samples, then emit the sample there.
        margin-gate requests re-check their first low-margin token (unless this step already ran invariant)."""
        index = [p.row_start + j for p in rows for j in range(p.num_rows)]
        tokens, margins = self.sample(rows, logits, index)
        results: dict[str, tuple[list[int], int, list[int]]] = {}  # tokens, accepted, logits rows
        rechecks: list[tuple[PickedRows, int]] = []
        pos = 0
        for p in rows:
            target = tokens[pos: pos + p.num_rows]
            drafts = p.request.spec_token_ids[: p.num_rows - 1]
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == target[accepted]:
                accepted += 1
            emitted = list(target[: accepted + 1])
            if p.request.determinism in VERIFIED_MODES:
                self.stats.fast_tokens += len(emitted)
            if p.request.determinism == "margin-gate" and not invariant_step:
                low = [j for j in range(len(emitted)) if margins[pos + j].item() < self.threshold]
                if low:  # later tokens were computed after an unconfirmed one: drop them, re-check this one
                    j = low[0]
                    emitted, accepted = emitted[: j + 1], min(accepted, j)
                    rechecks.append((p, j))
            results[p.request.request_id] = (emitted, accepted, [p.row_start + j for j in range(len(emitted))])
            pos += p.num_rows
        extra_logits = self._recheck(rechecks, logits, margins, index, results) if rechecks else None
        return self._with_logprobs(results, logits, extra_logits)

    def _recheck(self, rechecks: list[tuple[PickedRows, int]], logits: torch.Tensor, margins: torch.Tensor,
                 index: list[int], results: dict[str, tuple[list[int], int, list[int]]]) -> torch.Tensor:
        """Re-compute each low-margin token's row on the invariant path (overwriting that position's KV) and
        keep the re-check's token. Returns the re-check logits; their rows are referred to as -1 - i."""
        items = []
        for p, j in rechecks:  # replay from the first position whose KV the fast path computed
            r = p.request
            start = min(r.num_exact_kv, p.first_position - 1 + j)
            known = r.all_token_ids[start: p.first_position]
            items.append(SeqInput(r.request_id, known + r.spec_token_ids[:j], start, 1))
            if not self.calibrating:
                r.num_exact_kv = p.first_position + j
        runner = self.engine.runner
        if self.calibrating:
            # Calibration compares the fast path (fast KV) with the exact path (exact KV): every re-check replays
            # from the end of the prompt, then the fast KV is put back, as it is between margin-gate's triggers.
            slots = torch.cat([runner.slot_table(it.seq_id, it.start + len(it.tokens))[it.start:] for it in items])
            saved = [(k[slots].clone(), v[slots].clone()) for k, v in runner.kv.layers]
        checked = runner.run(items, invariant=True).logits
        if self.calibrating:
            for (k, v), (k0, v0) in zip(runner.kv.layers, saved):
                k[slots], v[slots] = k0, v0
        shifted = [PickedRows(p.request, 0, 1, p.first_position + j) for p, j in rechecks]
        new_tokens, _ = self.sample(shifted, checked)
        for i, ((p, j), tok) in enumerate(zip(rechecks, new_tokens)):
            emitted, _, rows = results[p.request.request_id]
            flipped = tok != emitted[j]
            self.stats.rechecks += 1
            self.stats.flips += flipped
            emitted[j], rows[j] = tok, -1 - i
            if self.stats.recheck_log is not None:
                fast_row = p.row_start + j
                self.stats.recheck_log.append((margins[index.index(fast_row)].item(),
                                               gap_drift(logits[fast_row], checked[i]), flipped))
        return checked

    def _with_logprobs(self, results: dict[str, tuple[list[int], int, list[int]]], logits: torch.Tensor,
                       extra: torch.Tensor | None) -> dict[str, tuple[Emitted, int]]:
        reqs = self.engine.requests
        out: dict[str, tuple[Emitted, int]] = {}
        wanted = [rid for rid in results if reqs[rid].params.logprobs is not None]
        lps: dict[str, list[dict[int, Logprob] | None]] = {}
        if wanted:
            row_reqs = [reqs[rid] for rid in wanted for _ in results[rid][0]]
            rows = torch.stack([logits[r] if r >= 0 else extra[-1 - r] for rid in wanted for r in results[rid][2]])
            flat = torch.tensor([t for rid in wanted for t in results[rid][0]], device=logits.device)
            computed = self.engine._logprobs(row_reqs, rows, flat)
            pos = 0
            for rid in wanted:
                n = len(results[rid][0])
                lps[rid], pos = computed[pos: pos + n], pos + n
        for rid, (tokens, accepted, _) in results.items():
            out[rid] = (list(zip(tokens, lps.get(rid, [None] * len(tokens)))), accepted)
        return out

    # --- llm42: hold fast tokens, replay windows ---------------------------------------------------------------

    @property
    def window(self) -> int:
        """llm42's window. "auto": a window of K tokens costs one replay pass (c steps, measured) plus, when a
        token in it mismatches (rate p per token, counted), the fast tokens after it, about p K^2 / 2 per
        window; per token that is c / K + p K / 2, smallest at K = sqrt(2 c / p)."""
        if self.fixed_window is not None:
            return self.fixed_window
        p = (self.stats.rollbacks + 1) / (self.stats.replayed_tokens + PRIOR_TOKENS)
        c = PRIOR_STEPS
        if self.num_replay_passes and self.num_steps:
            c = (self.replay_seconds / self.num_replay_passes) / (self.step_seconds / self.num_steps)
        return max(AUTO_WINDOW_MIN, min(AUTO_WINDOW_MAX, round(math.sqrt(2 * c / p))))

    def observe_step(self, seconds: float) -> None:
        self.step_seconds += seconds
        self.num_steps += 1

    def hold(self, req: Request, tokens: list[int]) -> None:
        """Keep fast-path tokens unverified; mark the request due when its window is full or it would finish."""
        req.unverified_token_ids.extend(tokens)
        p = req.params
        finishing = (
            any(t in req.eos_token_ids or t in p.stop_token_ids for t in tokens)
            or req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.engine.max_model_len
            or self._stop_string_in_tail(req)
        )
        if finishing or len(req.unverified_token_ids) >= self.window:
            self.due.add(req.request_id)

    def _stop_string_in_tail(self, req: Request) -> bool:
        if not req.params.stop:
            return False
        longest = max(len(s) for s in req.params.stop)
        text = req.detokenizer.text[-longest:] + self.engine.tokenizer.decode(req.unverified_token_ids, False)
        return any(s in text for s in req.params.stop)

    def replay_due(self) -> list[RequestOutput]:
        """Replay every due window in one invariant pass; append the verified tokens (text, stop checks)."""
        reqs = [self.engine.requests[rid] for rid in sorted(self.due) if rid in self.engine.requests]
        self.due.clear()
        reqs = [r for r in reqs if not r.is_finished and r.unverified_token_ids
                and r.num_computed_tokens == r.num_tokens - 1]
        if not reqs:
            return []
        rows: list[PickedRows] = []
        items: list[SeqInput] = []
        for r in reqs:
            verified = r.num_tokens - len(r.unverified_token_ids)
            items.append(SeqInput(r.request_id, r.all_token_ids[verified - 1: r.num_tokens - 1], verified - 1,
                                  len(r.unverified_token_ids)))
            rows.append(PickedRows(r, sum(p.num_rows for p in rows), len(r.unverified_token_ids), verified))
        started = time.perf_counter()
        logits = self.engine.runner.run(items, invariant=True).logits
        self.replay_seconds += time.perf_counter() - started
        self.num_replay_passes += 1
        tokens, _ = self.sample(rows, logits)
        results: dict[str, tuple[list[int], int, list[int]]] = {}
        pos = 0
        for p in rows:
            r, tail = p.request, p.request.unverified_token_ids
            replayed = tokens[pos: pos + p.num_rows]
            m = next((j for j, (a, b) in enumerate(zip(tail, replayed)) if a != b), len(tail))
            self.stats.replays += 1
            self.stats.replayed_tokens += len(tail)
            final = replayed[: m + 1] if m < len(tail) else list(tail)
            results[r.request_id] = (final, 0, [p.row_start + j for j in range(len(final))])
            pos += p.num_rows
        verified = self._with_logprobs(results, logits, None)
        outputs = []
        for p in rows:
            outputs.append(self._settle(p, verified[p.request.request_id][0]))
        return outputs

    def _settle(self, p: PickedRows, final: Emitted) -> RequestOutput:
        """Replace the request's unverified tail by the verified tokens and roll its KV back to what the replay
        computed with those exact tokens."""
        r, engine = p.request, self.engine
        tail = r.unverified_token_ids
        cut = [t for t, _ in final] != tail
        r.unverified_token_ids = []
        if cut:
            self.stats.rollbacks += 1
            # the replay computed KV up to the position before the replaced token, with the same tokens
            r.num_computed_tokens = p.first_position - 1 + len(final)
            engine.blocks.truncate(r.request_id, r.num_computed_tokens)
            if engine.proposer is not None:
                engine.proposer.rollback(r, p.first_position + len(final))
        out = engine._append(r, final, time.monotonic())
        if not r.is_finished:
            engine.scheduler.commit_prefix(r)
        return out



def gap_drift(fast: torch.Tensor, exact: torch.Tensor, competitors: int = COMPETITORS) -> float:
    """How far the fast path moved the score gap between its top token and its nearest competitors. A token
    flips only if a competitor's gap moves by more than the token's margin."""
    fast, exact = fast.float(), exact.float()
    top = fast.topk(competitors + 1).indices
    delta = fast[top] - exact[top]
    return (delta[1:] - delta[0]).abs().max().item()
