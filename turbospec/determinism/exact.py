"""Exact tokens for requests in a deterministic mode: positional sampling, LLM-42 windows, MarginGate checks.

Every request in a deterministic mode ("batch-invariant", "llm42", "margin-gate") samples the token at
position n with noise keyed by (its seed, n) and verifies drafts by equality with that sample, so its tokens do
not depend on how many tokens a step produced (k drafts, a verified window) or on batch-mates' generators.
For one-hot drafts this rule accepts draft x with probability p(x), as rejection sampling does; a draft model's
own distribution is ignored (lower acceptance when sampling, never a different output).

Held tokens are checked by riding along in the next regular step, not in a pass of their own: the request's
KV is rewound to its last exact position, the held tokens become that step's drafts (``Request.check_tokens``),
and the request's rows run on the invariant path (an invariant attention group; linears are row-invariant
for every row at almost no cost, see batch_invariant.py). Verification then accepts the held tokens that equal
the exact samples and continues from the first exact token that differs, as speculative decoding does. On a
CPU, where a forward costs about as much for 8 rows as for 1, this is far cheaper than an extra pass.

- batch-invariant: every step runs the invariant kernels (the runner's flag); nothing else is needed.
- llm42 (LLM-42): decode on the fast path into ``Request.unverified_token_ids``. When a request holds
  ``window`` unverified tokens, or one of them would finish it, they become check tokens: the next step
  recomputes position V-1 (V: verified tokens) and the window on the invariant path. The KV before the last
  verified token is always the invariant path's, so the output equals the batch-invariant mode's, log-probs
  included.
- margin-gate (MarginGate): a fast-path token whose margin (top-1 minus top-2 score, in nats) is at least the
  calibrated threshold is final at once. A token below it becomes a check token: the next step recomputes
  every position since the request's last exact KV (``Request.num_exact_kv``) and the token itself on the
  invariant path. So a re-checked token is exact; the others are exact as far as the calibration holds
  (tuning/margin_calibration.py).

Prefill chunks of llm42 and margin-gate requests run on the invariant path too, and their prefix-cache blocks
live under their own salt, so their context starts exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import EngineConfig
from ..draft import Draft
from ..models.tokenizer import Tokenizer
from ..outputs import Emitted, Logprob
from ..request import Request
from ..sampler import SamplingBatch, positional_sample, processed_probs, token_logprobs
from ..scheduler import ScheduledRequest, SchedulerOutput

VERIFIED_MODES = ("llm42", "margin-gate")
COMPETITORS = 8  # calibration: the runner-up tokens whose score gaps to the top token are watched
AUTO_WINDOW_MAX = 64
AUTO_WINDOW_MIN = 4
# prior for the auto window: one mismatch in PRIOR_TOKENS checked tokens, a window costing PRIOR_STEPS steps
PRIOR_TOKENS = 200
PRIOR_STEPS = 0.5


@dataclass
class PickedRows:
    """One request's logit rows in a step: rows start .. start + num_rows - 1 predict the tokens at positions
    first_position .. first_position + num_rows - 1; invariant when they ran on the invariant path."""

    request: Request
    row_start: int
    num_rows: int
    first_position: int
    invariant: bool = False


@dataclass
class DeterminismStats:
    fast_tokens: int = 0  # tokens of llm42 / margin-gate requests sampled on the fast path
    rechecks: int = 0  # margin-gate: low-margin tokens checked on the invariant path (triggers)
    flips: int = 0  # margin-gate: checks that changed the token
    replays: int = 0  # llm42: windows checked
    replayed_tokens: int = 0
    rollbacks: int = 0  # llm42: windows cut at a mismatch

    def as_dict(self) -> dict[str, float | int]:
        return {
            "fast_tokens": self.fast_tokens, "rechecks": self.rechecks, "flips": self.flips,
            "trigger_rate": self.rechecks / self.fast_tokens if self.fast_tokens else 0.0,
            "replays": self.replays, "replayed_tokens": self.replayed_tokens, "rollbacks": self.rollbacks,
            "replayed_fraction": self.replayed_tokens / self.fast_tokens if self.fast_tokens else 0.0,
        }


class ExactDecoding:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, max_model_len: int,
                 rollback: Callable[[Request, int], None]) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.rollback = rollback  # the proposer forgets what it computed past a cut (llm42 mismatches)
        self._threshold = config.margin_threshold
        # where a threshold calibrated before may be found (a cache file, set by turbospec.tuning): read only when a
        # request first asks for margin-gate, not at every engine start
        self.threshold_lookup: Callable[[], float | None] | None = None
        self.stats = DeterminismStats()
        self.fixed_window = None if config.verify_window == "auto" else int(config.verify_window)
        self.exact_ids: set[str] = set()  # requests this step computes on the invariant path
        # measured for the auto window: seconds of steps with and without llm42 checks, and windows checked
        self._check_steps = [0.0, 0]
        self._plain_steps = [0.0, 0]
        self._windows_in_check_steps = 0

    # --- margin-gate threshold ------------------------------------------------------------------------------

    @property
    def threshold(self) -> float:
        """The margin below which margin-gate re-checks a token: configured, or calibrated by turbospec.tuning."""
        if self._threshold is None:
            raise ValueError("margin-gate has no threshold: calibrate one (turbospec.tuning.ensure_margin_threshold, "
                             "or `turbospec calibrate-margin`) or configure margin_threshold")
        return self._threshold

    def set_threshold(self, value: float) -> None:
        self._threshold = value

    def has_threshold(self) -> bool:
        if self._threshold is None and self.threshold_lookup is not None:
            lookup, self.threshold_lookup = self.threshold_lookup, None
            self._threshold = lookup()
        return self._threshold is not None

    # --- which rows run exact ----------------------------------------------------------------------------

    @staticmethod
    def runs_exact(req: Request, start: int) -> bool:
        """Whether this step computes the request on the invariant path: a verified-mode request's prefill
        chunks, and the step that checks its held tokens."""
        return req.determinism in VERIFIED_MODES and (start < len(req.prompt_token_ids) or bool(req.check_tokens))

    def begin_step(self, sched: SchedulerOutput) -> int:
        """Mark the requests this step computes on the invariant path, and load held tokens as their drafts
        (checked by riding along); returns the llm42 windows this step checks."""
        self.exact_ids = {s.request.request_id for s in sched.scheduled if self.runs_exact(s.request, s.start)}
        windows = 0
        for s in sched.scheduled:
            if s.request.check_tokens:
                s.request.draft = Draft(s.request.check_tokens[: s.num_spec_tokens] if s.samples else [])
                windows += s.request.determinism == "llm42"
        return windows

    def before_commit(self, s: ScheduledRequest, accepted: int) -> None:
        """Advance the leading KV the invariant path computed (margin-gate re-checks from there)."""
        req = s.request
        if req.request_id in self.exact_ids and (s.start < len(req.prompt_token_ids) or s.start <= req.num_exact_kv):
            req.num_exact_kv = s.start + s.num_new_tokens + accepted

    # --- sampling and verification ---------------------------------------------------------------------------

    def sample(self, rows: list[PickedRows], logits: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """Positional samples and margins of the given requests' rows, in order."""
        index = [p.row_start + j for p in rows for j in range(p.num_rows)]
        logits = logits[torch.tensor(index, device=logits.device)]
        reqs = [p.request for p in rows for _ in range(p.num_rows)]
        keys = [None if p.request.params.greedy else (p.request.noise_seed, p.first_position + j)
                for p in rows for j in range(p.num_rows)]
        batch = SamplingBatch.build([r.params for r in reqs], [r.generator for r in reqs], logits.shape[-1],
                                    device=logits.device)
        return positional_sample(logits, processed_probs(logits, batch), keys)

    def verify(self, rows: list[PickedRows], logits: torch.Tensor) -> dict[str, tuple[Emitted, int]]:
        """Accept each request's drafts (proposed, or held check tokens) while they equal its positional samples,
        then emit the sample there. A margin-gate request on the fast path holds back its first low-margin
        token for a check in the next step."""
        tokens, margins = self.sample(rows, logits)
        results: dict[str, tuple[list[int], int, list[int]]] = {}  # tokens, accepted, logits rows
        pos = 0
        for p in rows:
            r = p.request
            target = tokens[pos: pos + p.num_rows]
            drafts = r.draft.tokens[: p.num_rows - 1]
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == target[accepted]:
                accepted += 1
            emitted = list(target[: accepted + 1])
            if r.check_tokens:
                self._count_check(r, len(drafts), accepted, p.invariant)
            elif r.determinism in VERIFIED_MODES:
                self.stats.fast_tokens += len(emitted)
                if r.determinism == "margin-gate" and not p.invariant:
                    low = next((j for j in range(len(emitted)) if margins[pos + j].item() < self.threshold), None)
                    if low is not None:  # keep the tokens before it; later ones came after an unconfirmed token
                        r.check_tokens = [emitted[low]]
                        emitted, accepted = emitted[:low], min(accepted, low)
            results[r.request_id] = (emitted, accepted, [p.row_start + j for j in range(len(emitted))])
            pos += p.num_rows
        return self._with_logprobs(results, {p.request.request_id: p.request for p in rows}, logits)

    def _count_check(self, r: Request, num_checked: int, accepted: int, invariant: bool) -> None:
        """Held tokens were checked (as drafts on the invariant path; or, if the scheduler had no room for
        them, simply replaced by the exact sample at their first position)."""
        assert invariant, "check tokens are only ever verified on the invariant path"
        held = len(r.check_tokens)
        if r.determinism == "margin-gate":
            self.stats.rechecks += held
            self.stats.flips += accepted < held
        else:
            self.stats.replays += 1
            self.stats.replayed_tokens += held
            self.stats.rollbacks += accepted < held
        r.check_tokens = []

    @staticmethod
    def _with_logprobs(results: dict[str, tuple[list[int], int, list[int]]], reqs: dict[str, Request],
                       logits: torch.Tensor) -> dict[str, tuple[Emitted, int]]:
        wanted = [rid for rid in results if reqs[rid].params.logprobs is not None and results[rid][0]]
        lps: dict[str, list[dict[int, Logprob] | None]] = {}
        if wanted:
            row_reqs = [reqs[rid] for rid in wanted for _ in results[rid][0]]
            rows = torch.tensor([r for rid in wanted for r in results[rid][2]], device=logits.device)
            flat = torch.tensor([t for rid in wanted for t in results[rid][0]], device=logits.device)
            computed = token_logprobs(row_reqs, logits[rows], flat)
            pos = 0
            for rid in wanted:
                n = len(results[rid][0])
                lps[rid], pos = computed[pos: pos + n], pos + n
        return {rid: (list(zip(toks, lps.get(rid, [None] * len(toks)))), acc)
                for rid, (toks, acc, _) in results.items()}

    # --- after the step: hold fast tokens, rewind for checks ---------------------------------------------

    def hold(self, req: Request, tokens: list[int]) -> None:
        """llm42: keep fast-path tokens unverified; when the window is full or a token would finish the
        request, they become check tokens for the next step."""
        req.unverified_token_ids.extend(tokens)
        p = req.params
        finishing = (
            any(t in req.eos_token_ids or t in p.stop_token_ids for t in tokens)
            or req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len
            or self._stop_string_in_tail(req)
        )
        if finishing or len(req.unverified_token_ids) >= self.window:
            held = req.unverified_token_ids
            req.unverified_token_ids, req.check_tokens = [], held
            self.rollback(req, req.num_tokens)

    def rewind(self, req: Request) -> None:
        """After the scheduler committed this step: a request with check tokens recomputes from its last exact
        KV (llm42: the position of its last verified token), so the next step checks on the invariant path."""
        if not req.check_tokens or req.is_finished:
            return
        exact = req.num_tokens - 1 if req.determinism == "llm42" else req.num_exact_kv
        req.num_computed_tokens = min(req.num_computed_tokens, exact)

    def _stop_string_in_tail(self, req: Request) -> bool:
        if not req.params.stop:
            return False
        longest = max(len(s) for s in req.params.stop)
        text = req.detokenizer.text[-longest:] + self.tokenizer.decode(req.unverified_token_ids, False)
        return any(s in text for s in req.params.stop)

    # --- llm42's window ------------------------------------------------------------------------------------

    @property
    def window(self) -> int:
        """llm42's window. "auto": a window of K tokens costs c steps to check (measured: the extra time of
        steps that check windows) plus, when a token in it mismatches (rate p per token, counted), the fast
        tokens after it, about p K^2 / 2 per window; per token that is c / K + p K / 2, least at
        K = sqrt(2 c / p)."""
        if self.fixed_window is not None:
            return self.fixed_window
        p = (self.stats.rollbacks + 1) / (self.stats.replayed_tokens + PRIOR_TOKENS)
        c = PRIOR_STEPS
        (checked_s, checked_n), (plain_s, plain_n) = self._check_steps, self._plain_steps
        if checked_n and plain_n and self._windows_in_check_steps:
            plain = plain_s / plain_n
            c = max(0.05, (checked_s / checked_n - plain) / plain * checked_n / self._windows_in_check_steps)
        return max(AUTO_WINDOW_MIN, min(AUTO_WINDOW_MAX, round(math.sqrt(2 * c / p))))

    def observe_step(self, seconds: float, windows_checked: int) -> None:
        bucket = self._check_steps if windows_checked else self._plain_steps
        bucket[0] += seconds
        bucket[1] += 1
        self._windows_in_check_steps += windows_checked


def gap_drift(fast_ids: torch.Tensor, fast_scores: torch.Tensor, exact: torch.Tensor) -> float:
    """How far the fast path moved the score gap between its top token and its nearest competitors
    (fast_ids[0] is the top token). A token flips only if a competitor's gap moves by more than its margin."""
    delta = fast_scores.float() - exact.float()[fast_ids]
    return (delta[1:] - delta[0]).abs().max().item()
