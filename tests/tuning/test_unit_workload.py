"""DST over context-parallel units: workers, prices that match the planner, one budget per unit."""

from __future__ import annotations

import numpy as np
import pytest

from sparsebalance.batching import PlanConfig
from sparsebalance.batching.planner import assign_batch
from sparsebalance.simulate.engine import _workload
from sparsebalance.tuning import DensityCurve, DSTConfig, DSTTuner, UnitWorkload
from tests.batching.fake_cost import fake_context


def hybrid_assignment(seed=0, r=8, long=(30000, 21000)):
    rng = np.random.default_rng(seed)
    lens = np.concatenate([rng.integers(100, 3000, 6 * r), long]).astype(np.int64)
    dens = rng.uniform(0.1, 0.9, lens.size)
    a = assign_batch(lens, dens, fake_context(), PlanConfig(r, micro_batches=3,
                                                            strategy="sab-cp"))  # fmt: skip
    assert a.cp is not None and a.cp.units.item.size > 0
    return a


def test_workers_join_the_ranks_of_a_unit():
    a = hybrid_assignment()
    work = _workload(a, fake_context(), DensityCurve())
    assert isinstance(work, UnitWorkload)
    u = a.cp.units
    for s, k in zip(u.start_rank.tolist(), u.degree.tolist(), strict=True):
        assert len(set(work.worker_of[s : s + k].tolist())) == 1
    assert work.num_ranks == 8 - int((u.degree - 1).sum())  # disjoint windows here
    assert np.all(np.diff(work.worker_of) >= 0)


def test_prices_at_gamma0_are_the_planners():
    a = hybrid_assignment(seed=1)
    work = _workload(a, fake_context(), DensityCurve(gamma0=0.9))
    g0 = np.full(work.num_ranks, 0.9)
    assert work.rank_seconds(g0) == pytest.approx(a.cp.rank_times, rel=1e-12)
    per_worker = work.seconds(g0)
    assert per_worker.max() == pytest.approx(a.cp.rank_times.max(), rel=1e-12)
    # monotone in a worker's gamma, and only that worker moves
    lower = g0.copy()
    lower[0] = 0.6
    moved = work.seconds(lower)
    assert moved[0] < per_worker[0] and np.array_equal(moved[1:], per_worker[1:])
    assert work.mean_density(lower)[0] < work.mean_density(g0)[0]
    assert work.attention_seconds(lower)[0] < work.attention_seconds(g0)[0]


def test_dst_gives_a_unit_one_budget_and_never_slows_the_step():
    a = hybrid_assignment(seed=2, long=(40000, 9000, 7000))
    work = _workload(a, fake_context(), DensityCurve(gamma0=0.9))
    before = work.seconds(np.full(work.num_ranks, 0.9)).max()
    for mode in ("down", "bidirectional"):
        dec = DSTTuner(DSTConfig(mode=mode, anchor="mean")).decide_arrays(work)
        assert dec.gammas.shape == (work.num_ranks,)
        assert dec.times_after.max() <= before * (1 + 1e-9)
        ranks = work.rank_seconds(dec.gammas)
        assert ranks.max() == pytest.approx(dec.times_after.max())
