"""LatencyModel on synthetic profiles: grid exactness, monotonicity, round trip, recalibration."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from sparsebalance.latency import (
    LatencyModel,
    OutsideGridWarning,
    Profile,
    ProfileMismatchWarning,
    load_profile,
)
from sparsebalance.latency.profile import AttentionTable, Table1D

LENGTHS = [128, 256, 512, 1024, 2048]
DENSITIES = [0.05, 0.2, 0.5, 1.0]
TOKENS = [128, 512, 2048, 4096]


def true_attention(length, density):
    return 2e-4 + 1e-6 * length + 4e-8 * density * length**2


def synthetic_profile(layers=4, call=1e-4, noise=0.0, seed=0) -> Profile:
    rng = np.random.default_rng(seed)
    att = [[true_attention(n, d) * (1 + noise * rng.standard_normal()) for d in DENSITIES] for n in LENGTHS]
    return Profile(
        fingerprint={"device": "synthetic"},
        attention=AttentionTable(LENGTHS, DENSITIES, att),
        layer_other=Table1D(TOKENS, [1e-3 + 2e-6 * t for t in TOKENS]),
        head=Table1D(TOKENS, [5e-4 + 3e-6 * t for t in TOKENS]),
        num_layers=layers,
        optimizer_seconds=0.01,
        attention_call_seconds=call,
    )


def test_exact_at_grid_points():
    p = synthetic_profile()
    m = LatencyModel(p)
    for i, n in enumerate(LENGTHS):
        for j, d in enumerate(DENSITIES):
            other = np.interp(n, TOKENS, p.layer_other.seconds)
            head = np.interp(n, TOKENS, p.head.seconds)
            expect = p.num_layers * (p.attention.seconds[i][j] + other) + head
            assert m.predict([n], [d]) == pytest.approx(expect, rel=1e-12)


def test_monotone_in_length_and_density_even_with_noisy_tables():
    m = LatencyModel(synthetic_profile(noise=0.3, seed=4))
    rng = np.random.default_rng(0)
    lengths = np.sort(rng.uniform(128, 2048, 200))
    dens = np.sort(rng.uniform(0.05, 1.0, 200))
    by_len = [m.predict([n], [0.3]) for n in lengths]
    by_den = [m.predict([700], [d]) for d in dens]
    assert np.all(np.diff(by_len) >= -1e-15) and np.all(np.diff(by_den) >= -1e-15)


def test_predict_many_matches_predict_and_is_positive():
    m = LatencyModel(synthetic_profile())
    rng = np.random.default_rng(1)
    lengths = rng.integers(128, 1000, (50, 4))
    lengths[:, 2:] *= rng.integers(0, 2, (50, 2))  # empty slots
    dens = rng.uniform(0.05, 1.0, (50, 4))
    many = m.predict_many(lengths, dens)
    one = [m.predict(row[row > 0], d[row > 0]) for row, d in zip(lengths, dens, strict=True)]
    np.testing.assert_allclose(many, one, rtol=1e-12)
    assert np.all(many > 0) and np.all(np.isfinite(many))


def test_per_layer_densities_sum_layers():
    m = LatencyModel(synthetic_profile(layers=2))
    flat = m.predict([300, 700], [0.2, 0.6])
    per_layer = m.predict([300, 700], np.array([[0.2, 0.6], [0.2, 0.6]]))
    assert per_layer == pytest.approx(flat)
    assert m.predict([300, 700], np.array([[0.2, 0.6], [1.0, 1.0]])) > flat
    with pytest.raises(ValueError, match="num_layers"):
        m.predict([300, 700], np.ones((3, 2)))


def test_additive_decomposition_for_linear_tables():
    m = LatencyModel(synthetic_profile())
    lengths, dens = np.array([200, 900, 1500]), np.array([0.1, 0.5, 0.9])
    total = m.microbatch_overhead() + m.doc_seconds(lengths, dens).sum()
    assert total == pytest.approx(m.predict(lengths, dens), rel=1e-9)


def test_outside_grid_warns_once_and_stays_sane():
    m = LatencyModel(synthetic_profile())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        big = m.predict([8192], [0.5])
        small = m.predict([16], [0.01])
        m.predict([100000], [1.0])
    outside = [w for w in caught if "outside the profiled grid" in str(w.message)]
    assert len(outside) == 1 and outside[0].category is OutsideGridWarning
    assert big > m.predict([2048], [0.5]) and 0 < small < m.predict([128], [0.05])
    # The analytic extension keeps the quadratic trend: 4x length -> ~16x attention at density 1.
    ratio = m.layer_attention_seconds(8192, 1.0) / m.layer_attention_seconds(2048, 1.0)
    assert 8 < ratio < 17


@pytest.mark.parametrize(
    "lengths,dens,match",
    [
        ([0], [0.5], "lengths"),
        ([100], [0.0], "densities"),
        ([100], [1.5], "densities"),
        ([100], [float("nan")], "densities"),
        ([], [], "at least one"),
    ],
)
def test_bad_inputs(lengths, dens, match):
    with pytest.raises(ValueError, match=match):
        LatencyModel(synthetic_profile()).predict(lengths, dens)


def test_json_round_trip_and_corrupt_files(tmp_path):
    p = synthetic_profile()
    path = tmp_path / "p.json"
    p.save(path)
    q = load_profile(path)
    assert q == p
    assert LatencyModel(q).predict([700], [0.3]) == LatencyModel(p).predict([700], [0.3])
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_profile(tmp_path / "bad.json")
    data = p.to_json()
    del data["head"]
    (tmp_path / "missing.json").write_text(__import__("json").dumps(data))
    with pytest.raises(ValueError, match="head"):
        load_profile(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="does not exist"):
        load_profile(tmp_path / "nope.json")
    data = p.to_json()
    data["attention"]["densities"] = [0.0, 0.2, 0.5, 1.0]
    with pytest.raises(ValueError, match="densities"):
        Profile.from_json(data)


def test_fingerprint_mismatch_warns_or_errors():
    p = synthetic_profile()
    with pytest.warns(ProfileMismatchWarning, match="device"):
        p.check_fingerprint({"device": "other"})
    with pytest.raises(ValueError, match="--strict"):
        p.check_fingerprint({"device": "other"}, strict=True)
    assert p.check_fingerprint({"device": "synthetic"}) == []


def test_recalibration_converges_to_a_different_true_machine():
    """The profile is 'foreign': the true machine is 1.5x slower at attention, 0.8x at the rest."""
    model = LatencyModel(synthetic_profile())
    foreign = synthetic_profile()
    foreign.scales = [1.5, 0.8, 0.8]  # attention, everything token-proportional
    truth = LatencyModel(foreign)
    rng = np.random.default_rng(0)
    batches = [(rng.integers(128, 1300, rng.integers(1, 4)), rng.uniform(0.05, 1, 3)) for _ in range(200)]
    batches = [(n, d[: len(n)]) for n, d in batches]

    def mape():
        return np.mean([abs(model.predict(n, d) / truth.predict(n, d) - 1) for n, d in batches[:50]])

    assert mape() > 0.1
    steps = None
    for step, (n, d) in enumerate(batches, 1):
        noisy = truth.predict(n, d) * (1 + 0.02 * rng.standard_normal())
        model.update(n, d, noisy)
        if steps is None and mape() < 0.05:
            steps = step
    assert steps is not None and steps <= 10
    assert mape() < 0.03
    state = model.state_dict()
    fresh = LatencyModel(synthetic_profile())
    fresh.load_state_dict(state)
    assert fresh.predict([700], [0.3]) == model.predict([700], [0.3])


def test_update_rejects_bad_measurements():
    model = LatencyModel(synthetic_profile())
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="measured"):
            model.update([500], [0.5], bad)


def test_recalibration_stays_sane_when_rest_and_head_move_apart():
    """Rest-of-layer and head both scale with tokens, so no update can tell them apart: the
    online factors must neither drift to their bounds nor lose accuracy (seen in a real run)."""
    model = LatencyModel(synthetic_profile())
    truth_profile = synthetic_profile()
    truth_profile.scales = [1.2, 0.7, 1.4]
    truth = LatencyModel(truth_profile)
    rng = np.random.default_rng(1)
    for _ in range(300):
        n = rng.integers(128, 1300, rng.integers(1, 4))
        d = rng.uniform(0.05, 1, len(n))
        model.update(n, d, truth.predict(n, d) * (1 + 0.05 * rng.standard_normal()))
    assert np.all((model.calibration.theta > 0.3) & (model.calibration.theta < 3))
    probe = [(rng.integers(128, 1300, 2), rng.uniform(0.05, 1, 2)) for _ in range(50)]
    err = np.mean([abs(model.predict(n, d) / truth.predict(n, d) - 1) for n, d in probe])
    assert err < 0.05


def test_sab_cp_says_once_which_documents_the_form_prices_beyond_the_tables():
    from sparsebalance.train.trainer import long_document_note

    m = LatencyModel(synthetic_profile())
    top = int(m.profile.attention.lengths[-1])
    assert long_document_note(m, np.array([100, top])) is None
    note = long_document_note(m, np.array([100, 2 * top + 5]))
    assert f"{2 * top + 5:,} tokens" in note and f"{top:,}-token tables" in note
