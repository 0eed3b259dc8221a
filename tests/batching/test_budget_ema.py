"""The paper's SAB estimate: per-length-bin EMA of final top-k budgets; lbb (length-based
batching) as a baseline strategy."""

from __future__ import annotations

import numpy as np
import pytest

from sparsebalance.batching import (
    BudgetEMAEstimator,
    HistoryEstimator,
    PlanConfig,
    make_estimator,
    plan_batch,
)
from sparsebalance.ops import topk_density
from sparsebalance.tuning import DSTConfig
from sparsebalance.workload import Sample

from ..tuning.oracle import Oracle


def samples(lengths):
    return [Sample(i, int(n)) for i, n in enumerate(lengths)]


def test_unseen_bins_answer_the_base_budget():
    est = BudgetEMAEstimator(base=8, block_size=64)
    s = samples([100, 1000, 5000])
    np.testing.assert_allclose(est.estimate(s), topk_density([100, 1000, 5000], 8, 64))


def test_average_per_bin_with_decay():
    est = BudgetEMAEstimator(base=8, block_size=64, decay=0.5)
    s = samples([1500, 1800, 3000])  # bins 10, 10, 11
    est.observe(s, budgets=[4.0, 6.0, 12.0])  # first sight: the step's mean per bin
    np.testing.assert_allclose(est.budgets([1024, 2047, 2048, 100]), [5.0, 5.0, 12.0, 8.0])
    est.observe(samples([1200]), budgets=[9.0])
    assert est.budgets([1200])[0] == pytest.approx(0.5 * 5.0 + 0.5 * 9.0)
    assert est.estimate(samples([1200]))[0] == pytest.approx(topk_density(1200, 7.0, 64))
    # state round-trips; a history state is refused with a one-line reason
    other = BudgetEMAEstimator(base=1, block_size=32)
    other.load_state_dict(est.state_dict())
    assert other.budgets([1200, 3000]).tolist() == est.budgets([1200, 3000]).tolist()
    with pytest.raises(ValueError, match="not a budget EMA"):
        other.load_state_dict(HistoryEstimator().state_dict())
    with pytest.raises(ValueError, match="history regression"):
        HistoryEstimator().load_state_dict(est.state_dict())


def test_bad_observations():
    est = BudgetEMAEstimator(base=8, block_size=64)
    with pytest.raises(ValueError, match="final budgets"):
        est.observe(samples([100]), [0.5])
    with pytest.raises(ValueError, match="1 samples but 2"):
        est.observe(samples([100]), budgets=[1.0, 2.0])
    with pytest.raises(ValueError, match="k >= 0"):
        est.observe(samples([100]), budgets=[-1.0])


def test_make_estimator_follows_the_budget_kind():
    topk, gamma = DSTConfig().knob(64), DSTConfig(budget="gamma").knob(64)
    assert isinstance(make_estimator("auto", topk), BudgetEMAEstimator)
    assert isinstance(make_estimator("auto", gamma), HistoryEstimator)
    assert isinstance(make_estimator("history", topk), HistoryEstimator)
    assert make_estimator("ema", topk).base == 128  # 8192 tokens / 64
    with pytest.raises(ValueError, match="needs --budget top-k"):
        make_estimator("ema", gamma)
    with pytest.raises(ValueError, match="--estimator"):
        make_estimator("probe", topk)


@pytest.mark.parametrize("regime", [dict(micro_batches=2), dict(capacity=6000)])
def test_lbb_buckets_consecutive_lengths_dealt_in_snake_order(regime):
    lengths = [500, 4000, 100, 2500, 3000, 800, 1200, 50]
    plan = plan_batch(samples(lengths), Oracle(), PlanConfig(2, strategy="lbb", **regime), densities=np.full(8, 0.5))
    order = np.argsort(-np.array(lengths), kind="stable")
    mbs = [mb for rank in plan.ranks for mb in rank]
    # every micro-batch is a run of consecutive documents of the length order
    pos = {int(i): j for j, i in enumerate(order)}
    for mb in mbs:
        p = sorted(pos[i] for i in mb.sample_ids)
        assert p == list(range(p[0], p[0] + len(p)))
    # micro-batches in length order go to ranks 0, 1, 1, 0, 0, 1, ... (snake order)
    firsts = sorted((min(pos[i] for i in mb.sample_ids), r) for r, rank in enumerate(plan.ranks) for mb in rank)
    assert [r for _, r in firsts] == [(0, 1, 1, 0)[j % 4] for j in range(len(firsts))]
    if "micro_batches" in regime:
        assert [len(rank) for rank in plan.ranks] == [2, 2]
    else:
        assert all(mb.num_tokens <= 6000 for mb in mbs)
