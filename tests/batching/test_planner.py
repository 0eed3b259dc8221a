"""Planner: coverage, capacity, over-long policies, quality, sab vs tokens, determinism, errors."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsebalance.batching import STRATEGIES, HistoryEstimator, PlanConfig, plan_batch
from sparsebalance.workload import Sample
from tests.batching.fake_cost import FakeCost, fake_context
from tests.conftest import examples

MODES = [pytest.param({"micro_batches": 3}, id="M3"), pytest.param({"capacity": 4096}, id="C4k")]


def random_batch(n, seed, lo=64, hi=4096):
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.uniform(np.log(lo), np.log(hi), n)).astype(int)
    samples = [Sample(1000 + i, int(x), f"src{i % 3}") for i, x in enumerate(lengths)]
    return samples, rng.uniform(0.05, 1.0, n)


def token_count(plan):
    out = Counter()
    for sid, chunks in plan.placements().items():
        out[sid] = sum(n for *_, n in chunks)
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_sample_exactly_once(strategy, mode):
    samples, dens = random_batch(97, seed=1)
    cost = fake_context() if strategy == "sab-cp" else FakeCost()
    plan = plan_batch(samples, cost, PlanConfig(5, strategy=strategy, **mode), dens)
    assert plan.num_ranks == 5
    placed = [sid for rank in plan.ranks for mb in rank for sid in mb.sample_ids]
    assert sorted(placed) == sorted(s.id for s in samples)
    assert token_count(plan) == {s.id: s.num_tokens for s in samples}
    # CP units (sab-cp) are checked in test_context.py; here the one-rank micro-batches.
    units = plan.rank_units or [[-1] * len(rank) for rank in plan.ranks]
    if "micro_batches" in mode:
        assert all(sum(u < 0 for u in us) <= 3 for us in units)
    else:
        assert all(mb.num_tokens <= 4096 for rank in plan.ranks for mb in rank)
    assert plan.metrics.max_time >= plan.metrics.lower_bound * (1 - 1e-12)
    assert len(plan.rank_times) == 5
    assert np.isclose(max(plan.rank_times), plan.metrics.max_time)
    # Times are the cost model's own predictions of each micro-batch.
    for rank, times, us in zip(plan.ranks, plan.microbatch_times, units, strict=True):
        for mb, t, u in zip(rank, times, us, strict=True):
            if u < 0:
                assert t == pytest.approx(FakeCost().predict(mb.lengths, mb.densities))


def test_overlong_split_truncate_skip():
    lengths = [100, 900, 2500, 300]  # 900 and 2500 exceed C = 800
    samples = [Sample(i, n) for i, n in enumerate(lengths)]
    dens = [0.5] * 4
    cfg = dict(world_size=2, capacity=800)

    split = plan_batch(samples, FakeCost(), PlanConfig(**cfg, overlong="split"), dens)
    m = split.metrics
    assert (m.num_overlong, m.num_split_chunks, m.truncated_tokens) == (2, 2 + 4, 0)
    chunks = split.placements()[2]
    assert sorted((o, n) for *_, o, n in chunks) == [(0, 800), (800, 800), (1600, 800), (2400, 100)]
    assert token_count(split) == dict(enumerate(lengths))
    assert all(mb.num_tokens <= 800 for rank in split.ranks for mb in rank)

    trunc = plan_batch(samples, FakeCost(), PlanConfig(**cfg, overlong="truncate"), dens)
    assert trunc.metrics.truncated_tokens == 100 + 1700
    assert token_count(trunc) == {0: 100, 1: 800, 2: 800, 3: 300}

    skip = plan_batch(samples, FakeCost(), PlanConfig(**cfg, overlong="skip"), dens)
    assert skip.metrics.skipped_ids == (1, 2)
    assert set(skip.placements()) == {0, 3}
    assert skip.metrics.num_samples == 2


@pytest.mark.parametrize("overlong", ["split", "truncate"])
def test_a_batch_of_only_overlong_documents_is_plannable(overlong):
    """Regression: C below every length used to raise "smaller than the smallest sample"."""
    lengths = [300, 500, 141]
    samples = [Sample(i, n) for i, n in enumerate(lengths)]
    plan = plan_batch(samples, FakeCost(), PlanConfig(2, capacity=140, overlong=overlong), [0.5] * 3)
    assert plan.metrics.num_overlong == 3
    assert all(mb.num_tokens <= 140 for rank in plan.ranks for mb in rank)
    want = dict(enumerate(lengths)) if overlong == "split" else {0: 140, 1: 140, 2: 140}
    assert token_count(plan) == want


def test_near_perfect_split_reaches_high_efficiency():
    # R ranks' worth of identical groups, shuffled: a perfect split exists.
    rng = np.random.default_rng(3)
    group = np.exp(rng.uniform(np.log(256), np.log(8192), 12)).astype(int)
    gdens = rng.uniform(0.05, 1.0, 12)
    r = 16
    order = rng.permutation(12 * r)
    lengths, dens = np.tile(group, r)[order], np.tile(gdens, r)[order]
    samples = [Sample(i, int(n)) for i, n in enumerate(lengths)]
    for mode in ({"micro_batches": 4}, {"capacity": 16384}):
        plan = plan_batch(samples, FakeCost(), PlanConfig(r, strategy="sab", **mode), dens)
        assert plan.metrics.efficiency >= 0.95, mode
        assert plan.metrics.gap_to_bound <= 0.05, mode


def test_sab_sees_density_that_tokens_cannot():
    # Equal lengths, very different densities: token balancing is blind to them (here its
    # round-robin over equal lengths happens to give ranks 0-3 every dense sample), sab is not.
    n, r = 64, 8
    samples = [Sample(i, 4096) for i in range(n)]
    dens = np.where(np.arange(n) % r < r // 2, 1.0, 0.05)
    cost = FakeCost(a=1e-5, b=1e-8)
    tok = plan_batch(samples, cost, PlanConfig(r, micro_batches=2, strategy="tokens"), dens)
    sab = plan_batch(samples, cost, PlanConfig(r, micro_batches=2, strategy="sab"), dens)
    assert sab.metrics.efficiency > 0.99
    assert tok.metrics.efficiency < 0.8
    assert sab.metrics.max_time < 0.8 * tok.metrics.max_time
    assert sab.metrics.candidate == "cost"


@settings(max_examples=examples(40))
@given(
    n=st.integers(1, 60),
    r=st.integers(1, 9),
    seed=st.integers(0, 10_000),
    use_capacity=st.booleans(),
    nonlinear=st.booleans(),
)
def test_sab_never_worse_than_tokens(n, r, seed, use_capacity, nonlinear):
    samples, dens = random_batch(n, seed)
    mode = {"capacity": 6000} if use_capacity else {"micro_batches": 1 + seed % 4}
    cost = FakeCost(e=1e-9 if nonlinear else 0.0)
    tok = plan_batch(samples, cost, PlanConfig(r, strategy="tokens", **mode), dens)
    sab = plan_batch(samples, cost, PlanConfig(r, strategy="sab", **mode), dens)
    assert sab.metrics.max_time <= tok.metrics.max_time
    assert sab.metrics.max_time >= sab.metrics.lower_bound * (1 - 1e-9) or nonlinear
    assert sorted(token_count(sab).items()) == sorted((s.id, s.num_tokens) for s in samples)


def test_more_ranks_than_samples_leaves_ranks_empty():
    samples, dens = random_batch(3, seed=0)
    plan = plan_batch(samples, FakeCost(), PlanConfig(8, micro_batches=2), dens)
    assert sum(1 for rank in plan.ranks if rank) == 3
    assert plan.metrics.min_time == 0.0


def test_estimator_input_matches_explicit_densities():
    samples, _ = random_batch(40, seed=5)
    est = HistoryEstimator()
    cfg = PlanConfig(4, capacity=8192)
    a = plan_batch(samples, FakeCost(), cfg, estimator=est)
    b = plan_batch(samples, FakeCost(), cfg, densities=est.estimate(samples))
    assert a.hash() == b.hash()


HASH_SCRIPT = """
import numpy as np
from sparsebalance.batching import PlanConfig, plan_batch
from sparsebalance.workload import Sample
from tests.batching.fake_cost import FakeCost, fake_context
rng = np.random.default_rng(7)
lens = rng.integers(50, 5000, 300)
samples = [Sample(i, int(n), "s%d" % (i % 4)) for i, n in enumerate(lens)]
dens = rng.uniform(0.05, 1, 300)
for mode in ({"micro_batches": 3}, {"capacity": 5000}):
    print(plan_batch(samples, FakeCost(), PlanConfig(16, strategy="sab", **mode), dens).hash())
long = samples + [Sample(300 + i, 40000 + 997 * i) for i in range(3)]
for mode in ({"micro_batches": 3}, {"capacity": 5000}):
    plan = plan_batch(long, fake_context(), PlanConfig(16, strategy="sab-cp", **mode),
                      np.concatenate([dens, [0.3, 0.2, 0.1]]))
    assert plan.metrics.num_split_documents > 0
    print(plan.hash())
"""


def test_deterministic_across_calls_and_processes():
    root = Path(__file__).resolve().parents[2]
    outs = []
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        run = subprocess.run(
            [sys.executable, "-c", HASH_SCRIPT], cwd=root, env=env, capture_output=True, text=True, check=True
        )
        outs.append(run.stdout.split())
    assert outs[0] == outs[1] and len(outs[0]) == 4
    rng = np.random.default_rng(7)
    lens = rng.integers(50, 5000, 300)
    samples = [Sample(i, int(n), f"s{i % 4}") for i, n in enumerate(lens)]
    dens = rng.uniform(0.05, 1, 300)
    here = plan_batch(samples, FakeCost(), PlanConfig(16, micro_batches=3), dens)
    again = plan_batch(samples, FakeCost(), PlanConfig(16, micro_batches=3), dens)
    assert here.hash() == again.hash() == outs[0][0]
    assert here.ranks == again.ranks
    assert len(here.hash()) == 16 and int(here.hash(), 16) >= 0
    other = plan_batch(samples, FakeCost(), PlanConfig(16, micro_batches=3, strategy="sorted"), dens)
    assert other.hash() != here.hash()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 0, "capacity": 100}, "--world-size must be >= 1"),
        ({"world_size": -3, "micro_batches": 1}, "--world-size must be >= 1"),
        ({"world_size": 2}, "exactly one of --micro-batches M and --capacity C"),
        ({"world_size": 2, "micro_batches": 2, "capacity": 9}, "exactly one of"),
        ({"world_size": 2, "micro_batches": 0}, "--micro-batches must be >= 1"),
        ({"world_size": 2, "capacity": 0}, "--capacity must be >= 1"),
        ({"world_size": 2, "capacity": 9, "strategy": "lpt"}, "--strategy must be one of"),
        ({"world_size": 2, "capacity": 9, "overlong": "drop"}, "--overlong must be one of"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PlanConfig(**kwargs)


def test_bad_batches():
    samples, dens = random_batch(5, seed=0, lo=200)
    cfg = PlanConfig(2, capacity=8192)
    with pytest.raises(ValueError, match="empty"):
        plan_batch([], FakeCost(), cfg, densities=[])
    with pytest.raises(ValueError, match="every sample is longer than --capacity 100"):
        plan_batch(samples, FakeCost(), PlanConfig(2, capacity=100, overlong="skip"), dens)
    with pytest.raises(ValueError, match="distinct"):
        plan_batch([Sample(1, 10), Sample(1, 20)], FakeCost(), cfg, densities=[0.5, 0.5])
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        plan_batch(samples, FakeCost(), cfg, densities=[0.5, 0.5, 0.5, 0.5, 1.5])
    with pytest.raises(ValueError, match="5 samples but 4 densities"):
        plan_batch(samples, FakeCost(), cfg, densities=dens[:4])
    with pytest.raises(ValueError, match="exactly one of densities and estimator"):
        plan_batch(samples, FakeCost(), cfg)
