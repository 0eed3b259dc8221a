"""The real trainer running ``--strategy sab-cp`` plans on gloo processes: documents over the
capacity trained whole on CP units (no split below world x capacity, the ``--overlong`` policy
above it, counted), exact resume with CP units in the plans, FSDP2 with units that leave gaps."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from sparsebalance.engine.runtime import Runtime
from sparsebalance.train import TrainConfig, Trainer
from tests.train.harness import base_config, rewind, run_ranks

# The harness documents have 48, 60, 89 and 93 tokens: with a capacity of 40 every one of them
# needs k >= 2 ranks; on 2 ranks (80 tokens per unit at most) the 89- and 93-token ones are
# over world x capacity and --overlong split cuts them (counted).
CAPACITY = 40


def _lines(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_sab_cp_trains_long_documents_whole_and_resumes_bit_identically(tmp_path):
    cfg = base_config(tmp_path, strategy="sab-cp", capacity=CAPACITY, steps=4, checkpoint_every=2)
    res = run_ranks(cfg, 2, tmp_path)
    losses = res[0]["losses"]
    assert all(math.isfinite(x) for x in losses) and res[0]["losses"] == res[1]["losses"]
    assert res[0]["param_first"] == res[1]["param_first"]
    lines = _lines(tmp_path / "run")
    steps = [x for x in lines if x["rank"] == "all"]
    whole = [d for s in steps for d in s["cp_documents"]]
    assert whole and all(d["degree"] == 2 and d["ranks"] == [0, 1] for d in whole)
    assert all(d["tokens"] <= 2 * CAPACITY for d in whole)
    assert sum(s["num_split_chunks"] for s in steps) > 0  # 89/93 tokens > 2 x 40: split, counted
    # every rank reports its share of each unit: its shard's tokens (whole blocks of 32: at most
    # one block above ceil(tokens / k)), the unit's ranks
    per_rank = [x for x in lines if x["rank"] != "all"]
    cp = [u for x in per_rank for u in x["units"] if u["degree"] == 2]
    assert cp and all(0 < u["tokens"] < CAPACITY + cfg.block_size for u in cp)
    # the step's tokens are the batch's tokens once (a unit is not counted k times)
    for s in steps:
        assert s["tokens"] == sum(x["tokens"] for x in per_rank if x["step"] == s["step"])

    resumed = tmp_path / "resumed"
    run = rewind(tmp_path / "run", resumed, step=2, drop=4)
    res2 = run_ranks(replace(cfg, out=str(run), resume=True), 2, resumed)
    assert res2[0]["losses"] == losses[2:]  # bit for bit
    assert res2[0]["param_sum"] == res[0]["param_sum"]


@pytest.mark.distributed
@pytest.mark.slow  # 2 runs x 3 processes: minutes on 2 shared cores
@pytest.mark.timeout(900)
def test_fsdp2_runs_cp_units_that_leave_gaps_like_ddp(tmp_path):
    """3 ranks: units of 2 and 3 ranks, so a rank waits a pass (a filler) for its partners;
    FSDP2's per-pass all-gathers stay aligned and the arithmetic equals DDP's."""
    runs = {}
    for parallel in ("ddp", "fsdp2"):
        (tmp_path / parallel).mkdir()
        cfg = base_config(
            tmp_path / parallel, strategy="sab-cp", capacity=CAPACITY, steps=2, global_batch=6, parallel=parallel
        )
        runs[parallel] = run_ranks(cfg, 3, tmp_path / parallel)
    ddp, fsdp = runs["ddp"], runs["fsdp2"]
    assert fsdp[0]["losses"] == pytest.approx(ddp[0]["losses"], rel=1e-4)
    assert fsdp[0]["param_first"] == pytest.approx(ddp[0]["param_first"], rel=1e-3, abs=1e-5)
    steps = [x for x in _lines(tmp_path / "fsdp2" / "run") if x["rank"] == "all"]
    degrees = {d["degree"] for s in steps for d in s["cp_documents"]}
    assert degrees == {2, 3}, degrees


def test_sab_cp_refuses_emulated_ranks(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"TrainConfig.strategy='sab-cp' \(--strategy\) cannot run with "
        r"TrainConfig.emulate_ranks \(--emulate-ranks\)",
    ):
        TrainConfig(strategy="sab-cp", emulate_ranks=4, out=str(tmp_path / "run"))
    TrainConfig(strategy="sab", emulate_ranks=4, out=str(tmp_path / "run"))  # plans without units


def test_cp_k_is_checked_before_any_work(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"TrainConfig.cp \(--cp\) must be >= 2 and needs "
        r"TrainConfig.strategy='sab-cp' \(--strategy\)",
    ):
        TrainConfig(strategy="sab", cp=2, out=str(tmp_path / "run"))
    with pytest.raises(ValueError, match=r"TrainConfig.cp \(--cp\) must be >= 2"):
        TrainConfig(strategy="sab-cp", cp=1, out=str(tmp_path / "run"))
    cfg = TrainConfig(strategy="sab-cp", cp=2, out=str(tmp_path / "run"), device="cpu")
    with pytest.raises(ValueError, match=r"--cp 2 must divide the world size \(3\)"):
        Trainer(cfg, Runtime(0, 3, torch.device("cpu")))
