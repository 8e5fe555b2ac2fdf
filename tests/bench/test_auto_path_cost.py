"""benchmarks/auto_path_cost.py on a real engine, small: the phases it times are the engine's own, the
controller's appear only under adaptive, and bad arguments exit 2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))

import auto_path_cost as apc  # noqa: E402

pytestmark = pytest.mark.slow


def test_phases_are_timed_per_policy_and_sum_to_at_most_the_wall_time(tmp_path, monkeypatch):
    monkeypatch.setenv("TURBOSPEC_HOME", str(tmp_path / "home"))  # a brief profile of its own, 2 seats
    out = tmp_path / "apc"
    step_features = apc.engine_module.step_features
    apc.main(["--workloads", "a", "--batches", "2", "--rounds", "1", "--max-tokens", "6", "--threads", "1",
              "--max-k", "2", "--out", str(out)])
    assert apc.engine_module.step_features is step_features  # the timer put the engine's function back
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [(r["workload"], r["batch"]) for r in rows] == [("a", 2)]
    runs = {r["policy"]: r for r in rows[0]["runs"]}
    assert set(runs) == {"no-spec", "adaptive"}
    for run in runs.values():
        assert run["steps"] >= 2 and run["phases_s"]["forward"] > 0  # a prefill step, then decodes
        assert sum(run["phases_s"].values()) <= run["wall_s"]
    assert runs["no-spec"]["phases_s"]["choice"] == 0 and runs["no-spec"]["phases_s"]["online_fit"] == 0
    assert runs["adaptive"]["phases_s"]["choice"] > 0 and runs["adaptive"]["phases_s"]["online_fit"] > 0
    row = rows[0]
    assert row["ratio"] == pytest.approx(runs["adaptive"]["wall_s"] / runs["no-spec"]["wall_s"])
    assert 0 < row["choice_share"] <= row["controller_share"] < 1
    decode = runs["adaptive"]["decode_steps"]
    assert 0 < decode["steps"] < runs["adaptive"]["steps"]  # the prefill step is not one
    assert row["decode_choice_share"] == pytest.approx(decode["choice_s"] / decode["wall_s"])
    assert 0 < decode["choose_s"] <= decode["choice_s"]  # the controller's own choice is part of the callback
    assert "| workload | batch |" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize("argv", [["--batches", "0"], ["--batches", "2,x"], ["--workloads", "z"], ["--rounds", "0"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        apc.parse_args(argv)
    assert exc.value.code == 2 and "error" in capsys.readouterr().err
