"""Issue 56: ``benchmarks/dst_gain.py``'s statistics. One rank measured 2.2x its prediction in one
step (a load burst, seed 0 of 2026-12-02-dst-gain-attention-x2-ranks) read as DST on SAB 0.974x
by the geometric mean where the median of the same pairs was 1.023x: the row's headline is the
median, which one burst cannot move, and the bursts are counted."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import dst_gain


def _step(measured: list[float], predicted: list[float]) -> dict:
    m = np.array(measured)
    ranks = [
        {"role": "kept", "compute_s": a, "dst_layer_s": 0.0, "coverage_limited": 0, "predicted_before_s": b,
         "predicted_s": b, "realised_s": b, "truth_s": b}
        for a, b in zip(measured, predicted, strict=True)
    ]  # fmt: skip
    return {
        "max_s": float(m.max()),
        "balance": float(m.mean() / m.max()),
        "density": 0.5,
        "predicted_max_before_s": max(predicted),
        "predicted_max_s": max(predicted),
        "predicted_balance": 1.0,
        "realised_max_s": max(predicted),
        "layer_dst_share": 0.0,
        "ranks": ranks,
    }


def _seed(burst_at: int | None) -> dict:
    """Six step pairs (the first a warm-up): SAB's slowest rank 1.05, SAB+DST's 1.00 (DST on SAB
    1.05x); in pair ``burst_at`` one SAB+DST rank runs 2.2x its prediction."""
    sab, dst = [], []
    for i in range(6):
        sab.append(_step([1.05, 1.0, 0.95, 0.9], [1.05, 1.0, 0.95, 0.9]))
        measured = [1.0, 0.99, 0.98, 0.97]
        if i == burst_at:
            measured[1] *= 2.2
        dst.append(_step(measured, [1.0, 0.99, 0.98, 0.97]))
    return {"sab": sab, "sab+dst": dst}


def test_one_burst_moves_the_geometric_mean_not_the_median():
    clean = dst_gain.summarize({0: _seed(None), 1: _seed(None)})
    burst = dst_gain.summarize({0: _seed(2), 1: _seed(None)})
    assert clean["dst_on_sab"] == pytest.approx(1.05) and clean["geometric_mean"] == pytest.approx(1.05)
    assert burst["dst_on_sab"] == pytest.approx(1.05)  # the median
    assert burst["geometric_mean"] < 0.99  # 9 pairs at 1.05x and one at 0.48x
    assert (burst["sab"]["bursts"], burst["sab+dst"]["bursts"]) == (0, 1)
    assert (clean["sab"]["bursts"], clean["sab+dst"]["bursts"]) == (0, 0)
    assert burst["truth_dst_on_sab"] == pytest.approx(1.05)  # the model does not see the burst


def test_the_interval_brackets_the_point_and_is_reproducible():
    per_seed = {0: _seed(2), 1: _seed(None)}
    a, b = dst_gain.summarize(per_seed), dst_gain.summarize(per_seed)
    lo, hi = a["interval"]
    assert lo <= a["dst_on_sab"] <= hi and a["interval"] == b["interval"]


def test_the_table_heads_with_the_median():
    row = dst_gain.summarize({0: _seed(2)})
    md = dst_gain.table({"heavy": row})
    assert "DST on SAB, median (95 % interval)" in md and "load bursts" in md and "0 / 1" in md
