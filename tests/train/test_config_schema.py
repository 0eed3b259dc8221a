"""Config schema 2: ``dst.p`` became the paper's coverage bound. A config written when it was the
time band is converted to what it meant, never reread under the new meaning; a hand-written file
that sets it without saying which meaning is refused."""

from __future__ import annotations

import argparse
import json

import pytest

from sparsebalance.train import TrainConfig
from sparsebalance.train.config_io import add_train_arguments, config_from_args, to_record, upgrade
from sparsebalance.versions import CONFIG


def _parse(argv):
    p = argparse.ArgumentParser()
    add_train_arguments(p)
    return config_from_args(p.parse_args(argv))


def test_a_schema_1_config_is_converted_to_what_it_meant(tmp_path, capsys):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"schema_version": 1, "steps": 3, "dst": {"p": 0.05, "gamma0": 0.8}}))
    cfg = _parse(["--config", str(path)])
    d = cfg.dst
    assert (d.budget, d.tolerance, d.p, d.raise_to, d.gamma0) == ("gamma", 0.05, 1.0, "step", 0.8)
    assert (cfg.strategy, cfg.estimator) == ("sab", "history")  # schema 1's defaults
    assert "read as it was meant" in capsys.readouterr().err


def test_the_current_schema_reads_p_as_the_coverage_bound(tmp_path):
    path = tmp_path / "new.toml"
    path.write_text("schema_version = 2\n[dst]\np = 0.2\n")
    cfg = _parse(["--config", str(path)])
    assert (cfg.dst.budget, cfg.dst.p, cfg.dst.tolerance) == ("top-k", 0.2, 0.0)


def test_a_hand_written_p_without_a_version_is_refused(tmp_path):
    path = tmp_path / "hand.toml"
    path.write_text("[dst]\np = 0.1\n")
    with pytest.raises(ValueError, match="coverage bound since config schema 2"):
        _parse(["--config", str(path)])
    path.write_text("[dst]\nanchor = 'min'\n")  # no p: nothing ambiguous
    assert _parse(["--config", str(path)]).dst.anchor == "min"


def test_written_configs_carry_the_version_and_round_trip(tmp_path):
    cfg = TrainConfig(out=str(tmp_path / "r"))
    record = to_record(cfg)
    assert record["schema_version"] == CONFIG.version == 2
    path = tmp_path / "launch-config.json"
    path.write_text(json.dumps(record))
    assert _parse(["--config", str(path)]) == cfg
    assert upgrade({"dst": {}}, 2) == ({"dst": {}}, "")


def test_the_demo_budget_default_gives_way_to_a_gamma_budget():
    from sparsebalance.train.demo import DEMO_DEFAULTS

    p = argparse.ArgumentParser()
    add_train_arguments(p)
    cfg = config_from_args(p.parse_args(["--budget", "gamma"]), DEMO_DEFAULTS)
    assert cfg.dst.budget == "gamma" and DEMO_DEFAULTS["dst"] == {"budget_tokens": 512}
    assert config_from_args(p.parse_args([]), DEMO_DEFAULTS).dst.budget_tokens == 512
    with pytest.raises(ValueError, match=r"--budget-tokens\)? only applies to .*--budget\)? top-k"):
        config_from_args(p.parse_args(["--budget", "gamma", "--budget-tokens", "64"]))
