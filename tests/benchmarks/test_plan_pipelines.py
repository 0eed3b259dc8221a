"""benchmarks/bench_plan.py --pipelines (issue 54): the trainer's planning + DST CPU time per step
against the simulated step, for a pipeline setting of the paper's model."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import plan_pipelines as bench  # noqa: E402


def test_measure_times_plan_and_dst_against_the_simulated_step():
    mixes = tomllib.loads(bench.CONFIG.read_text())["simulated"]["mixes"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        row = bench.measure("chatqa2", 2, 4, 4, 8, 1, mixes)
    assert (row["dp"], row["pp"], row["ranks_x_mb"]) == (2, 4, 8)
    assert row["plan_ms"] > 0 and row["dst_ms"] > 0 and row["step_s"] > 0.1  # an H200 step of Qwen2.5-3B
    assert row["share"] == pytest.approx((row["plan_ms"] + row["dst_ms"]) / 1e3 / row["step_s"])
