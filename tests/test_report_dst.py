"""A run says whether DST paid (issue 56): the step report's balances and the report's DST line."""

from __future__ import annotations

import pytest

from sparsebalance.engine.records import RankRecord
from sparsebalance.engine.summary import dst_balances
from sparsebalance.report_dst import dst_line, dst_steps


def _record(rank, before, after, measured) -> RankRecord:
    return RankRecord(rank, measured, 100, [measured], before, after, 8.0, "cut", after, 8, 8, 8, 0.5)


def test_balances_predicted_and_estimated_without_dst():
    # rank 0 cut (predicted 2.0 -> 1.5), rank 1 raised (1.0 -> 1.5); measured 1.6 and 1.4
    records = [_record(0, 2.0, 1.5, 1.6), _record(1, 1.0, 1.5, 1.4)]
    b = dst_balances(records)
    assert b["balance_predicted_before"] == pytest.approx(1.5 / 2.0)
    assert b["balance_predicted_after"] == pytest.approx(1.0)
    # without DST: 1.6 x 2.0 / 1.5 and 1.4 x 1.0 / 1.5
    without = [1.6 * 2.0 / 1.5, 1.4 / 1.5]
    assert b["balance_without_dst"] == pytest.approx(sum(without) / 2 / max(without))


def _step(step, measured, without, mode="bidirectional"):
    return {
        "step": step,
        "dst_mode": mode,
        "measured": True,
        "efficiency": measured,
        "balance_without_dst": without,
        "balance_predicted_before": 0.9,
        "balance_predicted_after": 0.99,
    }


def test_the_line_says_when_dst_paid_and_when_it_did_not():
    paid = [_step(1, 0.5, 0.9), _step(2, 0.95, 0.90), _step(3, 0.96, 0.90), _step(4, 0.90, 0.902)]
    line = dst_line(paid)
    assert "evened the ranks in 2 of 3 steps, unevened them in 0" in line  # step 1 is warm-up
    assert "did not pay" not in line
    lost = [_step(1, 0.9, 0.9), _step(2, 0.85, 0.90), _step(3, 0.86, 0.90)]
    line = dst_line(lost)
    assert "unevened them in 2" in line and "did not pay" in line
    assert [s["verdict"] for s in dst_steps(lost)] == ["tie", "lost", "lost"]


def test_no_line_without_dst_or_for_older_runs():
    assert dst_line([_step(1, 0.9, 0.8, mode="off"), _step(2, 0.9, 0.8, mode="off")]) == ""
    old = [{"step": 1, "dst_mode": "bidirectional", "efficiency": 0.9}]
    assert dst_line(old) == ""
