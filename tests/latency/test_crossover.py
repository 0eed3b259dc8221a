"""The dense-path crossover (issue 36, item 4): measured once per profile on CUDA for top-k
budgets, recorded as ``Profile.dense_from``; documents from that density cost what the sparse
kernel costs at the crossover (the attention table is flat from it), and a run promotes them to
exact attention on the dense kernel (``tests/ops/test_promotion.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparsebalance.latency import LatencyModel, analytic_profile
from sparsebalance.latency.crossover import DENSITIES, crossover_from_times, measure_dense_crossover
from sparsebalance.latency.form import features, form_tables
from sparsebalance.latency.profile import Profile
from sparsebalance.models import load_shapes


@pytest.mark.parametrize(
    "sparse, dense, want",
    [
        ([1.0, 2.0, 4.0, 8.0], 3.0, 0.15),  # between 0.1 and 0.2: 2 -> 4 crosses 3 halfway
        ([5.0, 6.0, 7.0, 8.0], 3.0, 0.05),  # slower already at the lowest density
        ([1.0, 1.5, 2.0, 2.5], 3.0, None),  # never slower: no document is faster dense
        ([1.0, 3.0, 4.0, 5.0], 3.0, 0.1),  # exactly at a timed density
    ],
)
def test_crossover_from_times(sparse, dense, want):
    got = crossover_from_times([0.05, 0.1, 0.2, 0.4], sparse, dense)
    assert got == (pytest.approx(want) if want is not None else None)


def test_crossover_refuses_unordered_or_broken_times():
    with pytest.raises(ValueError, match="ascending"):
        crossover_from_times([0.2, 0.1], [1.0, 2.0], 1.0)
    with pytest.raises(ValueError, match="finite"):
        crossover_from_times([0.1, 0.2], [1.0, float("nan")], 1.0)


def test_the_driver_times_every_density_and_the_dense_kernel():
    """Run on CPU (the torch backend stands in for flex), with a timer that runs each call once
    and returns prescribed seconds: every timed call must be a real forward + backward."""
    shapes = load_shapes("tiny")
    seconds = iter([0.1 * (i + 1) for i in range(len(DENSITIES))] + [0.35])
    calls = []

    def timer(fn):
        fn()
        calls.append(fn)
        return next(seconds)

    got = measure_dense_crossover(shapes, torch.device("cpu"), torch.float32, 64, 512, timer, backend="torch")
    assert len(calls) == len(DENSITIES) + 1
    # sparse times 0.1, 0.2, 0.3, 0.4 at 0.05, 0.1, 0.15, 0.2: 0.35 is crossed halfway
    assert got == pytest.approx(0.175)


def test_the_profile_is_flat_from_the_crossover_and_round_trips():
    shapes = load_shapes("tiny")
    base = analytic_profile(shapes, "h100", block_size=64)
    coef = [1e-7, 1e-6, 0.0, 1e-5, 1e-4]
    flat = form_tables(coef, shapes.num_layers, 64, 4096, 0.9, dense_from=0.4)
    dens = np.asarray(flat["densities"])
    att = np.asarray(flat["attention"])
    at = int(np.argmin(np.abs(dens - 0.4)))
    assert np.allclose(att[:, at:], att[:, [at]]) and not np.allclose(att[:, 0], att[:, at])
    x = features([([2048], [0.9]), ([2048], [0.4])], shapes.num_layers, 64, dense_from=0.4)
    assert np.allclose(x[0], x[1])
    data = {**base.to_json(), "dense_from": 0.4}
    profile = Profile.from_json(data)
    assert profile.dense_from == 0.4 and Profile.from_json(profile.to_json()).dense_from == 0.4
    with pytest.raises(ValueError, match="dense_from must be in"):
        Profile.from_json({**base.to_json(), "dense_from": 1.5})
    assert LatencyModel(profile).profile.dense_from == 0.4


def test_a_version_2_profile_is_read_without_a_crossover():
    base = analytic_profile(load_shapes("tiny"), "h100", block_size=64).to_json()
    old = {**base, "schema": "sparsebalance.profile/2"}
    old.pop("dense_from")
    assert Profile.from_json(old).dense_from is None
