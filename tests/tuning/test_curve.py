"""The density-response curve: its invariants, its inverse, and fitting it to measurements."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsebalance.tuning import DensityCurve

from ..conftest import examples

densities = st.floats(1e-4, 1.0)
gammas = st.floats(1e-3, 1.0)
curves = st.builds(
    DensityCurve,
    gamma0=st.floats(0.5, 0.98),
    alpha_low=st.floats(0.3, 3.0),
    alpha_high=st.floats(0.3, 3.0),
)


@settings(max_examples=examples(200))
@given(curve=curves, d0=densities, g1=gammas, g2=gammas)
def test_monotone_anchored_and_in_range(curve, d0, g1, g2):
    lo, hi = sorted((g1, g2))
    d_lo, d_hi = curve.density(d0, lo), curve.density(d0, hi)
    assert 0.0 < d_lo <= d_hi <= 1.0
    assert curve.density(d0, curve.gamma0) == pytest.approx(d0, rel=1e-12)
    assert curve.density(d0, 1.0) == 1.0


@settings(max_examples=examples(200))
@given(curve=curves, d0=st.floats(1e-3, 0.999), g=st.floats(0.05, 1.0))
def test_inverse_round_trip(curve, d0, g):
    target = float(curve.density(d0, g))
    if target <= 1e-12:  # below the log floor: not invertible, not a realistic density
        return
    g_back = float(curve.gamma_for(d0, target))
    assert float(curve.density(d0, g_back)) == pytest.approx(target, rel=1e-6)
    if target < 1.0:
        assert g_back == pytest.approx(g, abs=1e-6)


def test_vectorized_broadcast_and_default_formula():
    curve = DensityCurve(gamma0=0.9)
    d0 = np.array([0.1, 0.5, 1.0])
    g = np.array([[0.5], [0.9], [0.95]])
    out = curve.density(d0, g)
    assert out.shape == (3, 3)
    np.testing.assert_allclose(out, d0 ** ((1 - g) / 0.1))
    assert np.all(out[:, 2] == 1.0)  # dense stays dense


def test_sparser_document_stays_sparser():
    curve = DensityCurve(gamma0=0.8, alpha_low=2.0, alpha_high=0.5)
    g = np.linspace(0.3, 0.99, 50)
    assert np.all(curve.density(0.2, g) < curve.density(0.3, g))
    assert np.all(curve.density(0.2, 0.01) <= curve.density(0.3, 0.01))


def test_fit_recovers_exponents():
    truth = DensityCurve(gamma0=0.9, alpha_low=1.7, alpha_high=0.6)
    rng = np.random.default_rng(0)
    d0 = rng.uniform(0.02, 0.8, 200)
    g = rng.uniform(0.4, 0.999, 200)
    fitted = DensityCurve.fit(0.9, d0, g, truth.density(d0, g))
    assert fitted.alpha_low == pytest.approx(1.7, rel=1e-6)
    assert fitted.alpha_high == pytest.approx(0.6, rel=1e-6)


def test_fit_without_usable_points_keeps_default():
    fitted = DensityCurve.fit(0.9, [1.0, 0.3], [0.5, 0.9], [1.0, 0.3])
    assert (fitted.alpha_low, fitted.alpha_high) == (1.0, 1.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"gamma0": 1.5}, "--gamma0"),
        ({"gamma0": 0.0}, "--gamma0"),
        ({"alpha_low": 0.0}, "alpha_low"),
        ({"alpha_high": float("nan")}, "alpha_high"),
    ],
)
def test_bad_curve_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DensityCurve(**kwargs)


def test_bad_inputs_raise():
    curve = DensityCurve()
    with pytest.raises(ValueError, match="d0"):
        curve.density(0.0, 0.9)
    with pytest.raises(ValueError, match="gamma"):
        curve.density(0.5, 1.5)
    with pytest.raises(ValueError, match="one shape"):
        DensityCurve.fit(0.9, [0.5], [0.5, 0.6], [0.1])


@settings(max_examples=examples(200))
@given(curve=curves, d0=st.floats(1e-3, 1.0), g=st.floats(0.05, 0.999))
def test_d0_for_inverts_density_in_d0(curve, d0, g):
    measured = float(curve.density(d0, g))
    if measured <= 1e-12 or (measured >= 1.0 and d0 < 1.0):  # floored or rounded to dense
        return
    assert float(curve.d0_for(measured, g)) == pytest.approx(d0, rel=1e-6)


def test_d0_for_broadcasts_and_rejects_gamma_one():
    curve = DensityCurve(gamma0=0.9)
    dens = np.array([[0.2, 0.5], [0.3, 0.6]])  # (layers, documents)
    gam = np.array([[0.8], [0.95]])  # (layers, 1)
    np.testing.assert_allclose(curve.d0_for(dens, gam), dens ** (1.0 / curve.exponent(gam)))
    assert curve.d0_for(0.5, 0.9) == pytest.approx(0.5)  # at gamma0 the density is d0
    with pytest.raises(ValueError, match="gamma = 1"):
        curve.d0_for(0.5, 1.0)
    with pytest.raises(ValueError, match="density"):
        curve.d0_for(0.0, 0.5)
