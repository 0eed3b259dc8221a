"""DSTConfig validation names the CLI flag; the flags round-trip through argparse; the knob."""

import argparse

import pytest

from sparsebalance.tuning import DensityCurve, DSTConfig, GammaKnob, TopKKnob, add_dst_arguments


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"mode": "up"}, "--dst-mode"),
        ({"anchor": "p90"}, "--anchor"),
        ({"raise_to": "max"}, "--raise-to"),
        ({"budget": "topk"}, "--budget"),
        ({"p": -0.01}, "--coverage-bound"),
        ({"p": 1.5}, "--coverage-bound"),
        ({"p": float("inf")}, "--coverage-bound"),
        ({"tolerance": -0.1}, "--tolerance"),
        ({"budget_tokens": -1}, "--budget-tokens"),
        ({"budget_tokens": 1.5}, "--budget-tokens"),
        ({"budget_tokens": 512, "budget_tokens_min": 1024}, "--budget-tokens-min"),
        ({"budget_tokens": 512, "budget_tokens_max": 256}, "--budget-tokens-max"),
        ({"gamma0": 0.8}, "--gamma0"),  # a gamma field under --budget top-k
        ({"budget": "gamma", "budget_tokens": 1024}, "--budget-tokens"),  # and the reverse
        ({"budget": "gamma", "gamma0": 1.0}, "--gamma0"),
        ({"budget": "gamma", "gamma0": "0.9"}, "--gamma0"),
        ({"budget": "gamma", "gamma_min": 0.0}, "--gamma-min"),
        ({"budget": "gamma", "gamma_min": 0.95}, "--gamma-min"),  # above gamma0
        ({"budget": "gamma", "gamma_max": 0.8}, "--gamma-max"),  # below gamma0
        ({"budget": "gamma", "gamma_max": 1.01}, "--gamma-max"),
        ({"layer_probes": 1}, "--dst-probes"),
        ({"layer_probes": True}, "--dst-probes"),
    ],
)
def test_bad_config_names_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        DSTConfig(**kwargs)


def test_defaults_are_the_papers_rule():
    cfg = DSTConfig()
    assert (cfg.mode, cfg.anchor, cfg.p, cfg.tolerance) == ("bidirectional", "mean", 0.1, 0.0)
    assert (cfg.budget, cfg.budget_tokens, cfg.raise_to) == ("top-k", 8192, "anchor")


def test_flags_round_trip():
    parser = argparse.ArgumentParser()
    add_dst_arguments(parser)
    assert DSTConfig.from_args(parser.parse_args([])) == DSTConfig()
    flags = "--dst-mode down --anchor median --tolerance 0.05 --budget gamma --gamma0 0.8"
    args = parser.parse_args(
        [*flags.split(" "), "--gamma-min", "0.6", "--gamma-max", "0.95", "--dst-probes", "5", "--coverage-bound", "0.2"]
    )
    assert DSTConfig.from_args(args) == DSTConfig(
        mode="down",
        anchor="median",
        p=0.2,
        tolerance=0.05,
        budget="gamma",
        gamma0=0.8,
        gamma_min=0.6,
        gamma_max=0.95,
        layer_probes=5,
    )
    args = parser.parse_args(
        ["--budget-tokens", "2048", "--budget-tokens-min", "256", "--raise-to", "step", "--dst.p", "0.3"]
    )
    assert DSTConfig.from_args(args) == DSTConfig(budget_tokens=2048, budget_tokens_min=256, raise_to="step", p=0.3)


def test_from_args_validates():
    parser = argparse.ArgumentParser()
    add_dst_arguments(parser)
    with pytest.raises(ValueError, match="--gamma-min"):
        DSTConfig.from_args(parser.parse_args(["--budget", "gamma", "--gamma-min", "0.95"]))


def test_gamma0_one_means_dense_and_needs_dst_off():
    assert DSTConfig(budget="gamma", mode="off", gamma0=1.0).gamma0 == 1.0
    with pytest.raises(ValueError, match=r"\(--dst-mode\) off"):
        DSTConfig(budget="gamma", mode="bidirectional", gamma0=1.0, gamma_max=1.0)
    curve = DensityCurve(gamma0=1.0)
    assert curve.density(0.3, 1.0) == pytest.approx(1.0)


def test_topk_budget_is_stated_in_tokens():
    """The same token budget keeps the same attended tokens at another block size."""
    cfg = DSTConfig(budget_tokens=8192, budget_tokens_min=2048, budget_tokens_max=16384)
    k64, k128 = cfg.knob(64), cfg.knob(128)
    assert isinstance(k64, TopKKnob)
    assert (k64.base, k64.lo, k64.hi) == (128, 32, 256)
    assert (k128.base, k128.lo, k128.hi) == (64, 16, 128)
    assert k64.base * 64 == k128.base * 128 == 8192
    assert DSTConfig(budget_tokens=512).knob(64).lo == 2  # default floor: a quarter of the base


def test_gamma_knob_checks_its_curve():
    knob = DSTConfig(budget="gamma").knob(64)
    assert isinstance(knob, GammaKnob) and (knob.lo, knob.base, knob.hi) == (0.5, 0.9, 0.99)
    with pytest.raises(ValueError, match="--gamma0"):
        DSTConfig(budget="gamma", gamma0=0.8).knob(64, DensityCurve(gamma0=0.9))
