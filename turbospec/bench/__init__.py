"""Helpers for benchmarks: prompt sets. Uses only turbospec's public API (nothing here imports engine internals)."""

from ..data.prompts import FALLBACK_PROMPTS, BenchPrompt, chat_messages, load_prompts

__all__ = ["FALLBACK_PROMPTS", "BenchPrompt", "chat_messages", "load_prompts"]
