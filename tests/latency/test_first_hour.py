"""Issue 45, the first hour: the latency start-up says what it is about to measure before it
waits, reuses one cached profile wherever the latency model allows it, says what its noise means
and what to do in one line, and warns only about what the user did not ask for, in one line.

No profile is really measured here: a stand-in measure function returns a profile at once."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import sparsebalance.latency as latency
from sparsebalance.engine import load_latency_model, resolve_kernel
from sparsebalance.latency import (
    LatencyModel,
    OutsideGridWarning,
    ProfileMismatchWarning,
    analytic_profile,
    fingerprint,
    measure,
)
from sparsebalance.models import load_shapes
from tests.latency.test_form import TRUE, profile_from

CPU = torch.device("cpu")
TINY = load_shapes("tiny")
NOISY = {"cv_median": 1.103, "rounds": 3, "design_points": 12, "load_1min": 2.0}


@pytest.fixture
def stand_in(monkeypatch, tmp_path, capsys):
    """Measuring replaced by an instant stand-in; the cache is a fresh folder. Each call records
    its settings and what stderr held when it started."""
    calls: list[dict] = []

    def measure_profile(shapes, device, dtype, backend, block_size, max_len, budget_s, *a, **kw):
        kw["announce"](64.0)  # what its pilot would estimate, a few seconds in
        calls.append(
            {
                "block_size": block_size,
                "max_len": max_len,
                "layout": kw["layout"],
                "stderr_before": capsys.readouterr().err,
            }
        )
        p = profile_from(TRUE, layers=shapes.num_layers, block=block_size, max_len=max_len)
        p.fingerprint = fingerprint(shapes, device, dtype, backend, block_size, kw["threads"], kw["layout"])
        p.noise, p.fit = dict(NOISY), {"loo_mape": 0.27}
        return p

    monkeypatch.setattr(measure, "measure_profile", measure_profile)
    monkeypatch.setattr(latency, "CACHE_DIR", tmp_path / "profiles")
    return calls


def start(
    budget: str = "top-k", block_size: int = 32, max_len: int = 1024, flag="profile", profile=None
) -> LatencyModel:
    """The start-up ``sparsebalance.hf.enable`` runs on one process (CPU, fp32)."""
    kernel = resolve_kernel(CPU, block_size, "auto", "fp32")
    return load_latency_model(TINY, kernel, budget, profile, max_len, True, lambda o: [o], flag=flag)


def test_measuring_a_profile_is_said_first_in_one_line(stand_in, capsys):
    start()
    err = stand_in[0]["stderr_before"]
    lines = err.splitlines()
    assert len(lines) == 1, err  # said once, before the wait
    line = lines[0]
    assert line.startswith("sparsebalance: measuring a latency profile for tiny on cpu")
    for part in (
        "block size 32",
        "top-k budgets",
        "up to 1,024 tokens",
        "about 64 s (estimated from a first timing here)",
        "cached in",
        "profiles/tiny-",
        "pass profile=PATH to skip it",
        "another block size or budget kind measures its own",
    ):
        assert part in line, (part, line)
    after = capsys.readouterr().err
    assert "a latency profile for" not in after and "timing noise" in after  # the noise line next
    start()
    assert len(stand_in) == 1 and capsys.readouterr().err == ""  # cached: silent


def test_the_cli_names_its_flag(stand_in):
    start(flag="--profile")
    assert "pass --profile PATH to skip it" in stand_in[0]["stderr_before"]


def test_one_profile_serves_every_budget_of_its_kind_and_shorter_capacities(stand_in):
    first = start(max_len=2048)
    # hf.enable(capacity=1024) after capacity=2048, another top-k budget: no second measurement
    again = start(max_len=1024)
    assert len(stand_in) == 1
    assert again.profile.fingerprint == first.profile.fingerprint
    start(max_len=4096)  # longer micro-batches than it was measured for: measured again
    start(max_len=1024, block_size=64)  # another block size: its own
    start(max_len=1024, budget="gamma")  # another budget kind (threshold layouts): its own
    measured = [(c["max_len"], c["block_size"], c["layout"]) for c in stand_in]
    assert measured == [(2048, 32, "top-k"), (4096, 32, "top-k"), (1024, 64, "top-k"), (1024, 32, "threshold")]
    start(max_len=1500)  # the shortest that serves: 2048, not 4096
    assert len(stand_in) == 4


def test_the_budget_value_does_not_measure_another_profile(stand_in):
    """Through the integrations' own start-up: two DST budgets of the top-k kind and two
    capacities share one profile."""
    from sparsebalance.integrations import PlannerConfig
    from sparsebalance.integrations.setup import latency_model
    from sparsebalance.models.hf import build_model
    from sparsebalance.tuning import DSTConfig

    model = build_model("tiny")
    lengths = np.full(64, 300)
    for tokens, capacity in ((8192, 2048), (2048, 1024), (512, 2048)):
        config = PlannerConfig(
            global_batch=8, micro_batches=4, capacity=capacity, block_size=32, dst=DSTConfig(budget_tokens=tokens)
        )
        latency_model(model, config, None, lengths, None, CPU, "fp32")
    assert len(stand_in) == 1


def test_the_noise_line_says_what_it_means_and_what_to_do(stand_in, capsys):
    start()
    err = capsys.readouterr().err
    [line] = [x for x in err.splitlines() if "timing noise 110.3 %" in x]
    assert "NOT reachable" not in line
    assert "expect less balance" in line  # what it means for the run
    assert "to measure again, delete ~/" in line or "to measure again, delete /" in line
    assert "profiles/tiny-" in line and "(or pass profile=PATH)" in line  # what to do


def test_the_profile_command_keeps_its_own_advice():
    p = profile_from(TRUE)
    p.noise, p.fit = dict(NOISY), {"loo_mape": 0.27}
    line = measure.noise_line(p)
    assert "\n" not in line and "rerun `sparsebalance profile` when the machine is quieter" in line


def test_an_analytic_profile_the_user_chose_does_not_warn(tmp_path):
    """The shipped examples' setting: an analytic H100 profile on a CPU run."""
    path = tmp_path / "h100.json"
    analytic_profile(TINY, "h100", block_size=32).save(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start(profile=path)
    assert [str(w.message) for w in caught] == []


def test_a_measured_profile_of_another_setup_warns_in_one_short_line(tmp_path):
    path = tmp_path / "p.json"
    theirs = torch.get_num_threads() + 1  # measured with another thread count
    backend = resolve_kernel(CPU, 32, "auto", "fp32").backend
    p = profile_from(TRUE, layers=TINY.num_layers, block=32, max_len=1024)
    p.fingerprint = {
        **fingerprint(TINY, CPU, "fp32", backend, 32, theirs, "top-k"),
        "max_len": 1024,
        "schema": latency.SCHEMA,
    }  # the trainer's cache writes these
    p.save(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start(profile=path)
    [w] = [w for w in caught if w.category is ProfileMismatchWarning]
    msg = str(w.message)
    assert "\n" not in msg and len(msg) < 250, msg
    assert msg.startswith(
        f"profile {path} was measured on another setup: threads {theirs} vs {theirs - 1} (profile vs this run)"
    ), msg
    assert "max_len" not in msg and "schema" not in msg  # bookkeeping, not the setup
    assert w.filename == __file__  # the user's line, not the library's


def _grid_from(tokens: int):
    """A profile whose tables start at ``tokens`` (an analytic profile's used to start at one
    block)."""
    p = profile_from(TRUE, block=64, max_len=4096)
    keep = [i for i, n in enumerate(p.attention.lengths) if n >= tokens]
    p.attention.lengths = [p.attention.lengths[i] for i in keep]
    p.attention.seconds = [p.attention.seconds[i] for i in keep]
    for table in (p.layer_other, p.head):
        table.tokens = [table.tokens[i] for i in keep]
        table.seconds = [table.seconds[i] for i in keep]
    return p


def _outside(call) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    assert all(w.category is OutsideGridWarning for w in caught), caught
    return [str(w.message) for w in caught]


def test_outside_the_grid_names_the_inputs_once_per_model():
    model = LatencyModel(_grid_from(64))

    def many():
        model.predict([2, 16, 300], [1.0, 1.0, 0.5])
        model.predict([100000], [0.5])
        model.predict_many(np.array([[8000, 9000]]), np.array([[0.5, 0.5]]))
        model.prepare(np.array([[3, 900]])).predict(np.array([[0.5, 0.001]]))

    [msg] = _outside(many)  # once per model
    assert "\n" not in msg and "outside the profiled grid" in msg
    assert msg.endswith("document lengths 2..16 (grid 64..4,096)"), msg
    dens = LatencyModel(_grid_from(64))  # another model says it for its own inputs
    [msg] = _outside(lambda: dens.predict_many(np.array([[3000, 900]]), np.array([[0.004, 0.5]])))
    assert msg.endswith("densities 0.004..0.004 (grid 0.01..1)"), msg
    tokens = LatencyModel(_grid_from(64))
    [msg] = _outside(lambda: tokens.predict_many(np.array([[3000, 3000]]), np.array([[0.5, 0.5]])))
    assert msg.endswith("micro-batch tokens 6,000..6,000 (grid 64..4,096)"), msg


def test_an_analytic_profile_prices_documents_shorter_than_a_block():
    """The examples' documents (16 tokens and up) and a rank's two-token fillers lie inside an
    analytic profile's tables."""
    model = LatencyModel(analytic_profile(TINY, "h100", block_size=32))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        short = model.predict([2], [1.0])
        mixed = model.predict([16, 600], [1.0, 1.0])
        model.predict_many(np.array([[2, 0], [16, 31]]), np.array([[1.0, 1.0], [1.0, 1.0]]))
    assert caught == []
    assert 0 < short < model.predict([16], [1.0]) < mixed
