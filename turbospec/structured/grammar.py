"""Compiling a request's structured-output ask into an llguidance grammar for the model's tokenizer.

Why llguidance (docs/structured-outputs.md): no dependencies (xgrammar pulls triton and apache-tvm-ffi), masks
far cheaper than a decode step, and the three operations speculation needs: validate_tokens (how much of a draft the grammar allows), rollback, and
compute_ff_tokens (tokens the grammar forces)."""

from __future__ import annotations

import dataclasses
import json
import threading
import llguidance
import llguidance.hf

from ..models.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from .params import StructuredOutputsParams

# JSON as the model would write it compactly: no free whitespace, which a small model can fill forever
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar, schema or regex that cannot be compiled; says why."""


class _ByteVocabulary:
    """What llguidance reads of a tokenizer, for the dummy models' byte tokenizer (ids 3..258 are the bytes)."""

    def __init__(self, tok: ByteTokenizer, vocab_size: int) -> None:
        self.eos_token_id, self.bos_token_id = tok.eos_token_ids[0], tok.bos_token_id
        names = {0: b"<pad>", 1: b"<s>", 2: b"</s>"}
        self.tokens = [names.get(i) or (bytes([i - tok.OFFSET]) if i < 256 + tok.OFFSET else b"<unused%d>" % i)
                       for i in range(vocab_size)]
        self.special_token_ids = [i for i in range(vocab_size) if not tok.OFFSET <= i < 256 + tok.OFFSET]
        self._tok = tok

    def __call__(self, text: str | bytes) -> list[int]:
        data = text if isinstance(text, bytes) else text.encode()
        return [b + self._tok.OFFSET for b in data]


_lock = threading.Lock()
_vocabularies: dict[tuple[int, int], llguidance.LLTokenizer] = {}
COMPILED_KEPT = 256  # checked grammars remembered (oldest dropped first)
_compiled: dict[str, str] = {}


def vocabulary(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """The llguidance view of a tokenizer (built once per tokenizer and logits width: ~1 s for Qwen's 152k)."""
    key = (id(tokenizer), vocab_size)
    with _lock:
        if key not in _vocabularies:
            eos = list(tokenizer.eos_token_ids)
            if isinstance(tokenizer, HFTokenizer):
                _vocabularies[key] = llguidance.hf.from_tokenizer(tokenizer.hf, n_vocab=vocab_size, eos_token=eos)
            elif isinstance(tokenizer, ByteTokenizer):
                wrapper = llguidance.TokenizerWrapper(_ByteVocabulary(tokenizer, vocab_size))
                _vocabularies[key] = llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos)
            else:
                raise GrammarError(f"structured outputs need a Hugging Face or byte tokenizer, not "
                                   f"{type(tokenizer).__name__}")
        return _vocabularies[key]


def grammar_text(ask: StructuredOutputsParams) -> str:
    """The llguidance grammar for a request's ask (not yet checked: compile() does that)."""
    kind = ask.kind
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(ask.json), overrides=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(ask.regex or "")
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in ask.choice or []))
    try:
        return llguidance.grammar_from("grammar", ask.grammar or "")
    except ValueError as exc:
        raise GrammarError(f"the grammar is neither Lark nor GBNF: {exc}") from None



def compile_grammar(ask: StructuredOutputsParams, vocab: llguidance.LLTokenizer) -> str:
    """The checked grammar, or GrammarError with the compiler's reason (a bad schema, an unsupported JSON-schema
    feature, a regex that does not compile, a grammar that does not parse). Remembered per ask: a server checks
    each request's ask before queueing it and the engine compiles it again at admission, and clients tend to send
    the same few schemas."""
    key = json.dumps([id(vocab), dataclasses.asdict(ask)], sort_keys=True)
    with _lock:
        known = _compiled.get(key)
    if known is not None:
        return known
    try:
        grammar = grammar_text(ask)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"invalid {ask.kind}: {exc}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar, vocab)
    if error:
        raise GrammarError(f"invalid {ask.kind}: {error.strip()}")
    with _lock:
        _compiled[key] = grammar
        while len(_compiled) > COMPILED_KEPT:
            _compiled.pop(next(iter(_compiled)))
    return grammar
