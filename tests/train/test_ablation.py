"""The one ablation table: names -> planner + DST mode (shared with the simulator), and the
measured comparison table of ``report`` / ``train --demo`` / ``bench-e2e``."""

from __future__ import annotations

import pytest

from sparsebalance.report import comparison_table
from sparsebalance.simulate import ABLATIONS
from sparsebalance.train import TrainConfig
from sparsebalance.train.ablation import ABLATION, ablation_configs


def test_ablation_configs_follow_the_simulator_table(tmp_path):
    cfg = TrainConfig(out=str(tmp_path))
    configs = ablation_configs(cfg, ["sab+dst", *ABLATION, "sab+dst@max"])
    assert list(configs) == ["baseline", "sab+dst", "sab", "dst", "sab+dst@max"]
    for name, c in configs.items():
        assert (c.strategy, c.dst.mode) == (ABLATIONS[name].planner, ABLATIONS[name].dst_mode)
        assert c.out == str(tmp_path / name.replace("+", "_")) and c.overwrite
    assert configs["sab+dst@max"].dst.anchor == "max"
    assert configs["sab+dst"].dst.anchor == cfg.dst.anchor
    with pytest.raises(ValueError, match="--strategies: unknown"):
        ablation_configs(cfg, ["fast"])


def _summary(step, compute, loss=1.0):
    return {
        "steps": 5,
        "mean_step_s": step,
        "mean_max_compute_s": compute,
        "efficiency": 0.9,
        "bubble_fraction": 0.1,
        "mean_density": 0.5,
        "tokens_per_s": 1.0,
        "final_loss": loss,
    }


def test_comparison_table_measured_and_predicted():
    runs = {"baseline": _summary(2.0, 1.6), "sab": _summary(1.0, 0.8)}
    table, out = comparison_table(runs)
    assert out["sab"]["speedup"] == 2.0 and out["sab"]["compute_speedup"] == 2.0
    assert out["baseline"]["speedup"] == 1.0 and "predicted speedup" not in table
    predicted = {
        "baseline": {"step_seconds": 1.6, "speedup": 1.0},
        "sab": {"step_seconds": 1.0, "speedup": 1.6, "mean_density": 0.4},
    }
    table, out = comparison_table(runs, "baseline", predicted)
    assert out["sab"]["prediction_error"] == pytest.approx(1.0 / 0.8 - 1)
    assert out["sab"]["predicted_density"] == 0.4 and out["baseline"]["predicted_density"] is None
    assert "predicted speedup" in table and "+25 %" in table
    assert table.count("\n") == 3  # header, rule, two rows


def test_demo_runs_come_from_the_same_table(tmp_path):
    from sparsebalance.train.demo import demo_configs

    cfg = TrainConfig(out=str(tmp_path))
    runs = demo_configs(cfg)
    assert list(runs) == ["baseline", "sparsebalance"]
    assert (runs["baseline"].strategy, runs["baseline"].dst.mode) == ("sequential", "off")
    assert (runs["sparsebalance"].strategy, runs["sparsebalance"].dst.mode) == (
        "sab-cp",
        "bidirectional",
    )
    assert runs["sparsebalance"].out == str(tmp_path / "sparsebalance")
    assert all(r.overwrite and r.seed == cfg.seed for r in runs.values())


def test_hybrid_rows_are_priced_by_the_simulator_with_long_documents_whole():
    import numpy as np

    from sparsebalance.simulate import simulate_steps
    from sparsebalance.train.ablation import HYBRID
    from tests.batching.fake_cost import fake_context

    cfg = TrainConfig(out="unused")
    configs = ablation_configs(cfg, ["sab", *HYBRID])
    assert [configs[n].strategy for n in HYBRID] == ["sab-cp", "sab-cp"]
    assert [configs[n].dst.mode for n in HYBRID] == ["off", "bidirectional"]
    rng = np.random.default_rng(1)
    lengths = np.array([*rng.integers(100, 900, 11), 3000])  # one document ~3x the capacity
    batch = (lengths, rng.uniform(0.3, 1.0, lengths.size))
    out = simulate_steps(
        [batch], 4, fake_context(), capacity=1024, overlong="split", strategies=["sab", *HYBRID], block_size=128
    )
    rows = out["strategies"]
    assert rows["sab"]["split_documents"] == 0  # sab cut it into --overlong chunks instead
    assert all(rows[n]["split_documents"] == 1 for n in HYBRID)  # trained whole over a CP unit
    assert all(rows[n]["step_seconds"] > 0 for n in ("sab", *HYBRID))
    with pytest.raises(ValueError, match="--overlong"):
        simulate_steps([batch], 4, fake_context(), capacity=1024, overlong="cut", block_size=128)


def test_demo_defaults_make_the_longest_builtin_document_longer_than_the_capacity(tmp_path):
    from sparsebalance.cli import build_parser
    from sparsebalance.train import config_from_args
    from sparsebalance.train.demo import DEMO_CPU_RANKS, DEMO_DEFAULTS
    from sparsebalance.train.launch import default_nproc

    parser = build_parser()
    demo = config_from_args(parser.parse_args(["train", "--demo"]), DEMO_DEFAULTS)
    assert demo.capacity == 2100 and demo.overlong == "split"
    assert -(-4103 // demo.capacity) == 2  # the built-in set's longest document needs both ranks
    mine = parser.parse_args(["train", "--demo", "--capacity", "2048"])
    assert config_from_args(mine, DEMO_DEFAULTS).capacity == 2048  # a flag still wins
    assert config_from_args(parser.parse_args(["train"])).capacity == 4096  # train unchanged
    cpu = TrainConfig(out=str(tmp_path), device="cpu")
    assert default_nproc(cpu, None, DEMO_CPU_RANKS) == 2 and default_nproc(cpu, None) == 2
