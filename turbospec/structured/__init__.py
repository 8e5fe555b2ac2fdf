"""Structured outputs: a request's tokens held to a JSON schema, a regex, a choice or a grammar (llguidance), with
speculation: drafts cut where the grammar refuses them, one mask per verification row, and forced tokens appended
without a model call. params.py (what a request asks, no heavy imports), grammar.py (compiling it for a
tokenizer), constraints.py (the engine's stage), tools.py (OpenAI tool calling on top)."""
