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
    measure,
)
from sparsebalance.models import load_shapes


def test_analytic_profiles_scale_with_model_size_and_density():
    small = LatencyModel(analytic_profile(load_shapes("qwen2.5-0.5b"), "h100", block_size=128))
    large = LatencyModel(analytic_profile(load_shapes("qwen2.5-3b"), "h100", block_size=128))
    assert large.predict([8192], [0.3]) > 3 * small.predict([8192], [0.3])
    # Attention is quadratic: at 32K, dense costs far more than 10 % density.
    assert small.predict([32768], [1.0]) > 2 * small.predict([32768], [0.1])
    h200 = analytic_profile(load_shapes("qwen2.5-0.5b"), "h200", block_size=128)
    assert (
        h200.optimizer_seconds < analytic_profile(load_shapes("qwen2.5-0.5b"), "h100", block_size=128).optimizer_seconds
    )
    with pytest.raises(ValueError, match="analytic"):
        analytic_profile(load_shapes("tiny"), "tpu", block_size=128)


def test_cli_quick_profile_then_validate(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    out = tmp_path / "p.json"
    argv = ["profile", "--model", "tiny", "--quick", "--max-len", "384", "--out", str(out), "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert summary["wrote"] == str(out)
    assert "timing noise" in captured.err  # the one-line noise report
    profile = load_profile(out)
    assert profile.num_layers == load_shapes("tiny").num_layers
    assert profile.fingerprint["shapes"]["hidden_size"] == 256
    assert np.all(np.asarray(profile.attention.seconds) > 0)
    assert len(profile.fit["coefficients"]) == 5 and min(profile.fit["coefficients"]) >= 0
    assert profile.noise["rounds"] >= 2 and profile.noise["cv_median"] >= 0
    assert max(max(p["lengths"]) for p in profile.fit["design"]) <= 384
    # every timing of every design point is kept; the median of them is the fitted time
    rounds = profile.noise["rounds"]
    assert 3 <= rounds <= measure.MAX_ROUNDS  # --rounds 3 at least, more while the budget lasts
    for point in profile.fit["design"]:
        assert len(point["rounds"]) == rounds
        assert point["seconds"] == pytest.approx(float(np.median(point["rounds"])))
    argv = ["profile", "--validate", str(out), "--num-batches", "3", "--rounds", "2", "--json"]
    before = set(tmp_path.rglob("*"))
    assert main(argv) == 0
    assert set(tmp_path.rglob("*")) == before  # --validate writes nothing where it runs
    result = json.loads(capsys.readouterr().out)
    assert result["num_batches"] == 3 and result["mape"] >= 0
    assert result["threads"] == profile.fingerprint["threads"] == 1  # a rank's, then the same
    assert result["mape_ci95"][0] <= result["mape"] <= result["mape_ci95"][1]
    assert result["shape_mape"] >= 0 and result["shape_max_error"] >= result["shape_mape"]
    assert all(b["measured"] > 0 and b["predicted"] > 0 for b in result["batches"])
    assert all(sum(b["lengths"]) <= 512 for b in result["batches"])  # the profile's max length
    assert set(result["breakdown"]["component_error"]) == {"attention", "per_token", "overhead"}
    assert not list(tmp_path.rglob("*profile-validate*"))  # no results file unless asked
    argv += ["--results-dir", str(tmp_path / "res")]
    assert main(argv) == 0
    capsys.readouterr()
    assert list((tmp_path / "res").glob("*profile-validate-tiny-cpu.md"))


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
    cpu = torch.device("cpu")
    first = default_latency_model(shapes, cpu, cache_dir=tmp_path, max_len=384, budget_s=3, block_size=64)
    cached = list(tmp_path.glob("*.json"))
    assert len(cached) == 1
    mtime = cached[0].stat().st_mtime_ns
    second = default_latency_model(shapes, cpu, cache_dir=tmp_path, max_len=384, budget_s=3, block_size=64)
    assert cached[0].stat().st_mtime_ns == mtime  # reused, not re-measured
    assert second.predict([300], [0.3]) == first.predict([300], [0.3])
    # The cache key carries the schema: profiles of the old interpolated-grid schema (1) are
    # re-measured, not reused.
    assert first.profile.fingerprint["schema"] == "sparsebalance.profile/3"
