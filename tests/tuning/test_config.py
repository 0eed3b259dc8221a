"""DSTConfig validation names the CLI flag; the flags round-trip through argparse."""

import argparse

import pytest

from sparsebalance.tuning import DSTConfig, add_dst_arguments


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"mode": "up"}, "--dst-mode"),
        ({"anchor": "p90"}, "--anchor"),
        ({"p": -0.01}, "--tolerance"),
        ({"p": float("inf")}, "--tolerance"),
        ({"gamma0": 1.0}, "--gamma0"),
        ({"gamma0": "0.9"}, "--gamma0"),
        ({"gamma_min": 0.0}, "--gamma-min"),
        ({"gamma_min": 0.95}, "--gamma-min"),  # above gamma0
        ({"gamma_max": 0.8}, "--gamma-max"),  # below gamma0
        ({"gamma_max": 1.01}, "--gamma-max"),
        ({"layer_probes": 1}, "--dst-probes"),
        ({"layer_probes": True}, "--dst-probes"),
    ],
)
def test_bad_config_names_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        DSTConfig(**kwargs)


def test_defaults():
    cfg = DSTConfig()
    assert (cfg.mode, cfg.anchor, cfg.p) == ("bidirectional", "mean", 0.1)
    assert cfg.gamma_min <= cfg.gamma0 <= cfg.gamma_max <= 1.0


def test_flags_round_trip():
    parser = argparse.ArgumentParser()
    add_dst_arguments(parser)
    assert DSTConfig.from_args(parser.parse_args([])) == DSTConfig()
    flags = "--dst-mode down --anchor median --tolerance 0.05 --gamma0 0.8 --gamma-min 0.6"
    args = parser.parse_args([*flags.split(" "), "--gamma-max", "0.95", "--dst-probes", "5"])
    assert DSTConfig.from_args(args) == DSTConfig("down", "median", 0.05, 0.8, 0.6, 0.95, 5)


def test_from_args_validates():
    parser = argparse.ArgumentParser()
    add_dst_arguments(parser)
    with pytest.raises(ValueError, match="--gamma-min"):
        DSTConfig.from_args(parser.parse_args(["--gamma-min", "0.95"]))


def test_gamma0_one_means_dense_and_needs_dst_off():
    from sparsebalance.tuning import DensityCurve

    assert DSTConfig(mode="off", gamma0=1.0).gamma0 == 1.0
    with pytest.raises(ValueError, match="--dst-mode off"):
        DSTConfig(mode="bidirectional", gamma0=1.0, gamma_max=1.0)
    curve = DensityCurve(gamma0=1.0)
    assert curve.density(0.3, 1.0) == pytest.approx(1.0)
