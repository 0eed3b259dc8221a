"""``--cp K``: a fixed context-parallel degree on the aligned groups of a ``(dp, cp)`` mesh."""

from __future__ import annotations

import numpy as np
import pytest

from sparsebalance.batching import PlanConfig, check_units, plan_batch
from sparsebalance.workload import Sample
from tests.batching.fake_cost import fake_context

CAP = 2000


def _plan(lengths, k, world=8, **kw):
    samples = [Sample(i, n) for i, n in enumerate(lengths)]
    dens = np.full(len(lengths), 0.5)
    cfg = PlanConfig(world, capacity=CAP, strategy="sab-cp", cp_degree=k, **kw)
    plan = plan_batch(samples, fake_context(per_node=8), cfg, dens)
    units, rank_units = plan.execution()
    check_units(units, rank_units, {s.id: s.num_tokens for s in samples}, CAP, plan.metrics.skipped_ids)
    return plan, units


def test_every_unit_has_k_ranks_on_an_aligned_group():
    # 3000 and 3900 need 2 ranks; free sab-cp could use 3 for the 5000 one: with --cp 2 it is
    # over 2 x C and --overlong splits it (counted)
    lengths = [3000, 3900, 5000, 300, 800, 120, 1500, 60]
    plan, units = _plan(lengths, 2)
    cp = [u for u in units if u.degree > 1]
    assert cp and all(u.degree == 2 and u.ranks[0] % 2 == 0 for u in cp)
    assert plan.metrics.num_overlong == 1 and plan.metrics.num_split_chunks == 2  # 4000 + 1000
    free, free_units = _plan(lengths, None)
    assert free.metrics.num_overlong == 0  # without --cp the 5000-token document stays whole
    assert any(u.degree == 3 for u in free_units)


def test_k_four_on_eight_ranks():
    _, units = _plan([7000, 6100, 100, 200, 3000], 4, overlong="skip")
    cp = [u for u in units if u.degree > 1]
    assert {u.ranks for u in cp} <= {(0, 1, 2, 3), (4, 5, 6, 7)} and len(cp) == 3


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"cp_degree": 3}, r"--cp 3 must divide the world size \(8\)"),
        ({"cp_degree": 1}, "--cp must be an integer >= 2"),
        ({"cp_degree": 2, "strategy": "sab"}, "--cp 2 needs --strategy sab-cp"),
    ],
)
def test_bad_cp(kw, match):
    with pytest.raises(ValueError, match=match):
        PlanConfig(8, capacity=CAP, **{"strategy": "sab-cp", **kw})
