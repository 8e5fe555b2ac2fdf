"""What benchmark results record about where they ran (turbospec/bench/machine.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from turbospec.bench.machine import cpu_description, header_lines, source_commit
from turbospec.control.profiler import hardware_name


def test_the_cpu_description_names_the_family_and_vector_units():
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if "cpu family" not in text:
        pytest.skip("no /proc/cpuinfo with a CPU family here")
    described = cpu_description()
    assert described.startswith(hardware_name("cpu")) and "family " in described
    flags = next(line for line in text.splitlines() if line.startswith("flags")).split()
    assert ("avx2" in described) == ("avx2" in flags)


def test_the_commit_is_marked_when_tracked_files_changed(tmp_path, monkeypatch):
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "a")
    monkeypatch.chdir(tmp_path)
    head = git("rev-parse", "--short", "HEAD")
    (tmp_path / "untracked.json").write_text("{}")  # results written by the run itself do not count
    assert source_commit() == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert source_commit() == f"{head} + uncommitted changes"


@pytest.mark.parametrize("script, result", [("proposer_zoo", "proposer_zoo_qwen_zen5_eagle8_tuned10"),
                                            ("eagle_draft_cost", "eagle_draft_cost")])
def test_committed_results_render_again_from_their_json(script, result):
    """The benchmarks' markdown (with the shared header_lines) is what the committed .md files hold."""
    import importlib.util
    import json

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location(script, root / "benchmarks" / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    data = json.loads((root / "benchmarks" / "results" / f"{result}.json").read_text())
    table = module.markdown(data["meta"], data["rows"])
    assert table.strip() == (root / "benchmarks" / "results" / f"{result}.md").read_text().strip()
    assert header_lines(data["meta"])[0] in table
