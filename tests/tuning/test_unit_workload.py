"""DST over context-parallel units: workers, prices that match the planner, one budget per unit,
for both budget kinds (top-k and gamma)."""

from __future__ import annotations

import numpy as np
import pytest

from sparsebalance.batching import PlanConfig
from sparsebalance.batching.planner import assign_batch
from sparsebalance.simulate.engine import _workload
from sparsebalance.tuning import DSTConfig, DSTTuner, UnitWorkload
from tests.batching.fake_cost import fake_context

CONFIGS = {
    "gamma": DSTConfig(budget="gamma", gamma0=0.9),
    "top-k": DSTConfig(budget="top-k", budget_tokens=1024),
}


def hybrid_assignment(kind, seed=0, r=8, long=(30000, 21000)):
    """A sab-cp assignment priced like the planner does for ``kind``; the knob; the content."""
    rng = np.random.default_rng(seed)
    lens = np.concatenate([rng.integers(100, 3000, 6 * r), long]).astype(np.int64)
    content = rng.uniform(0.1, 0.9, lens.size)
    knob = CONFIGS[kind].knob(block_size=128)
    dens = content if kind == "gamma" else knob.density(lens, content, float(knob.base))
    a = assign_batch(lens, dens, fake_context(), PlanConfig(r, micro_batches=3, strategy="sab-cp"))
    assert a.cp is not None and a.cp.units.item.size > 0
    return a, knob, content


@pytest.mark.parametrize("kind", CONFIGS)
def test_workers_join_the_ranks_of_a_unit(kind):
    a, knob, content = hybrid_assignment(kind)
    work = _workload(a, fake_context(), knob, content, None)
    assert isinstance(work, UnitWorkload)
    u = a.cp.units
    for s, k in zip(u.start_rank.tolist(), u.degree.tolist(), strict=True):
        assert len(set(work.worker_of[s : s + k].tolist())) == 1
    assert work.num_ranks == 8 - int((u.degree - 1).sum())  # disjoint windows here
    assert np.all(np.diff(work.worker_of) >= 0)


@pytest.mark.parametrize("kind", CONFIGS)
def test_prices_at_the_base_budget_are_the_planners(kind):
    a, knob, content = hybrid_assignment(kind, seed=1)
    work = _workload(a, fake_context(), knob, content, None)
    base = np.full(work.num_ranks, float(knob.base))
    assert work.rank_seconds(base) == pytest.approx(a.cp.rank_times, rel=1e-12)
    per_worker = work.seconds(base)
    assert per_worker.max() == pytest.approx(a.cp.rank_times.max(), rel=1e-12)
    # monotone in a worker's budget, and only that worker moves
    lower = base.copy()
    lower[0] = 0.6 if kind == "gamma" else knob.base / 2
    moved = work.seconds(lower)
    assert moved[0] < per_worker[0] and np.array_equal(moved[1:], per_worker[1:])
    assert work.mean_density(lower)[0] < work.mean_density(base)[0]
    assert work.attention_seconds(lower)[0] < work.attention_seconds(base)[0]


@pytest.mark.parametrize("kind", CONFIGS)
def test_dst_gives_a_unit_one_budget_and_never_slows_the_step(kind):
    a, knob, content = hybrid_assignment(kind, seed=2, long=(40000, 9000, 7000))
    work = _workload(a, fake_context(), knob, content, None)
    before = work.seconds(np.full(work.num_ranks, float(knob.base))).max()
    for mode, margin in (("down", 1.0), ("bidirectional", 1.0), ("bidirectional", 2.0)):
        cfg = DSTConfig(**{**CONFIGS[kind].__dict__, "mode": mode, "anchor": "mean", "skew_margin": margin})
        dec = DSTTuner(cfg, knob=knob).decide_arrays(work)
        assert dec.budgets.shape == (work.num_ranks,)
        assert dec.times_after.max() <= before * (1 + 1e-9)
        ranks = work.rank_seconds(dec.budgets)
        assert ranks.max() == pytest.approx(dec.times_after.max())
        if mode == "bidirectional" and margin == 1.0:  # the model trusted: raises and cuts
            assert (dec.budgets > knob.base).any() and (dec.budgets < knob.base).any()
            trusting = dec.budgets
        elif mode == "bidirectional":  # the margin lowers raises only, never below the base
            raised = trusting > knob.base
            assert np.all(dec.budgets[raised] <= trusting[raised] + 1e-12)
            assert np.all(dec.budgets[raised] >= knob.base)
            assert np.array_equal(dec.budgets[~raised], trusting[~raised])
