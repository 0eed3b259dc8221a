"""Issue 54: DST's micro-batch level prices its water levels in a few makespan passes (every
possible next midpoint of the bisection at once) and every pipeline, whatever its micro-batch
count, in one pass, with the same levels as the bisection one midpoint at a time."""

import numpy as np
import pytest

from sparsebalance.batching.pipeline import JoinedMakespans, PipelineShape
from sparsebalance.tuning import PipelineWorkload, PlanWorkload
from sparsebalance.tuning.microbatch_dst import LEVEL_RTOL, _water_level

from .test_microbatch_dst import EVEN, tuner
from .test_pipeline_dst import PLAN, EightLayers, mb, pipe


def one_at_a_time(tf, th, head, target, shape):
    """The water level's bisection as it was: one makespan pass per midpoint."""

    def span(tau):
        return shape.makespans(np.clip(tau[:, None], tf, th), head)

    a, b = tf.min(axis=1), th.max(axis=1)
    a = np.where(span(b) <= target, b, a)
    for _ in range(200):
        open_ = b - a > LEVEL_RTOL * np.abs(b)
        if not open_.any():
            break
        mid = 0.5 * (a + b)
        ok = span(mid) <= target
        a, b = np.where(open_ & ok, mid, a), np.where(open_ & ~ok, mid, b)
    return a


@pytest.mark.parametrize("n", [1, 3, 17, 300])
def test_the_tree_finds_the_bisections_levels_exactly(n):
    rng = np.random.default_rng(n)
    shape = pipe(4)
    tf = rng.uniform(0.1, 1.0, size=(n, 4))
    th = tf * rng.uniform(1.0, 3.0, size=(n, 4))
    head = 0.05 * tf
    lo = shape.makespans(tf, head)
    target = lo * rng.uniform(0.9, 2.5, size=n)  # some below the floors, some above the top
    flat = (x.reshape(-1) for x in (tf, th, head))
    got = _water_level(*flat, np.maximum(target, lo), shape.joined([4] * n))
    want = one_at_a_time(tf, th, head, np.maximum(target, lo), shape)
    assert np.array_equal(got, want)


PASSES = 45  # measured on this plan: 72 with a pass per micro-batch count, 41 with one for every pipeline


def test_a_decision_takes_a_few_makespan_passes(monkeypatch):
    """Two pipelines of different micro-batch counts and documents per micro-batch (two groups):
    before, ~25 passes per water level and group, and one search for the cuts and another for
    the raises; now a level takes ~4, every pipeline shares them and one search finds both."""
    calls = []
    real_joined, real_shape = JoinedMakespans.__call__, PipelineShape.makespans

    def counting_joined(self, times, head=0.0):
        calls.append(np.shape(times))
        return real_joined(self, times, head)

    def counting_shape(self, times, head=0.0):
        calls.append(np.shape(times))
        return real_shape(self, times, head)

    plan = [PLAN[0], [mb(2000, 10, 5), mb(2000, 10), mb(2000, 10)]]
    t = tuner()
    work = PipelineWorkload(PlanWorkload(plan, EightLayers(), t.knob), pipe(4))
    assert len(work.work.groups) == 2
    monkeypatch.setattr(JoinedMakespans, "__call__", counting_joined)
    monkeypatch.setattr(PipelineShape, "makespans", counting_shape)
    t.decide_arrays(work)
    assert 0 < len(calls) <= PASSES, len(calls)


def test_the_even_plan_decides_as_before():
    """A smoke check beside the pinned cases (test_plan_dst_golden): the critical micro-batch is
    still cut and the others raised."""
    t = tuner()
    dec = t.decide(EVEN, EightLayers(), pipeline=pipe(4))
    for r in dec.ranks:
        assert r.microbatch_budgets[0] < t.base < min(r.microbatch_budgets[1:])
