"""What benchmarks and `turbospec bench` share: the load generator and client for any OpenAI-compatible server, the
machine description every result records, HumanEval execution, timing helpers, and the prompt sets (re-exported
from data/). Above the engine: timing.py and eagle_reference.py read engine internals on purpose."""

from ..data.prompts import FALLBACK_PROMPTS, BenchPrompt, chat_messages, load_prompts

__all__ = ["FALLBACK_PROMPTS", "BenchPrompt", "chat_messages", "load_prompts"]
