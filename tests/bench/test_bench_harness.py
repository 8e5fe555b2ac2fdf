"""The benchmark harness (benchmarks/harness/), the results index (benchmarks/latest.py) and the result-path
rewriter (benchmarks/rewrite_result_paths.py): no model runs here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.append(str(BENCHMARKS))  # (after the installed packages: its scripts are not modules of ours)

import latest  # noqa: E402
import rewrite_result_paths  # noqa: E402
from harness import alternating, machine_class, stats, table  # noqa: E402
from harness.index import results  # noqa: E402


def test_tau_counts_the_bonus_token_and_is_none_without_verifications():
    assert stats.tau({"num_drafts": 4, "num_accepted_tokens": 6}) == 2.5
    assert stats.tau({"num_drafts": 0, "num_accepted_tokens": 0}) is None
    assert stats.acceptance_by_position({"num_accepted_tokens_per_pos": [3, 1],
                                         "num_draft_tokens_per_pos": [4, 0]}) == [0.75, 0.0]
    assert stats.after_first_tok_s(22, 2, 7.0, 4.0) == pytest.approx(20 / 3)


def test_rows_take_turns_in_alternating_order():
    assert [alternating("ab", i) for i in range(3)] == [["a", "b"], ["b", "a"], ["a", "b"]]
    assert table(["x", "y"], [[1, 2]]) == ["| x | y |", "|---|---|", "| 1 | 2 |"]


@pytest.mark.parametrize("machine, expected", [
    ("Intel(R) Xeon(R) Processor (family 6; avx2, avx512f, avx512_bf16, amx_bf16), 2 CPUs", "AMX Xeon"),
    ("AMD EPYC (family 26; avx2, avx512f, avx512_bf16), 2 CPUs", "AVX-512 Zen"),
    ("AMD EPYC (family 23; avx2), 2 CPUs", "AVX2"),
    ("AMD EPYC, 2 CPUs", "not recorded")])
def test_the_machine_class_comes_from_the_recorded_vector_units(machine, expected):
    assert machine_class(machine) == expected


def test_every_moved_result_is_where_moved_tsv_says():
    root = BENCHMARKS.parent
    moves = [line.split("\t") for line in rewrite_result_paths.MOVED.read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert moves and all((root / new).is_file() and not (root / old).exists() for old, new in moves)


def test_old_result_paths_are_rewritten_once():
    names = rewrite_result_paths.renames()
    text = ("`benchmarks/results/proposer_zoo.md`, results/weight_formats.md, --out benchmarks/results/"
            "proposer_zoo_qwen_avx2, benchmarks/results/bf16_rows*.md, benchmarks/results/serve_compare_runs/x, "
            "benchmarks/results/profiles/smollm2-135m-ngram-bf16-t1.json, myresults/proposer_zoo.md")
    once, count = rewrite_result_paths.rewrite(text, names)
    assert count == 5
    assert "benchmarks/results/proposer_zoo/proposer_zoo.md" in once
    assert "results/weight_formats/weight_formats.md" in once
    assert "benchmarks/results/proposer_zoo/proposer_zoo_qwen_avx2 " in once.replace(",", " ")
    assert "benchmarks/results/bf16_rows/bf16_rows*.md" in once
    assert "benchmarks/results/serve_compare/serve_compare_runs/x" in once
    assert "results/profiles/smollm2" in once and "myresults/proposer_zoo.md" in once  # not moved / not a path
    assert rewrite_result_paths.rewrite(once, names) == (once, 0)


def test_latest_md_says_what_the_results_say():
    """Regenerate with `python benchmarks/latest.py` after adding or moving a result."""
    assert latest.main(["--check"]) == 0


def test_every_current_result_has_a_date_and_links_from_latest():
    found = results()
    assert found and all(r.date for r in found)
    text = latest.LATEST.read_text()
    current = {(r.benchmark, r.machine_class): r for r in found}
    for r in current.values():
        assert r.markdown.relative_to(latest.RESULTS).as_posix() in text or r.path.name in text
