"""The simulator's engine: determinism, identical samples, ablation ordering, vectorised DST."""

import warnings
from dataclasses import asdict

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sparsebalance.latency import LatencyModel, analytic_profile
from sparsebalance.models import load_shapes
from sparsebalance.simulate import SimConfig, run_simulation, simulate_steps
from sparsebalance.tuning import DSTConfig, DSTTuner
from sparsebalance.tuning.knob import GAMMA_TOL, TOPK_TOL

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


def _step_tolerance(kind: str, densities: np.ndarray, cfg: DSTConfig) -> float:
    """The relative step time the tuner's step-level search may leave below its target, from
    what the code guarantees: the search stops at width ``TOPK_TOL`` blocks (top-k) or
    ``GAMMA_TOL`` (gamma). Top-k: attention grows at most like ``k + anchors`` (>= 2 blocks), so
    a width ``w`` moves a rank's time by at most ``w / 2`` relatively. Gamma: ``d = d0 ** e``
    with ``de/dgamma = -1 / (1 - gamma0)``, so ``|d log d / d gamma| = |log d0| / (1 - gamma0)``
    (the time is at most as sensitive as its attention part). Doubled, plus float noise."""
    if kind == "top-k":
        rel = TOPK_TOL / 2
    else:
        rel = GAMMA_TOL * float(np.abs(np.log(densities)).max()) / (1 - cfg.gamma0)
    return 2 * rel + 1e-12


@settings(max_examples=15, deadline=None)
@example(seed=920559, ranks=2, per_rank=2, kind="gamma")  # issue 25: 3e-7 above under a 1e-12 tol
@example(seed=1, ranks=2, per_rank=3, kind="top-k")  # a whole-block search lands a block apart
@given(seed=st.integers(0, 2**31 - 1), ranks=st.integers(2, 12), per_rank=st.integers(1, 6),
       kind=st.sampled_from(["top-k", "gamma"]))  # fmt: skip
def test_sab_dst_never_slower_than_sab_or_dst(seed, ranks, per_rank, kind):
    """The paper's rule, mean anchor, no coverage information (the bound cannot stop a cut):
    every cut lands on the anchor and no raise passes it, so a plan's DST step time is its
    anchor = its mean rank time, the same for every plan of one batch under a linear cost (the
    oracle): SAB + DST equals DST up to the search's resolution, and never exceeds SAB."""
    rng = np.random.default_rng(seed)
    n = ranks * per_rank
    batch = (rng.integers(64, 16384, n), rng.uniform(0.05, 1.0, n))
    cfg = DSTConfig(budget=kind, budget_tokens=1024) if kind == "top-k" else DSTConfig(
        budget=kind)  # fmt: skip
    out = simulate_steps([batch], ranks, ORACLE, micro_batches=2, dst=cfg, coverage=False,
                         strategies=["sab", "dst", "sab+dst"])  # fmt: skip
    s = out["strategies"]
    tol = _step_tolerance(kind, batch[1], cfg)
    assert s["sab+dst"]["compute_seconds"] <= s["sab"]["compute_seconds"] * (1 + 1e-12)
    assert s["sab+dst"]["compute_seconds"] <= s["dst"]["compute_seconds"] * (1 + tol)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), ranks=st.integers(2, 12), per_rank=st.integers(1, 6),
       p=st.sampled_from([0.0, 0.05, 0.1, 0.3]),
       anchor=st.sampled_from(["min", "mean", "median", "max"]))  # fmt: skip
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
