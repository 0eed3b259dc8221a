"""Issue 54: the 1F1B makespan solved one dependency level at a time (:mod:`sparsebalance.batching.
levels`) equals the op-by-op recurrence bit for bit, in about ``2 (M + P)`` vectorised steps
instead of ``2 M P``."""

import numpy as np
import pytest

from sparsebalance.batching import schedule
from sparsebalance.batching.levels import compile_levels, solve
from sparsebalance.batching.pipeline import PipelineShape


def op_by_op(f: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The recurrence as it was solved before (one numpy step per op)."""
    n, m, p = f.shape
    end_f, end_b, free = np.zeros((m, p, n)), np.zeros((m, p, n)), np.zeros((p, n))
    ft, bt = np.moveaxis(f, 0, -1), np.moveaxis(b, 0, -1)
    for kind, mb, s in schedule.dependency_order(p, m):
        if kind == "F":
            start = free[s] if s == 0 else np.maximum(free[s], end_f[mb, s - 1])
            free[s] = end_f[mb, s] = start + ft[mb, s]
        else:
            ready = end_f[mb, s] if s == p - 1 else end_b[mb, s + 1]
            free[s] = end_b[mb, s] = np.maximum(free[s], ready) + bt[mb, s]
    return free.max(axis=0)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 8, 16])
@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_levels_give_the_op_by_op_makespans_exactly(m, p):
    rng = np.random.default_rng(m * 10 + p)
    f = rng.exponential(1.0, size=(37, m, p)) * rng.integers(0, 2, size=(37, m, p))  # zeros too
    b = 2.0 * f + rng.exponential(0.1, size=f.shape)
    levels = compile_levels(schedule.dependency_order(p, m), m, p, p)
    want = op_by_op(f, b)
    assert np.array_equal(solve(levels, f, b), want)
    assert np.array_equal(schedule.makespans(f, b), want)


@pytest.mark.parametrize(("m", "p"), [(4, 4), (8, 8), (16, 4), (4, 8), (32, 8)])
def test_levels_are_about_two_m_plus_p_steps(m, p):
    levels = compile_levels(schedule.dependency_order(p, m), m, p, p)
    assert sum(b - a for a, b, _, _ in levels.steps) == 2 * m * p  # every op once
    assert len(levels.steps) <= 2 * (m + p)  # against 2 M P op by op


@pytest.mark.parametrize(
    ("stages", "virtual", "weight_share", "scales"),
    [(4, 1, None, ()), (4, 1, None, (1.0, 1.3, 0.8, 1.1)), (4, 1, 0.4, ()), (2, 2, None, (1.2, 0.9)), (8, 1, None, ())],
    ids=["1f1b", "1f1b-scaled", "zb-h1", "interleaved-V2", "PP8"],
)
def test_joined_pipelines_give_each_ones_makespans_exactly(stages, virtual, weight_share, scales):
    """Pipelines of different micro-batch counts in one pass (:func:`~sparsebalance.batching.
    levels.join_levels`), several columns of times at once: each one's makespan, bit for bit."""
    shape = PipelineShape.of(16, stages, ratio=1.7, scales=scales, virtual=virtual, weight_share=weight_share)
    rng = np.random.default_rng(stages * 10 + virtual)
    counts = [3, 1, 4, 4, 2, 7, 1, 5]
    times = rng.exponential(1.0, size=(sum(counts), 3))
    head = 0.1 * times * rng.integers(0, 2, size=times.shape)  # zeros too
    got = shape.joined(counts)(times, head)
    start = 0
    for i, m in enumerate(counts):
        rows = slice(start, start + m)
        want = shape.makespans(times[rows].T, head[rows].T)  # the columns as pipelines of m
        assert np.array_equal(got[i], want)
        start += m
    assert np.array_equal(shape.joined(counts)(times[:, 1], head[:, 1]), got[:, 1])


def test_joined_pipelines_refuse_an_empty_one_and_negative_stages():
    shape = PipelineShape.of(16, 4)
    with pytest.raises(ValueError, match="at least one micro-batch"):
        shape.joined([2, 0])
    with pytest.raises(ValueError, match="finite and >= 0"):
        shape.joined([2])(np.array([1.0, 1.0]), np.array([0.0, 2.0]))  # a head above its time
