"""The goodput sweep's claims and goodput (benchmarks/goodput_sweep.py) from hand-made rows: the ratios, their
bootstrap intervals, the p99 and light-load checks and the SLO goodput. No model runs here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))

import goodput_sweep as gs  # noqa: E402


def _row(rate: float, policy: str, latencies: list[float], runs: int = 1) -> dict:
    requests = [{"index": i, "latency": lat, "output_tokens": 10} for _ in range(runs) for i, lat in enumerate(latencies)]
    lat = sorted(latencies)
    return {"workload": "a", "request_rate": rate, "policy": policy, "requests": requests,
            "mean_latency_s": sum(latencies) / len(latencies), "p99_latency_s": lat[-1], "virtual_s": 100.0,
            **({"mean_latency_runs_s": [sum(latencies) / len(latencies)] * runs} if runs > 1 else {})}


ALONE = [1.0, 2.0, 3.0, 4.0, 10.0]


def test_ratios_intervals_and_checks_follow_the_rows():
    rows = [_row(0.1, "no-spec", ALONE), _row(0.1, "fixed-2", [x * 0.9 for x in ALONE]),
            _row(0.1, "adaptive", [x * 0.5 for x in ALONE]),
            _row(2.0, "no-spec", ALONE, runs=2), _row(2.0, "fixed-2", [x * 2 for x in ALONE], runs=2),
            _row(2.0, "adaptive", [1.2, 2.0, 3.0, 4.0, 10.0], runs=2)]
    c = gs.claims(rows)["a"]
    low, high = c["adaptive_vs_best_other"]
    # every request 0.5 / 0.9 of the other: every bootstrap sample has the same ratio
    assert low["best_other_policy"] == "fixed-2" and low["ratio"] == pytest.approx(0.5 / 0.9)
    assert low["ratio_ci95"] == pytest.approx((0.5 / 0.9, 0.5 / 0.9))
    assert low["p99_ratio"] == pytest.approx(0.5 / 0.9) and low["p99_within_10pct"]
    assert c["lowest_rate"]["nospec_over_adaptive"] == pytest.approx(2.0) and c["lowest_rate"]["reaches_light_load_gain"]
    # one request of five slower: a real interval around the ratio, which fails the 5% bound
    assert high["best_other_policy"] == "no-spec" and high["ratio"] == pytest.approx(20.2 / 20.0)
    lo, hi = high["ratio_ci95"]
    assert lo == pytest.approx(1.0) and 1.0 < high["ratio"] < hi <= 1.2 / 1.0 and high["within_5pct"]
    assert c["highest_rate"]["adaptive_not_slower_than_nospec"] is False
    md = "\n".join(gs.claims_markdown(c))
    assert "95% CI" in md and "lowest rate 0.1" in md and "-> FAIL (adaptive not slower" in md


def test_slo_goodput_counts_only_requests_within_three_times_their_latency_alone():
    rows = [_row(0.1, "no-spec", ALONE), _row(2.0, "no-spec", [x * 2 for x in ALONE], runs=2),
            _row(2.0, "adaptive", [3.0, 6.1, 9.0, 12.0, 31.0])]
    goodput = gs.slo_goodput(rows, "a")
    assert goodput is not None
    assert goodput[(0.1, "no-spec")] == pytest.approx(50 / 100.0)
    assert goodput[(2.0, "no-spec")] == pytest.approx(50 / 100.0)  # per run, not the two runs' tokens together
    assert goodput[(2.0, "adaptive")] == pytest.approx(30 / 100.0)  # 6.1 > 3 x 2.0 and 31 > 3 x 10 miss
    assert gs.slo_goodput([r for r in rows if r["policy"] == "adaptive"], "a") is None  # no latency alone known
