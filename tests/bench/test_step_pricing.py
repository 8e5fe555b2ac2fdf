"""benchmarks/step_pricing.py's step kinds from hand-made step features, and its bad arguments. No model runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))

import step_pricing as sp  # noqa: E402

from turbospec.control.step_time import StepFeatures  # noqa: E402


def _features(prefill: int = 0, k: int = 0, draft_tokens: int = 0) -> StepFeatures:
    f = StepFeatures(draft_tokens=draft_tokens)
    f.add(100, 1 + prefill, k)
    return f


def test_each_step_is_put_in_the_kind_its_features_say():
    assert sp.step_kind(_features(prefill=127)) == "prefill"
    assert sp.step_kind(_features(k=4, draft_tokens=160)) == "catch-up"  # the draft model ran over the prompt
    assert sp.step_kind(_features(k=4, draft_tokens=4)) == "speculative"
    assert sp.step_kind(_features()) == "plain"


def test_totals_leave_out_the_kinds_asked():
    kinds = {"prefill": {"measured_s": {"target": 1.0}}, "plain": {"measured_s": {"target": 0.5, "overhead": 0.1}}}
    assert sp.total(kinds, "measured_s") == pytest.approx(1.6)
    assert sp.total(kinds, "measured_s", ("prefill",)) == pytest.approx(0.6)


@pytest.mark.parametrize("argv", [["--k", "0"], ["--prompts", "0"], ["--workload", "z"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        sp.parse_args(argv)
    assert exc.value.code == 2 and "error" in capsys.readouterr().err
