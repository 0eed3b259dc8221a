"""One config mechanism: flags, TOML keys and --help generated from the dataclass fields; nested
``[dst]`` / ``--dst.FIELD`` with the earlier short flags as aliases; the launcher's config file."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field, replace

import pytest

from sparsebalance import flags
from sparsebalance.train import TrainConfig, add_train_arguments, config_from_args
from sparsebalance.train.config_io import to_record
from sparsebalance.tuning import DSTConfig


def _parse(argv: list[str]) -> TrainConfig:
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    return config_from_args(parser.parse_args(argv))


def test_defaults_come_from_the_dataclass_only():
    assert _parse([]) == TrainConfig()
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    assert all(a.default in (None, argparse.SUPPRESS) for a in parser._actions if a.dest != "help")


def test_nested_flags_and_their_aliases_agree():
    dotted = _parse(
        [
            "--dst.budget",
            "gamma",
            "--dst.gamma-min",
            "0.6",
            "--dst.anchor",
            "median",
            "--dst.p",
            "0.05",
            "--dst.tolerance",
            "0.02",
            "--dst.layer-probes",
            "4",
            "--dst.mode",
            "down",
        ]
    )
    short = _parse(
        [
            "--budget",
            "gamma",
            "--gamma-min",
            "0.6",
            "--anchor",
            "median",
            "--coverage-bound",
            "0.05",
            "--tolerance",
            "0.02",
            "--dst-probes",
            "4",
            "--dst-mode",
            "down",
        ]
    )
    assert dotted == short
    assert dotted.dst == DSTConfig(
        mode="down", anchor="median", p=0.05, tolerance=0.02, budget="gamma", gamma_min=0.6, layer_probes=4
    )


def test_toml_dst_table_then_flags_on_top(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('steps = 7\nglobal_batch = 4\n[dst]\nanchor = "max"\nbudget = "gamma"\ngamma0 = 0.85\n')
    cfg = _parse(["--config", str(path), "--gamma0", "0.8", "--steps", "3"])
    assert (cfg.steps, cfg.global_batch) == (3, 4)  # flags win over the file
    assert (cfg.dst.anchor, cfg.dst.gamma0, cfg.dst.mode) == ("max", 0.8, "bidirectional")
    path.write_text("[dst]\ngamma_lo = 0.2\n")
    with pytest.raises(ValueError, match=r"\[dst\]: unknown keys \['gamma_lo'\]"):
        _parse(["--config", str(path)])
    path.write_text("stepz = 2\n")
    with pytest.raises(ValueError, match="unknown keys"):
        _parse(["--config", str(path)])
    with pytest.raises(ValueError, match="--gamma-min"):  # validation still names the flag
        _parse(["--budget", "gamma", "--gamma-min", "0.95"])
    with pytest.raises(ValueError, match=r"--gamma-min\)? only applies to .*--budget\)? gamma"):
        _parse(["--gamma-min", "0.6"])  # a gamma setting under the default top-k: not ignored


def test_the_launcher_file_round_trips_the_whole_nested_config(tmp_path):
    cfg = replace(
        TrainConfig(),
        micro_batches=3,
        capacity=None,
        measure_bubble="exact",
        dst=DSTConfig(mode="down", anchor="min", p=0.2, budget_tokens=1024, budget_tokens_min=128),
    )
    path = tmp_path / "launch-config.json"
    path.write_text(json.dumps(to_record(cfg)))  # what the launcher writes: with its version
    assert _parse(["--config", str(path)]) == cfg
    assert _parse(["--micro-batches", "2"]).capacity is None  # replaces the default bound


def test_help_text_is_the_field_docstring():
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    helps = {a.dest: a.help for a in parser._actions}
    assert helps["seed"].startswith("seeds the model") and "(default: 0)" in helps["seed"]
    assert "weight decay" in helps["weight_decay"]
    assert "coverage" in helps["dst.p"] and "(default: 0.1)" in helps["dst.p"]
    assert "time band" in helps["dst.tolerance"] and "(default: 0)" in helps["dst.tolerance"]
    assert all(h for d, h in helps.items() if d not in ("help",)), "every flag has help text"


@dataclass(frozen=True)
class _Inner:
    sizes: tuple[int, ...] = (8,)
    """[--size] ranks, comma list."""
    pair: tuple[float, float] = (1.0, 1.0)
    """Two numbers."""


@dataclass(frozen=True)
class _Outer:
    name: str = "x"
    """A name."""
    flag: bool = False
    """A switch."""
    inner: _Inner = field(default_factory=_Inner)
    """A section."""


def test_generic_types_tuples_bools_and_sections():
    parser = argparse.ArgumentParser()
    flags.add_arguments(parser, _Outer)
    args = parser.parse_args(["--inner.sizes", "8,64,1_024", "--inner.pair", "0.5,2", "--flag"])
    out = flags.build(_Outer, flags.values_from_args(args, _Outer))
    assert out == _Outer(flag=True, inner=_Inner(sizes=(8, 64, 1024), pair=(0.5, 2.0)))
    assert parser.parse_args(["--size", "4"]).__dict__["inner.sizes"] == (4,)  # the alias
    with pytest.raises(SystemExit):
        parser.parse_args(["--inner.pair", "1,2,3"])
    assert flags.build(_Outer, {"inner": {"sizes": [2, 4]}}).inner.sizes == (2, 4)  # TOML arrays
