"""The physical form: kept-pair counts, the relative NNLS fit, tables that reproduce the form,
and the validation breakdown that names the mispredicted component."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparsebalance.latency import LatencyModel
from sparsebalance.latency.form import (
    attention_floor,
    features,
    fit_form,
    form_tables,
    kept_pairs,
    length_grid,
    nnls,
)
from sparsebalance.latency.profile import AttentionTable, Profile, Table1D
from sparsebalance.latency.sweep import random_batches
from sparsebalance.latency.validate import bootstrap_ci, breakdown, validation_summary
from sparsebalance.ops import random_layout

TRUE = np.array([4e-4, 1.8e-4, 2e-6, 2e-3, 2e-2])  # a, b, c, e, f: CPU-like magnitudes


def profile_from(coef, layers=4, block=64, max_len=4096, share=0.7) -> Profile:
    t = form_tables(coef, layers, block, max_len, share)
    return Profile(
        fingerprint={"device": "synthetic"},
        attention=AttentionTable(t["lengths"], t["densities"], t["attention"]),
        layer_other=Table1D(t["lengths"], t["layer_other"]),
        head=Table1D(t["lengths"], t["head"]),
        num_layers=layers,
    )


@pytest.mark.parametrize("length,density", [(64, 1.0), (640, 0.3), (1000, 0.05), (2049, 0.77)])
def test_kept_pairs_match_the_layout_rule(length, density):
    cu = torch.tensor([0, length], dtype=torch.int32)
    layout = random_layout(cu, 2, 64, density)
    counted = layout.num_kept_pairs() / 2  # per head
    est = float(kept_pairs(np.array([length]), np.array([density]), 64)[0])
    # Exact at whole blocks; a partial last block is interpolated (at most one row apart).
    row = max(1.0, round(density * np.ceil(length / 64)))
    assert abs(est - counted) <= (1e-9 if length % 64 == 0 else row)
    assert kept_pairs(np.array([4096]), np.array([1.0]), 64)[0] == 64 * 65 / 2


def test_nnls_matches_lstsq_when_unconstrained_and_clips_negatives():
    rng = np.random.default_rng(0)
    a = rng.uniform(0, 1, (40, 4))
    x_true = np.array([1.0, 2.0, 0.5, 3.0])
    np.testing.assert_allclose(nnls(a, a @ x_true), x_true, rtol=1e-8)
    x = nnls(a, a @ np.array([1.0, -2.0, 0.5, 3.0]))
    assert np.all(x >= 0) and x[1] == 0


def test_fit_recovers_the_form_under_noise():
    batches = random_batches(30, 4096, 32, seed=3, densities=(0.02, 1.0))
    x = features(batches, 4, 64)
    rng = np.random.default_rng(0)
    y = (x @ TRUE) * (1 + 0.02 * rng.standard_normal(len(batches)))
    fit = fit_form(x, y)
    assert fit.loo_mape < 0.04
    assert fit.coefficients[0] == pytest.approx(TRUE[0], rel=0.1)  # attention dominates: pinned
    probe = random_batches(20, 4096, 128, seed=9)
    xp = features(probe, 4, 64)
    assert np.mean(np.abs(fit.predict(xp) / (xp @ TRUE) - 1)) < 0.03
    with pytest.raises(ValueError, match="> 0"):
        fit_form(x, -y)


def test_tables_reproduce_the_form_between_grid_points():
    model = LatencyModel(profile_from(TRUE))
    batches = random_batches(40, 4096, 100, seed=5)
    x = features(batches, 4, 64)
    pred = np.array([model.predict(n, d) for n, d in batches])
    rel = np.abs(pred / (x @ TRUE) - 1)  # tables are the form up to interpolation
    assert rel.max() < 0.025 and rel.mean() < 0.005
    assert length_grid(4096)[0] == 1 and length_grid(4096)[-1] == 4096


def test_breakdown_names_the_mispredicted_component():
    model = LatencyModel(profile_from(TRUE))
    batches = random_batches(40, 4096, 64, seed=2)
    wrong = TRUE * np.array([1.0, 1.0, 1.0, 1.0, 1.0])
    wrong[0] *= 1.3  # the truth's attention is 1/1.3: the model over-predicts attention by 30 %
    truth = LatencyModel(profile_from(TRUE / np.array([1.3, 1, 1, 1, 1])))
    measured = [truth.predict(n, d) for n, d in batches]
    summary = validation_summary(model, batches, measured)
    comp = summary["breakdown"]["component_error"]
    assert comp["attention"] == pytest.approx(0.3, abs=0.03)
    assert abs(comp["per_token"]) < 0.05
    lo, hi = summary["mape_ci95"]
    assert lo <= summary["mape"] <= hi
    groups = {g["group"]: g for g in summary["breakdown"]["groups"]}
    assert groups["1 document"]["n"] + groups["2-4 documents"]["n"] == 40
    assert breakdown(model, batches, np.zeros(40))["component_error"]["attention"] == 0.0


def test_level_and_shape_split_a_global_scale_from_a_misfit():
    """A machine 10 % slower at validation (every time x 1.1) is pure level: no shape error;
    a wrong attention coefficient is shape error that no single scale removes."""
    model = LatencyModel(profile_from(TRUE))
    batches = random_batches(40, 4096, 64, seed=3)
    pred = [model.predict(n, d) for n, d in batches]
    slow = validation_summary(model, batches, [1.1 * t for t in pred])
    assert slow["level"] == pytest.approx(1 / 1.1 - 1, abs=1e-9)
    assert slow["shape_mape"] < 1e-9 and slow["mape"] > 0.09
    truth = LatencyModel(profile_from(TRUE / np.array([1.5, 1, 1, 1, 1])))
    misfit = validation_summary(model, batches, [1.1 * truth.predict(n, d) for n, d in batches])
    assert misfit["shape_mape"] > 0.02 and misfit["shape_max_error"] >= misfit["shape_mape"]


def test_bootstrap_interval_shrinks_with_more_batches():
    rng = np.random.default_rng(0)
    wide = bootstrap_ci(rng.normal(0, 0.1, 10))
    narrow = bootstrap_ci(rng.normal(0, 0.1, 400))
    assert wide[1] - wide[0] > narrow[1] - narrow[0] > 0


def test_design_keeps_the_corners_when_the_pilot_says_everything_is_expensive():
    """Under heavy load the pilot prices every point over budget: the corner points (up to the
    capacity) must still be timed, else the fit extrapolates from small micro-batches only."""
    from sparsebalance.latency.sweep import choose_design, core_design

    design = choose_design(4096, 64, cost=lambda b: 100.0, budget_s=40, rounds=3)
    corners, _ = core_design(4096, 64)
    assert all(c in design for c in corners)
    assert max(sum(b[0]) for b in design) == 4096 and len(design) >= 10


def _cost(batch) -> float:
    return float(features([batch], 4, 64)[0] @ TRUE)


def _featurize(batches):
    return features(batches, 4, 64)


def test_optimal_design_predicts_better_for_the_same_seconds():
    """I-optimal per second: within the same timing budget, a lower mean relative prediction
    variance over run-like micro-batches than the random fill; every token octave covered."""
    from sparsebalance.latency.sweep import choose_design, prediction_variance

    def variance(design) -> float:
        x = _featurize(design) / np.array([_cost(b) for b in design])[:, None]
        ref = _featurize(random_batches(200, 4096, 32, seed=11))
        ref = ref / (ref @ TRUE)[:, None]
        s = x.max(0)
        return prediction_variance(ref / s, (x / s).T @ (x / s))

    results = {}
    for name, fz in (("random", None), ("optimal", _featurize)):
        design = choose_design(4096, 64, _cost, budget_s=20, rounds=4, featurize=fz, seed=3)
        spent = sum(4 * _cost(b) + 0.05 for b in design)
        results[name] = (variance(design), spent, design)
    (v_rand, _, _), (v_opt, s_opt, design) = results["random"], results["optimal"]
    assert s_opt <= 20 + 1e-9 and v_opt < 0.8 * v_rand
    tokens = [sum(b[0]) for b in design]
    for k in range(4):
        assert any(4096 / 2 ** (k + 1) < n <= 4096 / 2**k for n in tokens), k


def test_robust_fit_drops_an_injected_outlier():
    from sparsebalance.latency.form import fit_form_robust

    batches = random_batches(24, 4096, 32, seed=4, densities=(0.02, 1.0))
    x = features(batches, 4, 64)
    rng = np.random.default_rng(1)
    y = (x @ TRUE) * (1 + 0.03 * rng.standard_normal(len(batches)))
    fit, dropped = fit_form_robust(x, y, noise=0.03)
    assert dropped == []  # plain noise: nothing rejected
    y_bad = y.copy()
    y_bad[7] *= 2.0  # a burst of load that hit every timing of one micro-batch
    plain = fit_form(x, y_bad)
    fit, dropped = fit_form_robust(x, y_bad, noise=0.03)
    assert dropped == [7]
    xp = features(random_batches(30, 4096, 128, seed=9), 4, 64)
    err = lambda f: np.mean(np.abs(f.predict(xp) / (xp @ TRUE) - 1))  # noqa: E731
    assert err(fit) < 0.03 < err(plain)


def test_time_interleaved_warms_up_untimed():
    """A first call that is slow (allocation for new shapes) must not reach the median."""
    import time as _time

    from sparsebalance.latency.sweep import time_interleaved

    calls = [0, 0]

    def make(i):
        def fn():
            calls[i] += 1
            if calls[i] == 1:
                _time.sleep(0.2)

        return fn

    t = time_interleaved([make(0), make(1)], torch.device("cpu"), rounds=2, min_rounds=2)
    assert calls == [3, 3]  # one untimed warm-up + 2 rounds each
    assert t.seconds.shape == (2, 2) and float(t.seconds.max()) < 0.1
    calls[0] = 0  # cold again: without the warm-up the slow first call is timed
    cold = time_interleaved([make(0)], torch.device("cpu"), rounds=1, min_rounds=1, warmup=False)
    assert calls[0] == 1 and float(cold.seconds.max()) >= 0.2


def test_a_floor_keeps_attention_priced_when_the_times_hide_it():
    # Times that are per-token work only: NNLS puts the attention coefficient at 0, which would
    # price every budget at nothing. The floor holds it at the physical least, and the fit of
    # the rest stays close (the floor is small next to the per-token term).
    batches = [([64 * k + 7], [0.1 * k]) for k in range(1, 12)]
    x = features(batches, num_layers=2, block_size=16)
    y = 1e-6 * x[:, 1] + 1e-4
    free = fit_form(x, y)
    assert free.coefficients[0] == 0.0
    a_min = attention_floor(1e-6, token_flops=6e7, heads=4, head_dim=16, block_size=16)
    assert a_min == pytest.approx(0.25 * 14 * 16 * 16 * 16 * 4 * 1e-6 / 6e7)
    held = fit_form(x, y, floor=[a_min, 0, 0, 0, 0])
    assert held.coefficients[0] >= a_min
    assert all(c >= 0 for c in held.coefficients)
    assert np.max(np.abs(held.predict(x) / y - 1)) < 0.05
    assert attention_floor(0.0, 6e5, 4, 16, 16) == 0.0
