"""SAB with pipelines (``PlanConfig.pipeline_stages``): the exact 1F1B makespan it prices, the
order search, the refusals, P = 1 unchanged, and P > 1 never slower than rank-total SAB."""

import itertools

import numpy as np
import pytest

from sparsebalance.batching import PlanConfig, plan_batch
from sparsebalance.batching.pipeline import PipelineShape, best_orders, pack_makespans
from sparsebalance.batching.planner import assign_batch
from sparsebalance.batching.schedule import makespans, schedule_order
from sparsebalance.workload import Sample

from .fake_cost import FakeCost


class EightLayers(FakeCost):
    num_layers = 8


def reference_makespan(f: np.ndarray, b: np.ndarray) -> float:
    """1F1B by event sweeps, op by op, straight from the dependencies (the spec)."""
    m, p = f.shape
    orders = [schedule_order(p, m, s) for s in range(p)]
    end: dict = {}
    free, nxt = [0.0] * p, [0] * p
    while any(nxt[s] < len(orders[s]) for s in range(p)):
        for s in range(p):
            while nxt[s] < len(orders[s]):
                kind, mb = orders[s][nxt[s]]
                dep = ("F", mb, s - 1) if kind == "F" else (("F", mb, s) if s == p - 1 else ("B", mb, s + 1))
                if kind == "F" and s == 0:
                    ready = 0.0
                elif dep in end:
                    ready = end[dep]
                else:
                    break
                free[s] = end[(kind, mb, s)] = max(free[s], ready) + (f if kind == "F" else b)[mb, s]
                nxt[s] += 1
    return max(free)


@pytest.mark.parametrize("m,p", [(1, 1), (1, 4), (3, 2), (4, 4), (7, 3), (2, 5)])
def test_vectorised_makespans_equal_the_reference(m, p):
    rng = np.random.default_rng([m, p])
    f = rng.uniform(0.0, 2.0, (6, m, p))
    b = rng.uniform(0.0, 4.0, (6, m, p))
    got = makespans(f, b)
    want = [reference_makespan(f[i], b[i]) for i in range(6)]
    assert got == pytest.approx(want, rel=1e-12)


def test_best_orders_is_the_best_of_every_order():
    shape = PipelineShape.of(8, 4)
    rng = np.random.default_rng(3)
    times = rng.lognormal(0.0, 0.7, (5, 4))
    orders, spans = best_orders(times, shape)
    for i in range(5):
        every = [shape.makespans(times[i][list(o)][None])[0] for o in itertools.permutations(range(4))]
        assert spans[i] == pytest.approx(min(every))
        assert shape.makespans(times[i][orders[i]][None])[0] == pytest.approx(spans[i])
        assert max(every) > 1.01 * min(every)  # the order matters: what the search is for


def test_best_orders_by_swaps_beats_ascending_for_many_micro_batches():
    shape = PipelineShape.of(8, 4)
    times = np.random.default_rng(5).lognormal(0.0, 0.7, (3, 8))
    orders, spans = best_orders(times, shape)
    ascending = shape.makespans(np.sort(times, axis=1))
    assert np.all(spans <= ascending + 1e-15)
    assert sorted(orders[0].tolist()) == list(range(8))


def _span(a, shape, head=0.0):
    return float(pack_makespans(a.times[0], a.flat.mb_rank, a.flat.num_ranks, shape, head).max())


def test_pipeline_sab_beats_rank_total_sab_on_a_long_document():
    # Rank totals even out as [4000] + [1000, 1000] vs the rest; but a 1F1B pipeline's critical
    # path is the 4000-token micro-batch, so the rank holding it should hold nothing else.
    lens = np.array([4000, 1000, 1000, 1000, 1000, 1000, 1000, 2000])
    cost, shape = EightLayers(), PipelineShape.of(8, 4)
    old = assign_batch(lens, np.ones(8), cost, PlanConfig(2, 2, strategy="sab"))
    new = assign_batch(lens, np.ones(8), cost, PlanConfig(2, 2, strategy="sab", pipeline_stages=4))
    assert _span(new, shape) < 0.95 * _span(old, shape)
    assert new.extra["candidate"] == "pipeline"
    # the plan's makespan puts the micro-batch overhead (FakeCost's "head") on the last stage
    assert new.extra["makespan"] == pytest.approx(_span(new, shape, head=cost.c0))
    assert [[0]] in new.packs  # the long document's rank runs it alone


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("m,p", [(2, 2), (4, 4), (3, 8)])
def test_pipeline_sab_never_slower_than_rank_total_sab(seed, m, p):
    rng = np.random.default_rng([seed, m, p])
    r = int(rng.integers(1, 5))
    lens = np.exp(rng.uniform(np.log(64), np.log(8000), r * 6)).astype(np.int64)
    dens = rng.uniform(0.05, 1.0, lens.size)
    cost, shape = EightLayers(), PipelineShape.of(8, p)
    old = assign_batch(lens, dens, cost, PlanConfig(r, m, strategy="sab"))
    new = assign_batch(lens, dens, cost, PlanConfig(r, m, strategy="sab", pipeline_stages=p))
    assert _span(new, shape, cost.c0) <= _span(old, shape, cost.c0) * (1 + 1e-12)
    placed = sorted(i for rank in new.packs for mb in rank for i in mb)
    assert placed == list(range(lens.size))  # every document exactly once


@pytest.mark.parametrize("strategy", ["sequential", "sorted", "lbb", "tokens", "flops", "sab"])
def test_one_stage_plans_exactly_as_before(strategy):
    rng = np.random.default_rng(11)
    samples = [Sample(i, int(n)) for i, n in enumerate(rng.integers(50, 5000, 24))]
    dens = rng.uniform(0.1, 1.0, 24)
    cost = EightLayers()
    old = plan_batch(samples, cost, PlanConfig(4, 3, strategy=strategy), densities=dens)
    new = plan_batch(samples, cost, PlanConfig(4, 3, strategy=strategy, pipeline_stages=1), densities=dens)
    assert new.hash() == old.hash()
    assert new.microbatch_times == old.microbatch_times and new.rank_times == old.rank_times
    assert new.metrics.makespan == 0.0


def test_other_strategies_ignore_the_pipeline():
    samples = [Sample(i, 100 * (i + 1)) for i in range(12)]
    cost = EightLayers()
    for strategy in ("sequential", "lbb", "tokens"):
        a = plan_batch(samples, cost, PlanConfig(2, 3, strategy=strategy), densities=np.ones(12))
        b = plan_batch(samples, cost, PlanConfig(2, 3, strategy=strategy, pipeline_stages=4), densities=np.ones(12))
        assert a.hash() == b.hash()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"pipeline_stages": 0}, "--pp must be an integer >= 1"),
        ({"pipeline_stages": True}, "--pp must be an integer >= 1"),
        ({"pipeline_stages": 2.0}, "--pp must be an integer >= 1"),
        ({"pipeline_stages": 2, "strategy": "sab-cp"}, "--pp 2: pipelines are not planned with context-parallel"),
    ],
)
def test_bad_pipeline_stages_refused_in_one_line(kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        PlanConfig(2, 4, **kwargs)
    assert "\n" not in str(err.value)


def test_more_stages_than_layers_refused():
    with pytest.raises(ValueError, match="more pipeline stages than the model's 8 layers"):
        plan_batch([Sample(0, 10), Sample(1, 20)], EightLayers(), PlanConfig(1, 2, pipeline_stages=9), densities=[1, 1])


def test_a_learned_slow_last_stage_is_priced_into_the_makespan():
    """``PlanConfig.stage_scales`` / ``backward_ratio`` (a run's measured stages,
    :mod:`sparsebalance.engine.stage_calibration`): each stage's share times its scale, split at
    the ratio, is the exact 1F1B makespan the planner prices; the identity prices as before."""
    from sparsebalance.batching.schedule import spread_stages

    times = np.random.default_rng(7).lognormal(0.0, 0.7, (5, 4))
    identity, slow = PipelineShape.of(8, 4), PipelineShape.of(8, 4, (), 3.0, (1.0, 1.0, 1.0, 2.0))
    stages = spread_stages(times, 0.0, identity.layers) * np.array([1.0, 1.0, 1.0, 2.0])
    want = [reference_makespan(st / 4.0, st * 3.0 / 4.0) for st in stages]
    assert slow.makespans(times) == pytest.approx(want, rel=1e-12)
    assert np.all(slow.makespans(times) > 1.2 * identity.makespans(times))
    ones = PipelineShape.of(8, 4, (), 2.0, (1.0,) * 4)
    assert np.array_equal(ones.makespans(times), identity.makespans(times))
    # the plan: its makespan is priced with the scales; the identity plans exactly as the default
    lens = np.array([4000, 1000, 1000, 1000, 1000, 1000, 1000, 2000])
    cost = EightLayers()
    base = assign_batch(lens, np.ones(8), cost, PlanConfig(2, 2, strategy="sab", pipeline_stages=4))
    same = assign_batch(
        lens, np.ones(8), cost, PlanConfig(2, 2, pipeline_stages=4, stage_scales=(1.0,) * 4, backward_ratio=2.0)
    )
    assert same.packs == base.packs and same.extra["makespan"] == base.extra["makespan"]
    cfg = PlanConfig(2, 2, strategy="sab", pipeline_stages=4, stage_scales=(1.0, 1.0, 1.0, 2.0), backward_ratio=3.0)
    learned = assign_batch(lens, np.ones(8), cost, cfg)
    assert learned.extra["makespan"] == pytest.approx(_span(learned, slow, head=cost.c0))
    assert learned.extra["makespan"] > 1.2 * base.extra["makespan"]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"stage_scales": (1.0,)}, r"stage_scales must be a tuple of one scale per pipeline stage \(--pp 2\)"),
        ({"stage_scales": (1.0, 0.0)}, "stage_scales must be finite and > 0"),
        ({"backward_ratio": float("nan")}, "backward_ratio must be finite and >= 0"),
    ],
)
def test_bad_stage_pricing_refused_in_one_line(kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        PlanConfig(2, 4, pipeline_stages=2, **kwargs)
    assert "\n" not in str(err.value)


def test_the_exchange_search_at_eight_micro_batches_returns_searched_orders():
    """Issue 54 (PP 8 planning): above EXHAUSTIVE_ORDER micro-batches the exchange search prices
    its candidates in the ascending order, an upper bound; the ranks it returns are in their
    searched order, their makespans are those orders' makespans, and the longest never exceeds
    the start's."""
    from sparsebalance.batching.pipeline import EXHAUSTIVE_ORDER, pipeline_search, rank_makespans
    from sparsebalance.batching.strategies import Regime

    m, ranks, exchanges = 8, 4, 0
    assert m > EXHAUSTIVE_ORDER
    regime, shape = Regime(m, None, 0.01), PipelineShape.of(16, 8)
    for seed in range(6):
        cost = np.random.default_rng(seed).lognormal(0.0, 1.0, ranks * 16)
        tokens = np.ones(cost.size, dtype=np.int64)
        start = [list(range(r, cost.size, ranks)) for r in range(ranks)]
        _, before = rank_makespans(start, cost, tokens, regime, shape)
        packs, spans, made = pipeline_search(start, cost, tokens, regime, shape, max_iters=50)
        assert spans.max() <= before.max() * (1 + 1e-12)
        exchanges += made
        for rank, span in zip(packs, spans, strict=True):
            times = np.array([[regime.overhead + cost[mb].sum() for mb in rank]])
            assert shape.makespans(times)[0] == pytest.approx(span)  # its run order's makespan
            assert span == pytest.approx(best_orders(times, shape)[1][0])  # and that order searched
    assert exchanges > 0  # some seeds exchanged (one huge item can leave nothing to move)


def test_the_exchange_search_order_searches_only_what_it_keeps(monkeypatch):
    """The order search (M > EXHAUSTIVE_ORDER: swap rounds over every pair) runs for the start's
    ranks and the two ranks of each exchange made, not for every candidate (before: for every
    candidate of every exchange step, nearly all of PP 8's planning time, issue 54)."""
    from sparsebalance.batching import pipeline as pl
    from sparsebalance.batching.strategies import Regime

    searched, real = [0], pl.best_orders

    def counting(times, shape):
        if times.shape[1] > pl.EXHAUSTIVE_ORDER:
            searched[0] += times.shape[0]
        return real(times, shape)

    monkeypatch.setattr(pl, "best_orders", counting)
    cost = np.random.default_rng(0).lognormal(0.0, 1.0, 64)
    start = [list(range(r, 64, 4)) for r in range(4)]
    regime, shape = Regime(8, None, 0.01), PipelineShape.of(16, 8)
    _, _, made = pl.pipeline_search(start, cost, np.ones(64, dtype=np.int64), regime, shape, max_iters=50)
    assert made > 0 and searched[0] <= 4 + 2 * made
