"""HumanEval by execution: every canonical solution passes its tests in the sandbox, wrong ones fail, and the
sandbox holds: timeouts, memory, network, destructive calls, and its own temporary directory."""

from __future__ import annotations

import os
import tempfile

import pytest

from turbospec.bench.humaneval import answer_prefix, check_completion, load_humaneval, pass_at_1, program
from turbospec.bench.sandbox import network_namespace_available, run_program


@pytest.fixture(scope="module")
def tasks():
    return load_humaneval()


def test_every_canonical_solution_passes_and_a_wrong_one_fails(tasks):
    assert len(tasks) == 164 and len({t.task_id for t in tasks}) == 164
    results = [check_completion(t, t.canonical_solution) for t in tasks]
    failed = [(t.task_id, r.detail[-200:]) for t, r in zip(tasks, results) if not r.passed]
    assert not failed
    assert pass_at_1(results) == 1.0
    wrong = check_completion(tasks[0], "    return None\n")
    assert wrong.status == "failed" and "AssertionError" in wrong.detail
    # an answer that closes its code fence is cut there: the prose after it is not run
    assert check_completion(tasks[0], tasks[0].canonical_solution + "```\nThis function compares pairs.").passed


def test_program_and_prompt_prefix_are_built_from_the_task(tasks):
    task = tasks[2]
    assert answer_prefix(task).startswith("```python\n") and answer_prefix(task).endswith(task.prompt)
    source = program(task, "    return 0.5\n```\ntrailing prose")
    assert source.startswith(task.prompt) and "trailing prose" not in source
    assert source.rstrip().endswith(f"check({task.entry_point})")


def test_load_humaneval_takes_the_first_n_and_refuses_nonsense():
    assert [t.task_id for t in load_humaneval(3)] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    with pytest.raises(ValueError, match="n must be >= 1"):
        load_humaneval(0)


def test_the_sandbox_enforces_time_and_memory_limits():
    slow = run_program("while True:\n    pass\n", timeout_s=1.5)
    assert slow.status == "timeout" and not slow.passed
    hog = run_program("blob = bytearray(3 * 1024 ** 3)\n", timeout_s=10, memory_mb=512)
    assert hog.status == "failed" and "MemoryError" in hog.detail
    assert run_program("print(sum(range(10)))\n").passed


def test_the_sandbox_blocks_network_processes_and_deletion():
    sock = run_program("import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)\n")
    assert not sock.passed and "blocked by the turbospec sandbox" in sock.detail
    spawn = run_program("import os\nos.system('true')\n")
    assert not spawn.passed and "blocked" in spawn.detail
    with tempfile.NamedTemporaryFile(delete=False) as f:
        victim = f.name
    try:
        rm = run_program(f"import os\nos.remove({victim!r})\n")
        assert not rm.passed and os.path.exists(victim)
    finally:
        os.remove(victim)
    if network_namespace_available():  # then even a socket made before the guard has no route out
        raw = run_program("import _socket\ns = _socket.socket()\ns.settimeout(2)\n"
                          "raise SystemExit(0 if s.connect_ex(('1.1.1.1', 80)) != 0 else 3)\n")
        assert raw.passed and raw.isolated_network


def test_programs_run_in_their_own_directory_which_is_removed():
    result = run_program("import os, sys\nopen('scratch.txt', 'w').write('x')\nsys.stderr.write(os.getcwd())\n"
                         "assert os.getcwd().split(os.sep)[-1].startswith('turbospec-exec-')\n")
    assert result.passed
    workdir = result.detail.strip()
    assert os.path.basename(workdir).startswith("turbospec-exec-") and not os.path.exists(workdir)


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        run_program("pass", timeout_s=0)
