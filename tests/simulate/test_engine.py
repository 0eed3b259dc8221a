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
from sparsebalance.tuning.dst import _GAMMA_TOL
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
    out = simulate_steps([batch, batch], 8, ORACLE, micro_batches=2, step_overhead=1e-3)
    for name, s in out["strategies"].items():
        assert s["speedup"] == pytest.approx(1.0, abs=1e-12), name
        assert s["balance_efficiency"] == pytest.approx(1.0)
        assert s["budget_cut_seconds"] == 0.0


def test_strategies_see_the_same_samples_and_baseline_is_first():
    out = simulate_steps([(np.arange(1, 17) * 300, np.full(16, 0.2))], 4, ORACLE,
                         capacity=8192, strategies=["sab+dst", "tokens", "flops+dst"])  # fmt: skip
    assert list(out["strategies"]) == ["baseline", "sab+dst", "tokens", "flops+dst"]
    # DST off never moves budget; the same batch under every strategy: same attention at gamma0
    assert out["strategies"]["tokens"]["budget_given_seconds"] == 0.0


def _batch(seed: int, n: int):
    rng = np.random.default_rng(seed)
    return rng.integers(64, 16384, n), rng.uniform(0.05, 1.0, n)


def _dst_step(batch, ranks: int, planner: str) -> tuple[float, float, float]:
    """DST on one planner's plan, decided as the simulator decides it: ``(step seconds, its
    target T', bisection slack)``.

    What the code guarantees: the step never exceeds ``T'`` (the largest of the cut threshold,
    the floor of a straggler that cannot reach it, and the untouched ranks), and ends at most the
    bisection's slack below it: DST's bisection (``_GAMMA_TOL``) stops with ``f(lo) <= limit <
    f(hi)`` and ``hi - lo <= tol``, so a tuned rank ends at most ``f(g + tol) - f(g)`` below its
    limit."""
    samples = [Sample(i, int(n)) for i, n in enumerate(batch[0])]
    config = PlanConfig(ranks, micro_batches=2, strategy=planner)
    plan = plan_batch(samples, ORACLE, config, batch[1])
    tuner = DSTTuner(DSTConfig())
    work = PlanWorkload(plan.ranks, ORACLE, tuner.curve)
    decision = tuner.decide_arrays(work)
    times = work.seconds(decision.gammas)
    slack = float((work.seconds(decision.gammas + _GAMMA_TOL) - times).max())
    return float(times.max()), decision.targets.post_cut_seconds, slack


ROUNDING = 1e-12  # the same sums in another order (anchors, thresholds)


@settings(max_examples=examples(15))
@given(seed=st.integers(0, 2**31 - 1), ranks=st.integers(2, 12), per_rank=st.integers(1, 6))
# bisection slack: sab+dst 0.4400612 s vs dst 0.4400611 s (failed a 1e-12 tolerance)
@example(seed=920559, ranks=2, per_rank=2)
# found by the explore profile (seed 12, 2,000 examples): SAB packs two dense documents on one
# rank whose time even at gamma_min (0.683 s) is above the cut threshold (0.655 s); DST then
# raises every other rank to that floor: sab+dst 0.683 s vs dst 0.655 s
@example(seed=173425, ranks=10, per_rank=2)
def test_sab_dst_against_sab_and_dst(seed, ranks, per_rank):
    batch = _batch(seed, ranks * per_rank)
    out = simulate_steps([batch], ranks, ORACLE, micro_batches=2,
                         strategies=["sab", "dst", "sab+dst"])  # fmt: skip
    s = out["strategies"]
    sab_dst, sab_dst_target, _ = _dst_step(batch, ranks, "sab")
    dst, dst_target, slack = _dst_step(batch, ranks, "sequential")
    assert (sab_dst, dst) == (s["sab+dst"]["compute_seconds"], s["dst"]["compute_seconds"])
    assert 0.0 <= slack < 1e-5 * dst  # a gamma width of 1e-7 is a tiny time
    # DST never slows a plan down and never ends above its target T'; nor more than the
    # bisection's slack below it
    assert sab_dst <= s["sab"]["compute_seconds"] * (1 + ROUNDING)
    assert sab_dst <= sab_dst_target * (1 + ROUNDING)
    assert dst >= (dst_target - slack) * (1 - ROUNDING)
    # hence SAB + DST is never slower than DST on the unbalanced plan, up to that slack, when its
    # target is no higher; it can be higher (the second example) when a rank of the SAB plan
    # cannot reach the cut threshold even at gamma_min: nothing in DST's rule prevents that
    if sab_dst_target <= dst_target * (1 + ROUNDING):
        assert sab_dst <= (dst + slack) * (1 + ROUNDING)


def test_bisection_slack_is_what_the_counterexample_needed():
    # the property's tolerance is no looser than needed: without it, this example fails
    batch = _batch(920559, 4)
    sab_dst, sab_dst_target, _ = _dst_step(batch, 2, "sab")
    dst, dst_target, slack = _dst_step(batch, 2, "sequential")
    assert sab_dst_target <= dst_target * (1 + ROUNDING)
    excess = sab_dst - dst
    assert ROUNDING * dst < excess <= slack


def test_vectorised_decide_matches_per_rank_path():
    model = LatencyModel(analytic_profile(load_shapes("qwen2.5-0.5b")))
    rng = np.random.default_rng(5)
    plan = random_plan(rng, 9, mbs_per_rank=3, docs=(1, 5), lengths=(256, 16384), d0=(0.05, 0.9))
    plan[2] = plan[2][:1]  # ranks of different shapes
    for cm in (ORACLE, model):
        for anchor in ("min", "mean", "max"):
            tuner = DSTTuner(DSTConfig(anchor=anchor, p=0.05))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dec = tuner.decide(plan, cm)
                for r, mbs in enumerate(plan):
                    assert asdict(tuner.decide_rank(r, mbs, cm, dec.targets)) == asdict(
                        dec.ranks[r]
                    )


def test_bad_input():
    with pytest.raises(ValueError, match="--world-size"):
        simulate_steps([([100], [0.5])], 0, ORACLE, micro_batches=1)
    with pytest.raises(ValueError, match="--strategy"):
        simulate_steps([([100], [0.5])], 2, ORACLE, micro_batches=1, strategies=["nope"])
    with pytest.raises(ValueError, match="exactly one of --micro-batches"):
        simulate_steps([([100], [0.5])], 2, ORACLE)
    with pytest.raises(ValueError, match="exactly one of --micro-batches"):
        simulate_steps([([100], [0.5])], 2, ORACLE, micro_batches=1, capacity=100)
    with pytest.raises(ValueError, match="--steps"):
        simulate_steps([], 2, ORACLE, micro_batches=1)
    with pytest.raises(ValueError, match="--world-size"):
        _config(world_sizes=(8, -1))
