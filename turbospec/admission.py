"""Admitting a request: its prompt checked against the model, its per-request deterministic mode and acceptance
policy checked against what this engine runs, and the `Request` built. Reads nothing a step changes, so a server
may validate from another thread before queueing."""

from __future__ import annotations

import torch

from .config import REQUEST_DETERMINISTIC_MODES, EngineConfig
from .determinism.exact import ExactDecoding
from .models.model_config import ModelConfig
from .models.tokenizer import IncrementalDetokenizer, Tokenizer
from .request import Request
from .sampler import fold_seed, make_generator
from .sampling_params import SamplingParams
from .structured.constraints import start_grammar
from .structured.matcher import GrammarState
from .verification.policies import LOSSLESS_POLICIES, check_policy


class Admission:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, tokenizer: Tokenizer, max_model_len: int,
                 exact: ExactDecoding) -> None:
        self.config = config
        self.vocab_size = model_config.vocab_size
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.exact = exact

    def new_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    prompt_token_ids: list[int] | None, speculate: bool, deterministic: str | None,
                    acceptance: str | None) -> Request:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        determinism = self.request_determinism(deterministic)
        policy = self.request_acceptance(acceptance, determinism)
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                if not prompt:
                    raise ValueError("prompt is empty: give at least one character or token")
                prompt_token_ids = self.tokenizer.encode(prompt)
            else:
                prompt_token_ids = list(prompt)
        self.check_prompt(prompt_token_ids, params)
        grammar = self.start_grammar(params, determinism)
        return Request(
            request_id=request_id, prompt_token_ids=prompt_token_ids, params=params,
            prompt=prompt if isinstance(prompt, str) else None,
            detokenizer=IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
            generator=None if params.greedy else make_generator(params.seed),
            eos_token_ids=() if params.ignore_eos else self.tokenizer.eos_token_ids,
            logprobs=[] if params.logprobs is not None else None, speculate=speculate, determinism=determinism,
            noise_seed=fold_seed(params.seed) if params.seed is not None else int(torch.randint(2**31, ())),
            acceptance=policy, grammar=grammar,
        )

    def start_grammar(self, params: SamplingParams, determinism: str | None) -> GrammarState | None:
        """The request's grammar state, or None without structured outputs; GrammarError (a ValueError) says why
        an ask cannot run."""
        ask = params.structured_outputs
        if ask is None:
            return None
        if determinism in ("llm42", "margin-gate"):
            raise ValueError(f"structured outputs cannot be combined with the deterministic mode {determinism!r}: it "
                             "replays held tokens that the grammar would have to take back (batch-invariant works)")
        # jump-forward appends forced tokens without log-probs, so a request that asks for them samples every token
        return start_grammar(ask, self.tokenizer, self.vocab_size, self.tokenizer.eos_token_ids,
                             jump_forward=params.logprobs is None)

    def check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if this prompt cannot run (empty, unknown ids, too long)."""
        if not ids:
            raise ValueError("prompt is empty: give at least one character or token")
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be ints in [0, {self.vocab_size}), got {bad[:3]}")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) is {len(ids) + params.max_tokens}, "
                f"beyond max_model_len={self.max_model_len}"
            )

    def request_determinism(self, value: str | None) -> str | None:
        """The deterministic mode a request runs in: the engine's, or one it asks for. llm42 and margin-gate
        work per request on any engine but a LayerCast one; batch-invariant changes the kernels of every row in
        a step, so only an engine started in that mode offers it (and there every request already has it).
        margin-gate needs a threshold, given or calibrated before (turbospec.tuning)."""
        mode = self.config.deterministic
        if value is None:
            return mode if mode in REQUEST_DETERMINISTIC_MODES else None
        if value not in REQUEST_DETERMINISTIC_MODES:
            raise ValueError(f"unknown deterministic mode {value!r}: a request may ask for one of "
                             f"{', '.join(REQUEST_DETERMINISTIC_MODES)}")
        if self.config.weight_format in ("int4", "int8"):
            raise ValueError(f"deterministic modes run dense kernels with a fixed reduction order; this engine keeps "
                             f"only packed weights (weight_format {self.config.weight_format!r}): start it with "
                             "weight_format auto or bf16")
        if mode == "layercast":
            raise ValueError("this engine runs LayerCast (float32 compute and KV): per-request deterministic modes "
                             "are not available on it")
        if mode == "batch-invariant":
            return mode  # every row is already computed invariantly: the strongest mode, at no extra cost
        if value == "batch-invariant":
            raise ValueError("batch-invariant changes the kernels of every request in a step, so it is engine-wide: "
                             "start the engine with deterministic='batch-invariant', or ask for llm42 or margin-gate")
        if value == "margin-gate" and not self.exact.has_threshold():
            raise ValueError("margin-gate needs a calibrated threshold for this model: run `turbospec "
                             "calibrate-margin --model ...` (once, cached; one process, shared by every "
                             "tensor-parallel split) or start the server with --margin-threshold")
        return value

    def request_acceptance(self, value: str | None, determinism: str | None = None) -> str:
        """The acceptance policy a request runs with: the engine's (speculative_config "acceptance"), or one it
        asks for. Lossy policies need speculation and cannot be combined with a deterministic mode."""
        spec = self.config.speculative_config
        if value is None:
            return spec.acceptance if spec and not determinism else "exact"
        if value != "exact" and spec is None:
            raise ValueError(f"acceptance {value!r} needs speculative decoding, which this engine does not run "
                             f"(only 'exact' is accepted here)")
        check_policy(value, spec.method if spec else None)
        if determinism and value not in LOSSLESS_POLICIES:
            raise ValueError(f"acceptance {value!r} is lossy and this request is deterministic ({determinism}): "
                             f"its output must be the model's own")
        return value
