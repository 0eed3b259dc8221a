"""Recalibration of a ContextCost's multi-rank terms from measured CP units (fabricated
measurements: a "true" cost with known terms produces them, a mis-scaled one learns from them)."""

from __future__ import annotations

import numpy as np
import pytest

from sparsebalance.latency.ring_calibration import UnitTiming
from tests.batching.fake_cost import FakeCost, fake_context

# Attention-heavy documents on a slow link: transfers are exposed at k = 4.
BASE = dict(a=1e-5, b=1e-8, c0=1e-3)
DOCS = [(8192, 0.5, 4), (6144, 0.8, 3), (12288, 0.3, 4), (8192, 0.6, 2)]


def _pair(**true_terms):
    true, model = (
        fake_context(FakeCost(**BASE), bandwidth=2e6),
        fake_context(FakeCost(**BASE), bandwidth=2e6),
    )
    for name, value in true_terms.items():
        if name == "imbalance":
            true.imbalance["flat"] = value
        else:
            setattr(true, name, value)
    return true, model


def _measure(true, length, dens, k, with_ranks=True) -> UnitTiming:
    """What a run of ``true`` would report: the unit time, and per rank compute with the
    slowest rank at the true imbalance (the others share the rest evenly)."""
    (secs,), _ = true.unit_seconds(np.array([length]), np.array([dens]), np.array([k]))
    fixed, attention = true.unit_terms(length, dens, k)
    s = true.compute_scale
    peak = s * fixed + s * attention * true.imbalance["flat"]
    mean = s * (fixed + attention)
    others = (k * mean - peak) / (k - 1)
    ranks = (peak, *[others] * (k - 1)) if with_ranks else ()
    return UnitTiming(length, dens, k, float(secs), tuple(ranks))


def _error(true, model) -> float:
    lens, dens, ks = (np.array(x) for x in zip(*DOCS, strict=True))
    t_true, _ = true.unit_seconds(lens, dens, ks)
    t_model, _ = model.unit_seconds(lens, dens, ks)
    return float(np.max(np.abs(t_model / t_true - 1)))


def test_a_mis_scaled_ring_term_moves_toward_the_measurement():
    true, model = _pair(comm_scale=30.0)  # transfers 30x slower than the links say
    before = _error(true, model)
    assert before > 0.2  # the mis-scaled ring term shows in the predicted unit times
    for doc in DOCS * 3:
        model.update(_measure(true, *doc))
    assert model.comm_scale == pytest.approx(30.0, rel=0.05)
    assert _error(true, model) < 0.02 < before
    assert model.compute_scale == pytest.approx(1.0, rel=1e-6)  # compute was right: unmoved


def test_imbalance_and_compute_scale_come_from_per_rank_compute():
    true, model = _pair(imbalance=1.4, compute_scale=1.5)
    for doc in DOCS * 3:
        model.update(_measure(true, *doc))
    assert model.imbalance["flat"] == pytest.approx(1.4, rel=0.02)
    assert model.compute_scale == pytest.approx(1.5, rel=0.02)
    assert _error(true, model) < 0.03


def test_without_rank_waits_only_the_comm_term_moves_and_a_right_model_stays():
    true, model = _pair(comm_scale=10.0)
    model.update(_measure(true, *DOCS[0], with_ranks=False))
    assert model.comm_scale == pytest.approx(10.0, rel=0.05)  # the first measurement replaces
    assert (model.imbalance["flat"], model.compute_scale) == (1.04, 1.0)
    # hidden transfers (a fast link): the time does not depend on comm within a range, and a
    # model whose prediction matches the measurement is not moved
    fast = fake_context(FakeCost(**BASE), bandwidth=1e12)
    m = _measure(fast, 8192, 0.5, 4)
    fast.update(m)
    assert fast.comm_scale == 1.0 and fast.compute_scale == pytest.approx(1.0)


def test_gain_floor_tracks_drift_and_state_round_trips():
    true, model = _pair(comm_scale=5.0)
    for doc in DOCS * 5:
        model.update(_measure(true, *doc))
    true.comm_scale = 50.0  # the machine got slower: later measurements still move the term
    for doc in DOCS * 10:
        model.update(_measure(true, *doc))
    assert model.comm_scale > 35.0
    state = model.state_dict()
    fresh = fake_context(FakeCost(**BASE), bandwidth=2e6)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    lens = np.array([8192])
    assert fresh.unit_seconds(lens, [0.5], [4])[0] == model.unit_seconds(lens, [0.5], [4])[0]


def test_bad_timings_are_refused():
    with pytest.raises(ValueError, match="degree"):
        UnitTiming(100, 0.5, 1, 1.0)
    with pytest.raises(ValueError, match="seconds"):
        UnitTiming(100, 0.5, 2, float("nan"))
    with pytest.raises(ValueError, match="one entry per rank"):
        UnitTiming(100, 0.5, 3, 1.0, (1.0, 1.0))
