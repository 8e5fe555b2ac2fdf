"""What a request asks its output to match: a JSON schema, any JSON object, a regex, one of several strings or a
grammar (Lark or GBNF). Field names follow vLLM's ``StructuredOutputsParams``. Imports neither torch nor the grammar
library, so the API layers can build and check requests cheaply; the grammar is compiled at admission
(structured/grammar.py), where a bad one is refused with the compiler's reason."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    """Exactly one of the fields must be set (json_object: True)."""

    json: dict[str, Any] | str | None = None  # a JSON schema, as a dict or its text
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF (llama.cpp's)

    def __post_init__(self) -> None:
        set_fields = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(set_fields) != 1:
            raise ValueError(f"structured outputs need exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(set_fields) or 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    self.json = json.loads(self.json)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"structured outputs json must be a JSON schema; its text does not parse: "
                                     f"{exc}") from None
            if not isinstance(self.json, (dict, bool)):
                raise ValueError(f"structured outputs json must be a JSON schema (an object), got "
                                 f"{type(self.json).__name__}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured outputs json_object must be a bool, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured outputs {name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError(f"structured outputs choice must be a non-empty list of non-empty strings, got "
                                 f"{self.choice!r}")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        return next(f.name for f in fields(self) if getattr(self, f.name) not in (None, False))
