"""What benchmark results record about where they ran (turbospec/bench/machine.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from turbospec.bench.machine import cpu_description, header_lines, source_commit
from turbospec.host import hardware_name


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


def _load_script(script: str):
    """A benchmark script as a module, its directory on sys.path while it loads (as when it runs: scripts import
    each other, e.g. head_ab imports proposer_zoo)."""
    import importlib.util
    import sys

    benchmarks = str(Path(__file__).resolve().parents[2] / "benchmarks")
    spec = importlib.util.spec_from_file_location(script, Path(benchmarks) / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, benchmarks)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(benchmarks)
    return module


def test_zoo_speedup_after_the_first_token_leaves_prefill_out():
    """Plain: 2 prompts, 10 s of which 4 before the first tokens, 22 tokens (20 after the first ones): 20 / 6 tok/s.
    A row twice as fast after the first token but with the same prefill: 20 tokens after in 3 s, 7 s in all."""
    zoo = _load_script("proposer_zoo")

    def row(name, seconds, first):
        s = {"outputs": [[1] * 11, [2] * 11], "tokens": 22, "seconds": seconds, "first_token_seconds": first,
             "tau": 2.0}
        return {"model": "m", "row": name, "engine": "turbospec", "sets": {"humaneval": s}}

    rows = [row("plain", 10.0, 4.0), row("eagle", 7.0, 4.0)]
    zoo.summarise(rows)
    rows.insert(1, {"model": "m", "row": "sps", "missing": "no smaller model with this tokenizer is packaged"})
    eagle = rows[2]["sets"]["humaneval"]
    assert eagle["speedup"] == pytest.approx(10 / 7) and eagle["after_first_speedup"] == pytest.approx(2.0)
    assert zoo.after_first_lines(rows) == [
        "- m: plain spent humaneval 40% of its time before each prompt's first token (prefill, paid alike by every "
        "row); speedup after the first token, humaneval: eagle 2.00x"]


@pytest.mark.parametrize("script, result", [("proposer_zoo", "proposer_zoo/proposer_zoo_qwen_zen5_eagle8_tuned10"),
                                            ("eagle_draft_cost", "eagle_draft_cost/eagle_draft_cost"),
                                            ("head_ab", "head_ab/head_ab_qwen_eagle_stage3"),
                                            ("eagle_vocab", "eagle_vocab/eagle_vocab_qwen")])
def test_committed_results_render_again_from_their_json(script, result):
    """The benchmarks' markdown (with the shared header_lines) is what the committed .md files hold."""
    import json

    root = Path(__file__).resolve().parents[2]
    module = _load_script(script)
    data = json.loads((root / "benchmarks" / "results" / f"{result}.json").read_text())
    table = module.markdown(data["meta"], data["rows"])
    assert table.strip() == (root / "benchmarks" / "results" / f"{result}.md").read_text().strip()
    assert header_lines(data["meta"])[0] in table


@pytest.mark.parametrize("heads, message", [("heads/smollm2-135m-eagle.safetensors", "at least two files"),
                                            ("heads/smollm2-135m-eagle.safetensors,heads/no-such.safetensors",
                                             "no such file: heads/no-such.safetensors"),
                                            ("heads/smollm2-135m-eagle.safetensors,heads/smollm2-135m-eagle"
                                             ".safetensors", "the same file twice"),
                                            ("heads/smollm2-135m-eagle.safetensors,heads/smollm2-135m-medusa"
                                             ".safetensors", "holds medusa heads, not eagle")])
def test_head_ab_refuses_what_it_cannot_compare(heads, message, monkeypatch, capsys):
    """Exit 2 with what is wrong, before any model loads."""
    _assert_refused("head_ab", ["--heads", heads], message, monkeypatch, capsys)


@pytest.mark.parametrize("heads, message", [("heads/no-such.safetensors", "No such file"),
                                            ("heads/smollm2-135m-hydra.safetensors", "holds hydra heads, not eagle")])
def test_eagle_vocab_refuses_a_file_without_an_eagle_draft(heads, message, monkeypatch, capsys):
    _assert_refused("eagle_vocab", ["--heads", heads], message, monkeypatch, capsys)


def _assert_refused(script: str, argv: list[str], message: str, monkeypatch, capsys) -> None:
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    monkeypatch.setattr("sys.argv", [f"{script}.py", *argv])
    with pytest.raises(SystemExit) as exit_info:
        _load_script(script).main()
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
