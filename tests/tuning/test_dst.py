"""Step-level DST on a synthetic latency oracle: the issue's guarantees, example and property."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsebalance.tuning import DensityCurve, DSTTuner
from sparsebalance.workload import MicroBatch

from ..conftest import examples
from .gamma_rule import G
from .oracle import Oracle, random_plan

ORACLE = Oracle()


def _skewed_plan(seed=0, num_ranks=6):
    """Random ranks plus one clear straggler (rank 0 holds an extra long, dense document)."""
    rng = np.random.default_rng(seed)
    plan = random_plan(rng, num_ranks)
    plan[0] = [*plan[0], MicroBatch((99,), (12000,), (0.5,))]
    return plan


def test_identical_work_changes_nothing():
    plan = random_plan(np.random.default_rng(1), 1) * 5
    for mode in ("off", "down", "bidirectional"):
        for anchor in ("min", "mean", "median", "max"):
            cfg = G(mode=mode, anchor=anchor, p=0.0)
            dec = DSTTuner(cfg, block_size=64).decide(plan, ORACLE)
            assert np.all(dec.budgets == cfg.gamma0), (mode, anchor)
            np.testing.assert_array_equal(dec.times_after, dec.times_before)
            assert {r.role for r in dec.ranks} == {"kept"}


def test_off_keeps_gamma0():
    dec = DSTTuner(G(mode="off"), block_size=64).decide(_skewed_plan(), ORACLE)
    assert np.all(dec.budgets == 0.9)
    assert dec.budget_cut == dec.budget_given == 0.0


def test_bidirectional_cuts_straggler_and_fills_bubbles():
    dec = DSTTuner(G(), block_size=64).decide(_skewed_plan(), ORACLE)
    assert dec.ranks[0].role == "cut" and dec.ranks[0].budget < 0.9
    assert dec.ranks[0].predicted_after <= dec.targets.cut_threshold
    raised = [r for r in dec.ranks if r.role == "raised"]
    assert raised and all(r.budget > 0.9 for r in raised)
    # raised ranks end close to T' (within what one bisection step of gamma changes)
    assert all(r.predicted_after <= dec.targets.post_cut_seconds for r in dec.ranks)
    assert dec.step_seconds_after < dec.step_seconds_before
    assert dec.bubbles_after.sum() < dec.bubbles_before.sum()
    assert dec.budget_cut > 0 and dec.budget_given > 0
    assert dec.ranks[0].density_after < dec.ranks[0].density_before
    summary = json.loads(json.dumps(dec.to_dict()))  # JSON-ready for metrics files
    assert summary["ranks"][0]["role"] == "cut"
    assert summary["bubble_after"] == pytest.approx(sum(summary["bubbles_after"]))


def test_empty_microbatch_and_empty_rank():
    plan = [[MicroBatch((), (), ())], [], [MicroBatch((0,), (4000,), (0.3,))]]
    dec = DSTTuner(G(), block_size=64).decide(plan, ORACLE)
    assert dec.ranks[0].predicted_before == pytest.approx(ORACLE.microbatch_overhead())
    assert dec.ranks[1].predicted_before == 0.0
    assert dec.ranks[2].role == "cut"


def test_anchor_mean_p0_lands_stragglers_at_the_mean():
    cfg = G(anchor="mean", p=0.0, gamma_min=0.05)
    dec = DSTTuner(cfg, block_size=64).decide(_skewed_plan(seed=3), ORACLE)
    mean = float(np.mean(dec.times_before))
    cut = [r for r in dec.ranks if r.role == "cut"]
    assert cut and all(r.budget > cfg.gamma_min for r in cut)
    for r in cut:
        assert r.predicted_after == pytest.approx(mean, rel=1e-5)
        assert r.predicted_after <= mean


def test_anchor_mean_p0_with_model_error():
    """The decision uses a model 3% off on attention; the true time lands within that error."""
    cfg = G(anchor="mean", p=0.0, gamma_min=0.05)
    model = Oracle(b=ORACLE.b * 1.03)
    tuner = DSTTuner(cfg, block_size=64)
    plan = _skewed_plan(seed=4)
    dec = tuner.decide(plan, model)
    for r in dec.ranks:
        if r.role == "cut":
            true_after = tuner.workload(plan[r.rank], ORACLE).seconds(r.budget)
            assert abs(true_after - r.target_seconds) <= 0.03 * r.target_seconds


def test_floor_reached_when_cut_is_not_enough():
    plan = _skewed_plan()
    plan[0] = [MicroBatch((0,), (30000,), (0.9,))]
    dec = DSTTuner(G(gamma_min=0.85), block_size=64).decide(plan, ORACLE)
    assert dec.ranks[0].budget == 0.85
    assert dec.targets.post_cut_seconds == pytest.approx(dec.ranks[0].predicted_after)


def test_curve_mismatch_raises():
    with pytest.raises(ValueError, match="--gamma0"):
        DSTTuner(G(gamma0=0.8), DensityCurve(gamma0=0.9), block_size=64)


def test_empty_plan_raises():
    with pytest.raises(ValueError, match="at least one rank"):
        DSTTuner(G(), block_size=64).decide([], ORACLE)


@st.composite
def instances(draw):
    gamma0 = draw(st.floats(0.6, 0.95))
    cfg = G(
        mode=draw(st.sampled_from(["off", "down", "bidirectional"])),
        anchor=draw(st.sampled_from(["min", "mean", "median", "max"])),
        p=draw(st.floats(0.0, 0.5)),
        gamma0=gamma0,
        gamma_min=draw(st.floats(0.05, gamma0)),
        gamma_max=draw(st.floats(gamma0, 1.0)),
    )
    alphas = draw(st.tuples(st.floats(0.5, 2.0), st.floats(0.5, 2.0)))
    curve = DensityCurve(gamma0, *alphas)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    plan = random_plan(rng, draw(st.integers(1, 8)), mbs_per_rank=draw(st.integers(0, 3)), d0=(0.01, 1.0))
    return cfg, curve, plan


@settings(max_examples=examples(60))
@given(inst=instances())
def test_properties(inst):
    cfg, curve, plan = inst
    dec = DSTTuner(cfg, curve, block_size=64).decide(plan, ORACLE)
    g = dec.budgets
    assert np.all((g >= cfg.gamma_min) & (g <= cfg.gamma_max))
    if cfg.mode == "off":
        assert np.all(g == cfg.gamma0)
    if cfg.mode == "down":
        assert np.all(g <= cfg.gamma0)
    if cfg.anchor == "max":
        assert np.all(g >= cfg.gamma0)
    t_prime = dec.targets.post_cut_seconds
    assert t_prime <= dec.step_seconds_before * (1 + 1e-12)
    if cfg.mode == "bidirectional":
        assert np.all(dec.times_after <= t_prime * (1 + 1e-12))
    assert dec.step_seconds_after <= dec.step_seconds_before * (1 + 1e-12)
    for r in dec.ranks:  # only stragglers lose budget, only non-stragglers gain it
        if r.budget < cfg.gamma0:
            assert r.role == "cut" and r.predicted_before > dec.targets.cut_threshold
        if r.budget > cfg.gamma0:
            assert r.role == "raised" and r.predicted_before < t_prime
