"""Measured and analytic profiles through the public entry points (CLI, default model)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from sparsebalance.cli import main
from sparsebalance.latency import (
    LatencyModel,
    analytic_profile,
    default_latency_model,
    load_profile,
)
from sparsebalance.models import load_shapes


def test_analytic_profiles_scale_with_model_size_and_density():
    small = LatencyModel(analytic_profile(load_shapes("qwen2.5-0.5b"), "h100"))
    large = LatencyModel(analytic_profile(load_shapes("qwen2.5-3b"), "h100"))
    assert large.predict([8192], [0.3]) > 3 * small.predict([8192], [0.3])
    # Attention is quadratic: at 32K, dense costs far more than 10 % density.
    assert small.predict([32768], [1.0]) > 2 * small.predict([32768], [0.1])
    h200 = analytic_profile(load_shapes("qwen2.5-0.5b"), "h200")
    assert (
        h200.optimizer_seconds
        < analytic_profile(load_shapes("qwen2.5-0.5b"), "h100").optimizer_seconds
    )
    with pytest.raises(ValueError, match="analytic"):
        analytic_profile(load_shapes("tiny"), "tpu")


def test_cli_quick_profile_then_validate(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["profile", "--model", "tiny", "--quick", "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["wrote"] == str(out)
    profile = load_profile(out)
    assert profile.num_layers == load_shapes("tiny").num_layers
    assert profile.fingerprint["shapes"]["hidden_size"] == 256
    assert np.all(np.asarray(profile.attention.seconds) > 0)
    argv = ["profile", "--validate", str(out), "--num-batches", "2", "--max-tokens", "600",
            "--results-dir", str(tmp_path), "--json"]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["num_batches"] == 2 and result["mape"] >= 0
    assert all(b["measured"] > 0 and b["predicted"] > 0 for b in result["batches"])
    assert list(tmp_path.glob("*profile-validate-tiny-cpu.md"))


def test_cli_errors_are_clear(tmp_path, capsys):
    assert main(["profile", "--validate", str(tmp_path / "none.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "x.json").write_text("[]")
    assert main(["profile", "--validate", str(tmp_path / "x.json")]) == 2
    assert "not a SparseBalance profile" in capsys.readouterr().err
    assert main(["profile", "--model", "no-such-model"]) == 2
    assert "built-in" in capsys.readouterr().err


def test_default_model_is_measured_once_then_cached(tmp_path):
    shapes = load_shapes("tiny")
    first = default_latency_model(shapes, torch.device("cpu"), cache_dir=tmp_path)
    cached = list(tmp_path.glob("*.json"))
    assert len(cached) == 1
    mtime = cached[0].stat().st_mtime_ns
    second = default_latency_model(shapes, torch.device("cpu"), cache_dir=tmp_path)
    assert cached[0].stat().st_mtime_ns == mtime  # reused, not re-measured
    assert second.predict([500], [0.3]) == first.predict([500], [0.3])
