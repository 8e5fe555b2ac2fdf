"""Tokenizers: Hugging Face tokenizers (from a GGUF's embedded vocabulary or a model directory), and a byte
tokenizer for dummy-weight models. Also incremental detokenisation for streaming and stop strings."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> list[int]: ...
    def token_text(self, token_id: int) -> str: ...


class HFTokenizer:
    """A thin wrapper that fixes the few things the engine needs from a transformers tokenizer."""

    def __init__(self, hf: Any, extra_eos: Sequence[int] = ()) -> None:
        self.hf = hf
        self.vocab_size = len(hf)
        eos = [hf.eos_token_id] if hf.eos_token_id is not None else []
        self.eos_token_ids = tuple(dict.fromkeys([*eos, *extra_eos]))
        self.bos_token_id = hf.bos_token_id

    @classmethod
    def load(cls, source: Path, gguf_file: str | None = None, cache_dir: Path | None = None,
             extra_eos: Sequence[int] = ()) -> HFTokenizer:
        from transformers import AutoTokenizer

        # Converting a GGUF vocabulary takes seconds (15 s for Gemma's 262k); the saved result loads fast.
        if cache_dir is not None and (cache_dir / "tokenizer_config.json").exists():
            return cls(AutoTokenizer.from_pretrained(cache_dir), extra_eos)
        hf = AutoTokenizer.from_pretrained(source, gguf_file=gguf_file) if gguf_file else AutoTokenizer.from_pretrained(source)
        if cache_dir is not None:  # saved aside, then renamed: a process loading at once never reads half of it
            partial = cache_dir.with_name(f"{cache_dir.name}.{os.getpid()}.partial")
            hf.save_pretrained(partial)
            try:
                partial.rename(cache_dir)
            except OSError:  # another process got there first: its copy is the same
                shutil.rmtree(partial, ignore_errors=True)
        return cls(hf, extra_eos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf(text, add_special_tokens=add_special_tokens).input_ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.hf.decode([token_id], skip_special_tokens=False)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.hf.chat_template)

    @property
    def template_has_tools(self) -> bool:
        """Whether the chat template formats a `tools` list itself (Qwen2.5's does; others get a system prompt)."""
        return "tools" in (getattr(self.hf, "chat_template", None) or "")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        if not self.has_chat_template:
            raise ValueError("this model has no chat template (a base model?): use generate() with a plain prompt")
        out = self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                          return_dict=False, tools=tools)
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)


class ByteTokenizer:
    """UTF-8 bytes shifted by 3 (0 pad, 1 bos, 2 eos): enough to drive dummy-weight models in timing runs."""

    OFFSET = 3

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = (2,)
        self.bos_token_id = 1
        self.has_chat_template = True

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [b + self.OFFSET for b in text.encode()]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i - self.OFFSET for i in ids if self.OFFSET <= i < 256 + self.OFFSET)
        return data.decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])

    template_has_tools = False

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))


@dataclass
class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas without re-decoding everything each step.

    Decoding a window that starts a few tokens back keeps multi-byte characters and tokenizers that merge
    spaces across tokens right; a delta ending in U+FFFD is held back until the character completes.
    """

    tokenizer: Tokenizer
    skip_special_tokens: bool = True
    text: str = ""
    _ids: list[int] = field(default_factory=list)
    _prefix: int = 0  # start of the decode window
    _read: int = 0  # tokens already turned into text

    def add(self, new_ids: Sequence[int]) -> str:
        self._ids.extend(new_ids)
        before = self.tokenizer.decode(self._ids[self._prefix:self._read], self.skip_special_tokens)
        after = self.tokenizer.decode(self._ids[self._prefix:], self.skip_special_tokens)
        if after.endswith("\ufffd") or not after.startswith(before):
            return ""
        delta = after[len(before):]
        self.text += delta
        self._read = len(self._ids)
        self._prefix = max(0, self._read - 4)  # keep a little left context for the next window
        return delta
