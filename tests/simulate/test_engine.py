"""The simulator's engine: determinism, identical samples, ablation ordering, vectorised DST."""

import warnings
from dataclasses import asdict

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sparsebalance.batching import PlanConfig, plan_batch
from sparsebalance.latency import LatencyModel, analytic_profile
from sparsebalance.models import load_shapes
from sparsebalance.simulate import SimConfig, run_simulation, simulate_steps
from sparsebalance.tuning import DSTConfig, DSTTuner, PlanWorkload
from sparsebalance.tuning.knob import GAMMA_TOL, TOPK_TOL
from sparsebalance.workload import Sample

from ..conftest import examples
from ..tuning.oracle import Oracle, random_plan

ORACLE = Oracle()
SMALL = dict(world_sizes=(4, 16), micro_batches=2, steps=3, samples_per_rank=4, max_len=8192)


def _config(**kw):
    from sparsebalance.simulate import LengthDistribution

    base = {**SMALL, **kw}
    max_len = base.pop("max_len")
    return SimConfig(lengths=LengthDistribution("heavy", 128, max_len), **base)


def test_deterministic_under_seed_and_workers():
    a = run_simulation(_config(seed=3))
    b = run_simulation(_config(seed=3, workers=2))
    c = run_simulation(_config(seed=4))
    for ra, rb in zip(a["results"], b["results"], strict=True):
        assert ra["per_step"] == rb["per_step"]
        assert ra["strategies"] == rb["strategies"]
    assert a["results"][0]["per_step"] != c["results"][0]["per_step"]


def test_identical_samples_give_speedup_one():
    # every rank holds the same documents: nothing to balance, nothing to tune
    batch = (np.full(16, 2048), np.full(16, 0.3))
    out = simulate_steps([batch, batch], 8, ORACLE, micro_batches=2, step_overhead=1e-3, block_size=128)
    for name, s in out["strategies"].items():
        assert s["speedup"] == pytest.approx(1.0, abs=1e-12), name
        assert s["balance_efficiency"] == pytest.approx(1.0)
        assert s["budget_cut_seconds"] == 0.0


def test_strategies_see_the_same_samples_and_baseline_is_first():
    out = simulate_steps(
        [(np.arange(1, 17) * 300, np.full(16, 0.2))],
        4,
        ORACLE,
        capacity=8192,
        strategies=["sab+dst", "tokens", "flops+dst"],
        block_size=128,
    )
    assert list(out["strategies"]) == ["baseline", "sab+dst", "tokens", "flops+dst"]
    # DST off never moves budget; the same batch under every strategy: same attention at gamma0
    assert out["strategies"]["tokens"]["budget_given_seconds"] == 0.0


def _batch(seed: int, n: int):
    rng = np.random.default_rng(seed)
    return rng.integers(64, 16384, n), rng.uniform(0.05, 1.0, n)


def _dst_config(kind: str) -> DSTConfig:
    return DSTConfig(budget_tokens=1024) if kind == "top-k" else DSTConfig(budget="gamma")


def _dst_step(batch, ranks: int, planner: str, kind: str) -> tuple[float, float, float]:
    """DST on one planner's plan, decided as the simulator decides it (no coverage model):
    ``(step seconds, its target T', search slack)``.

    What the code guarantees: the step never exceeds ``T'`` (the largest of the cut threshold,
    the floor time of a bottleneck that cannot reach it, and the untouched ranks; raises stop at
    the anchor <= T'), and a cut worker ends at most the search's slack below its limit: the
    step-level search stops with ``f(lo) <= limit < f(hi)`` and ``hi - lo <= tol`` (``TOPK_TOL``
    blocks or ``GAMMA_TOL``), so at most ``f(v + tol) - f(v)`` below it."""
    samples = [Sample(i, int(n)) for i, n in enumerate(batch[0])]
    config = PlanConfig(ranks, micro_batches=2, strategy=planner)
    tuner = DSTTuner(_dst_config(kind), block_size=128)
    knob = tuner.knob
    dens = batch[1] if kind == "gamma" else knob.density(batch[0], batch[1], float(knob.base))
    plan = plan_batch(samples, ORACLE, config, dens)
    work = PlanWorkload(plan.ranks, ORACLE, knob)
    decision = tuner.decide_arrays(work)
    times = work.seconds(decision.budgets)
    tol = TOPK_TOL if kind == "top-k" else GAMMA_TOL
    slack = float((work.seconds(decision.budgets + tol) - times).max())
    return float(times.max()), decision.targets.post_cut_seconds, slack


ROUNDING = 1e-12  # the same sums in another order (anchors, thresholds)


@settings(max_examples=examples(15))
@given(
    seed=st.integers(0, 2**31 - 1),
    ranks=st.integers(2, 12),
    per_rank=st.integers(1, 6),
    kind=st.sampled_from(["top-k", "gamma"]),
)
# bisection slack: sab+dst 0.4400612 s vs dst 0.4400611 s (failed a 1e-12 tolerance, gamma)
@example(seed=920559, ranks=2, per_rank=2, kind="gamma")
# found by the explore profile (seed 12, 2,000 examples; gamma, raises up to T'): SAB packs two
# dense documents on one rank whose time even at gamma_min (0.683 s) is above the cut threshold
# (0.655 s); DST then raised every other rank to that floor: sab+dst 0.683 s vs dst 0.655 s
@example(seed=173425, ranks=10, per_rank=2, kind="gamma")
@example(seed=173425, ranks=10, per_rank=2, kind="top-k")
@example(seed=1, ranks=2, per_rank=3, kind="top-k")  # whole-block cuts landed a block apart
def test_sab_dst_against_sab_and_dst(seed, ranks, per_rank, kind):
    batch = _batch(seed, ranks * per_rank)
    out = simulate_steps(
        [batch],
        ranks,
        ORACLE,
        micro_batches=2,
        dst=_dst_config(kind),
        block_size=128,
        coverage=False,
        strategies=["sab", "dst", "sab+dst"],
    )
    s = out["strategies"]
    sab_dst, sab_dst_target, _ = _dst_step(batch, ranks, "sab", kind)
    dst, dst_target, slack = _dst_step(batch, ranks, "sequential", kind)
    assert (sab_dst, dst) == (s["sab+dst"]["compute_seconds"], s["dst"]["compute_seconds"])
    assert 0.0 <= slack < 1e-4 * dst  # the search's width is a tiny time
    # DST never slows a plan down and never ends above its target T'; nor more than the
    # search's slack below it
    assert sab_dst <= s["sab"]["compute_seconds"] * (1 + ROUNDING)
    assert sab_dst <= sab_dst_target * (1 + ROUNDING)
    assert dst >= (dst_target - slack) * (1 - ROUNDING)
    # hence SAB + DST is never slower than DST on the unbalanced plan, up to that slack, when its
    # target is no higher; it can be higher when a rank of the SAB plan cannot reach the cut
    # threshold even at the floor: nothing in DST's rule prevents that (under the paper's rule
    # the others are raised only to the anchor, so the floor rank alone sets the step)
    if sab_dst_target <= dst_target * (1 + ROUNDING):
        assert sab_dst <= (dst + slack) * (1 + ROUNDING)


def test_search_slack_bounds_the_first_counterexample():
    # issue 25's example (sab+dst above dst by 3e-7 under plain bisection): the excess, if any,
    # is within the search's slack, and the slack is a tiny time
    batch = _batch(920559, 4)
    sab_dst, sab_dst_target, _ = _dst_step(batch, 2, "sab", "gamma")
    dst, dst_target, slack = _dst_step(batch, 2, "sequential", "gamma")
    assert sab_dst_target <= dst_target * (1 + ROUNDING)
    assert sab_dst - dst <= slack and 0 < slack < 1e-5 * dst


@settings(max_examples=examples(15))
@given(
    seed=st.integers(0, 2**31 - 1),
    ranks=st.integers(2, 12),
    per_rank=st.integers(1, 6),
    p=st.sampled_from([0.0, 0.05, 0.1, 0.3]),
    anchor=st.sampled_from(["min", "mean", "median", "max"]),
)
def test_dst_with_the_coverage_bound(seed, ranks, per_rank, p, anchor):
    """With the coverage bound (the simulator's coverage model), whatever the anchor: DST never
    slows its own plan (so SAB + DST <= SAB), no cut loses more than p of the coverage, p = 0
    never cuts below the base budget, and the step lands on the anchor unless the bound stopped
    a cut (then on the slowest bounded worker)."""
    from sparsebalance.batching import PlanConfig
    from sparsebalance.batching.planner import assign_batch
    from sparsebalance.simulate.engine import _workload
    from sparsebalance.simulate.sparsity import CoverageModel

    rng = np.random.default_rng(seed)
    n = ranks * per_rank
    lens, content = rng.integers(64, 16384, n), rng.uniform(0.05, 1.0, n)
    cfg = DSTConfig(budget_tokens=1024, p=p, anchor=anchor)
    knob = cfg.knob(128)
    cover = CoverageModel(knob.density, cfg.gamma0)
    dens = knob.density(lens, content, float(knob.base))
    for planner in ("sequential", "sab"):
        a = assign_batch(lens, dens, ORACLE, PlanConfig(ranks, micro_batches=2, strategy=planner))
        work = _workload(a, ORACLE, knob, content, cover)
        dec = DSTTuner(cfg, knob=knob).decide_arrays(work)
        base = np.full(work.num_ranks, float(knob.base))
        before = work.seconds(base)
        assert dec.times_after.max() <= before.max() * (1 + 1e-12)
        cut = dec.budgets < knob.base
        loss = work.coverage(base) - work.coverage(dec.budgets)
        assert np.all(loss[cut] <= p + 1e-9)
        if p == 0:
            assert not cut.any()
        bounded = np.asarray(dec.targets.times_floor) > dec.targets.cut_threshold
        expect = max(
            dec.targets.anchor_seconds,
            float(np.max(np.asarray(dec.targets.times_floor)[bounded], initial=0)),
        )
        if (np.asarray(dec.targets.roles) == "cut").any():
            assert dec.times_after.max() <= expect * (1 + 1e-9)


def test_vectorised_decide_matches_per_rank_path():
    model = LatencyModel(analytic_profile(load_shapes("qwen2.5-0.5b"), block_size=128))
    rng = np.random.default_rng(5)
    plan = random_plan(rng, 9, mbs_per_rank=3, docs=(1, 5), lengths=(256, 16384), d0=(0.05, 0.9))
    plan[2] = plan[2][:1]  # ranks of different shapes
    for cm in (ORACLE, model):
        for anchor in ("min", "mean", "max"):
            tuner = DSTTuner(DSTConfig(anchor=anchor, p=0.05, skew_margin=1.0), block_size=64)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dec = tuner.decide(plan, cm)
                for r, mbs in enumerate(plan):
                    assert asdict(tuner.decide_rank(r, mbs, cm, dec.targets)) == asdict(dec.ranks[r])


def test_bad_input():
    with pytest.raises(ValueError, match="--world-size"):
        simulate_steps([([100], [0.5])], 0, ORACLE, micro_batches=1, block_size=128)
    with pytest.raises(ValueError, match="--strategy"):
        simulate_steps([([100], [0.5])], 2, ORACLE, micro_batches=1, strategies=["nope"], block_size=128)
    with pytest.raises(ValueError, match="exactly one of --micro-batches"):
        simulate_steps([([100], [0.5])], 2, ORACLE, block_size=128)
    with pytest.raises(ValueError, match="exactly one of --micro-batches"):
        simulate_steps([([100], [0.5])], 2, ORACLE, micro_batches=1, capacity=100, block_size=128)
    with pytest.raises(ValueError, match="--steps"):
        simulate_steps([], 2, ORACLE, micro_batches=1, block_size=128)
    with pytest.raises(ValueError, match="--world-size"):
        _config(world_sizes=(8, -1))
