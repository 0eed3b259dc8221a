"""The real trainer on 2 gloo processes: learning, replica agreement, plans, exact resume."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from sparsebalance.latency import analytic_profile
from sparsebalance.models import load_shapes
from tests.train.harness import base_config, rewind, run_ranks

pytestmark = pytest.mark.distributed


def test_two_ranks_learn_and_stay_identical(tmp_path):
    cfg = base_config(tmp_path, steps=6, checkpoint_every=3)
    res = run_ranks(cfg, 2, tmp_path)
    losses = res[0]["losses"]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.8 * losses[0], losses  # a memorisable set: loss must fall
    assert res[0]["losses"] == res[1]["losses"]  # the global loss is all-reduced
    assert res[0]["param_first"] == res[1]["param_first"]
    assert res[0]["param_sum"] == pytest.approx(res[1]["param_sum"], rel=0, abs=0)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    per_rank = [x for x in lines if x["rank"] != "all"]
    steps = [x for x in lines if x["rank"] == "all"]
    assert {(x["step"], x["rank"]) for x in per_rank} == {(s, r) for s in range(1, 7) for r in (0, 1)}
    assert all(len(s["plan_hash"]) == 16 for s in steps)
    assert all(0 <= x["budget_min"] <= x["budget_max"] for x in per_rank)
    assert all(x["compute_s"] > 0 and x["bubble_s"] >= 0 for x in per_rank)
    # Resume from the step-3 checkpoint: the remaining losses equal the uninterrupted run's.
    resumed = tmp_path / "resumed"
    rewind(tmp_path / "run", resumed, step=3, drop=6)  # resume takes the newest
    cfg2 = replace(cfg, out=str(resumed / "run"), resume=True)
    res2 = run_ranks(cfg2, 2, resumed)
    assert res2[0]["losses"] == pytest.approx(losses[3:], rel=1e-6, abs=1e-6)
    assert res2[0]["param_sum"] == pytest.approx(res[0]["param_sum"], rel=1e-6)


@pytest.mark.slow
def test_fsdp2_matches_ddp(tmp_path):
    """FSDP2 (fully_shard) and the DDP path do the same arithmetic: same losses, same weights."""
    ddp_dir, fsdp_dir = tmp_path / "ddp", tmp_path / "fsdp"
    ddp_dir.mkdir()
    fsdp_dir.mkdir()
    cfg = base_config(ddp_dir, steps=3)  # gradient clipping on (the default)
    ddp = run_ranks(cfg, 2, ddp_dir)
    fsdp = run_ranks(replace(cfg, parallel="fsdp2", out=str(fsdp_dir / "run")), 2, fsdp_dir)
    assert fsdp[0]["losses"] == pytest.approx(ddp[0]["losses"], rel=1e-4)
    assert fsdp[0]["param_first"] == pytest.approx(ddp[0]["param_first"], rel=1e-3, abs=1e-5)
    assert fsdp[0]["param_first"] == fsdp[1]["param_first"]


@pytest.mark.slow
def test_overlapped_sync_matches_exact_mode(tmp_path):
    """DDP's reducer overlapping the last backward (``no_sync`` before it) and the barrier +
    separate all-reduce give the same weights: on 2 ranks bit for bit (halving is exact)."""
    runs = {}
    for mode in ("exact", "overlap"):
        (tmp_path / mode).mkdir()
        cfg = base_config(tmp_path / mode, steps=3, capacity=96, measure_bubble=mode)
        runs[mode] = run_ranks(cfg, 2, tmp_path / mode)
    exact, overlap = runs["exact"], runs["overlap"]
    assert overlap[0]["losses"] == exact[0]["losses"]
    assert overlap[0]["param_first"] == exact[0]["param_first"]
    assert overlap[0]["param_sum"] == exact[0]["param_sum"] == overlap[1]["param_sum"]
    lines = [json.loads(x) for x in (tmp_path / "overlap" / "run" / "metrics.jsonl").open()]
    per_rank = [x for x in lines if x["rank"] != "all"]
    counts = {(x["step"], x["rank"]): len(x["microbatch_s"]) for x in per_rank}
    assert max(counts.values()) >= 2  # gradient accumulation under no_sync was exercised
    assert all(x["bubble_s"] >= 0 and x["sync_s"] >= 0 for x in per_rank)
    assert min(x["bubble_s"] for x in per_rank if x["step"] == 1) == 0.0  # the slowest rank


def test_fsdp2_wraps_a_llama_model(tmp_path):
    """FSDP2 finds a Llama model's decoder layers through ``_no_split_modules`` and trains it."""
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 32,
                "intermediate_size": 128,
                "vocab_size": 512,
                "max_position_embeddings": 1024,
            }
        )
    )
    profile = tmp_path / "llama-profile.json"  # the harness's is the tiny model's: refused
    analytic_profile(load_shapes(str(llama)), "h100", block_size=32).save(profile)
    cfg = base_config(tmp_path, steps=2, model=str(llama), parallel="fsdp2", profile=str(profile))
    res = run_ranks(cfg, 2, tmp_path)
    assert all(math.isfinite(x) for x in res[0]["losses"])
    assert res[0]["losses"] == res[1]["losses"]
    assert res[0]["param_first"] == res[1]["param_first"]
