"""Density estimators (history regression, probe) and the accuracy report."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from sparsebalance.batching import (
    HistoryEstimator,
    ProbeEstimator,
    ProbeModel,
    estimator_report,
    mape,
)
from sparsebalance.ops import Budget, estimate_block_mass
from sparsebalance.workload import Sample
from tests.batching.fake_cost import FakeCost


def synthetic(n, seed, d_ref=0.4, slope=-0.3, noise=0.1, source=""):
    """Samples whose density follows ``d_ref (L / 8192)^slope`` times log-normal noise."""
    rng = np.random.default_rng(seed)
    lens = np.exp(rng.uniform(np.log(256), np.log(32768), n)).astype(int)
    samples = [Sample(i, int(x), source) for i, x in enumerate(lens)]
    clean = np.clip(d_ref * (lens / 8192) ** slope, 1e-3, 1.0)
    return samples, clean, np.clip(clean * rng.lognormal(0.0, noise, n), 1e-3, 1.0)


def test_history_prior_before_data():
    est = HistoryEstimator(prior_density=0.3, prior_slope=-0.5, ref_length=8192)
    d = est.estimate([Sample(0, 8192), Sample(1, 32768), Sample(2, 64), Sample(3, 2048)])
    assert d[0] == pytest.approx(0.3)
    assert d[1] == pytest.approx(0.15)
    assert d[2] == 1.0  # clipped: a short document keeps every block
    assert d[3] == pytest.approx(0.6)


def test_history_converges_on_synthetic_data():
    est = HistoryEstimator()
    test_samples, test_clean, _ = synthetic(500, seed=99)
    before = mape(est.estimate(test_samples), test_clean)
    for step in range(20):
        samples, _, noisy = synthetic(128, seed=step)
        est.observe(samples, noisy)
    a, b = est.coefficients()
    assert b == pytest.approx(-0.3, abs=0.03)
    assert math.exp(a) == pytest.approx(0.4, rel=0.05)
    after = mape(est.estimate(test_samples), test_clean)
    assert after < 0.03 < before


def test_history_per_source_and_unseen_source():
    est = HistoryEstimator()
    for step in range(10):
        s1, _, d1 = synthetic(64, seed=step, d_ref=0.6, slope=-0.2, source="code")
        s2, _, d2 = synthetic(64, seed=100 + step, d_ref=0.1, slope=-0.6, source="chat")
        est.observe(s1 + s2, np.concatenate([d1, d2]))
    probe = [Sample(0, 4096, "code"), Sample(1, 4096, "chat"), Sample(2, 4096, "new")]
    d = est.estimate(probe)
    assert d[0] == pytest.approx(0.6 * 0.5**-0.2, rel=0.05)
    assert d[1] == pytest.approx(0.1 * 0.5**-0.6, rel=0.08)
    assert d[1] < d[2] < d[0]  # an unseen source gets the global fit
    pooled = HistoryEstimator(per_source=False)
    pooled.load_state_dict({**est.state_dict(), "per_source": False})
    assert len(set(pooled.estimate(probe).tolist())) == 1


def test_history_state_dict_roundtrip_and_decay():
    est = HistoryEstimator(decay=0.5)
    samples, _, noisy = synthetic(200, seed=1, d_ref=0.2)
    est.observe(samples, noisy)
    state = json.loads(json.dumps(est.state_dict()))
    other = HistoryEstimator()
    other.load_state_dict(state)
    np.testing.assert_array_equal(other.estimate(samples), est.estimate(samples))
    assert other.num_observed == 200
    # With decay 0.5 the fit follows a shift of the data within a few steps.
    for step in range(6):
        s, _, d = synthetic(200, seed=10 + step, d_ref=0.6)
        est.observe(s, d)
    assert math.exp(est.coefficients()[0]) == pytest.approx(0.6, rel=0.05)


def test_history_bad_input():
    est = HistoryEstimator()
    with pytest.raises(ValueError, match="2 samples but 1 densities"):
        est.observe([Sample(0, 10), Sample(1, 10)], [0.5])
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        est.observe([Sample(0, 10)], [0.0])
    with pytest.raises(ValueError, match="prior_density"):
        HistoryEstimator(prior_density=1.5)
    with pytest.raises(ValueError, match="decay"):
        HistoryEstimator(decay=0.0)


def test_mape_and_report():
    assert mape([1.1, 0.9], [1.0, 1.0]) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="> 0"):
        mape([1.0], [0.0])
    with pytest.raises(ValueError, match="one shape"):
        mape([1.0, 2.0], [1.0])
    samples, clean, noisy = synthetic(50, seed=3)
    exact = estimator_report(FakeCost(), samples, clean, clean)
    assert exact == {"density_mape": 0.0, "latency_mape": 0.0, "latency_bias": 0.0}
    rep = estimator_report(FakeCost(), samples, noisy, clean)
    # Latency error is a damped copy of the density error (the linear part does not move).
    assert 0 < rep["latency_mape"] < rep["density_mape"]


def tiny_probe(seed=0, block_size=16):
    torch.manual_seed(seed)
    emb = nn.Embedding(50, 32).double()
    q, k = nn.Linear(32, 4 * 8).double(), nn.Linear(32, 2 * 8).double()
    return ProbeModel(emb, q, k, num_heads=4, num_kv_heads=2, block_size=block_size)


def test_probe_densities_match_estimate_block_mass():
    model = tiny_probe()
    g = torch.Generator().manual_seed(1)
    lengths = [37, 100, 161, 16]
    tokens = {i: torch.randint(0, 50, (n,), generator=g) for i, n in enumerate(lengths)}
    samples = [Sample(i, n) for i, n in enumerate(lengths)]
    budget = Budget(gamma=0.8)
    est = ProbeEstimator(model, tokens, budget=budget, block_size=16)
    d = est.estimate(samples)
    assert d.shape == (4,) and np.all(d > 0) and np.all(d <= 1)
    assert d[3] == 1.0  # one block: nothing to skip
    assert est.last_seconds > 0
    for i, n in enumerate(lengths):
        # Reference: project every token (no pooling shortcut), then the library's estimator.
        x = model.embedding(tokens[i])
        q = model.q_proj(x).view(n, 4, 8)
        k = model.k_proj(x).view(n, 2, 8)
        cu = torch.tensor([0, n], dtype=torch.int32)
        ref = estimate_block_mass(q, k, cu, block_size=16).density(budget)
        assert d[i] == pytest.approx(ref, abs=1e-12)


def test_probe_checks_token_count():
    est = ProbeEstimator(tiny_probe(), lambda s: torch.zeros(5, dtype=torch.long), block_size=16)
    with pytest.raises(ValueError, match="num_tokens=6 but 5 token ids"):
        est.estimate([Sample(0, 6)])
