"""Issue 55: measuring a profile said "about 70 s" whatever the capacity, and took 401.5 s at
``--capacity 16384`` with no progress. Now the time is estimated on this machine from the design's
micro-batches (they grow with the longest micro-batch profiled), said once they are chosen, a few
seconds in, and a bar of the seconds runs on a terminal."""

from __future__ import annotations

import pytest
import torch

from sparsebalance.latency import measure
from sparsebalance.latency.wait import OPTIMIZER_ALLOWANCE_S, expected_seconds
from sparsebalance.models import load_shapes

TINY = load_shapes("tiny")
CPU = torch.device("cpu")


class _Said(Exception):
    """Stops a measurement once it has said how long it takes."""


def _estimate(max_len: int, budget_s: float) -> float:
    def announce(seconds: float) -> None:
        raise _Said(seconds)

    with pytest.raises(_Said) as said:
        measure.measure_profile(
            TINY, CPU, "fp32", "torch", block_size=64, max_len=max_len, budget_s=budget_s, threads=1, announce=announce
        )
    return said.value.args[0]


def test_the_expected_time_is_the_budget_or_the_design_whichever_is_longer():
    assert expected_seconds(1.0, 0.5, 50.0, 4) == 50.0 + OPTIMIZER_ALLOWANCE_S  # a cheap design: the budget
    assert expected_seconds(1.0, 30.0, 50.0, 4) == 121.0 + OPTIMIZER_ALLOWANCE_S  # four passes of 30 s


def test_the_estimate_grows_with_the_longest_micro_batch():
    short, long = _estimate(512, 6.0), _estimate(16384, 6.0)
    assert short == pytest.approx(6.0 + OPTIMIZER_ALLOWANCE_S, abs=2.0)  # the budget
    assert long > 2 * short  # the long dense corner alone costs seconds a timing


@pytest.mark.timeout(120)
def test_a_measurement_says_its_time_once_before_it_waits():
    said: list[float] = []
    profile = measure.measure_profile(
        TINY, CPU, "fp32", "torch", block_size=64, max_len=256, budget_s=3.0, threads=1, announce=said.append
    )
    assert len(said) == 1 and said[0] >= 3.0
    assert profile.meta["expected_seconds"] == said[0]
    assert profile.meta["pilot_seconds"] < profile.meta["profiling_seconds"]
