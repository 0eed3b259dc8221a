"""The simulator's engine: determinism, identical samples, ablation ordering, vectorised DST."""

import warnings
from dataclasses import asdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsebalance.latency import LatencyModel, analytic_profile
from sparsebalance.models import load_shapes
from sparsebalance.simulate import SimConfig, run_simulation, simulate_steps
from sparsebalance.tuning import DSTConfig, DSTTuner

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


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), ranks=st.integers(2, 12), per_rank=st.integers(1, 6))
def test_sab_dst_never_slower_than_sab_or_dst(seed, ranks, per_rank):
    rng = np.random.default_rng(seed)
    n = ranks * per_rank
    batch = (rng.integers(64, 16384, n), rng.uniform(0.05, 1.0, n))
    out = simulate_steps([batch], ranks, ORACLE, micro_batches=2,
                         strategies=["sab", "dst", "sab+dst"])  # fmt: skip
    s = out["strategies"]
    tol = 1e-12
    assert s["sab+dst"]["compute_seconds"] <= s["sab"]["compute_seconds"] * (1 + tol)
    assert s["sab+dst"]["compute_seconds"] <= s["dst"]["compute_seconds"] * (1 + tol)


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
