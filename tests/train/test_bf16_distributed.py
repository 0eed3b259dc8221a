"""Issue 26, item 2: 2 gloo ranks train end to end under bf16 autocast (``torch.autocast("cpu")``,
float32 master weights), with CP units (``--strategy sab-cp``: the ring under autocast),
full activation checkpointing (the recomputation under the same autocast) and an exact resume.
Before the fix, layer 0 raised ``TypeError`` (float32 q/k from RoPE next to a bf16 v)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from tests.train.harness import base_config, rewind, run_ranks


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bf16_cp_units_checkpointing_and_resume_on_two_gloo_ranks(tmp_path):
    cfg = base_config(
        tmp_path,
        strategy="sab-cp",
        capacity=40,
        steps=3,
        checkpoint_every=2,
        precision="bf16",
        activation_checkpointing="full",
    )
    res = run_ranks(cfg, 2, tmp_path)
    losses = res[0]["losses"]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert res[0]["losses"] == res[1]["losses"] and res[0]["param_first"] == res[1]["param_first"]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    units = [u for x in lines if x["rank"] != "all" for u in x["units"]]
    assert any(u["degree"] == 2 for u in units)  # documents trained whole over the ring
    assert json.loads((tmp_path / "run" / "config.json").read_text())["precision"] == "bf16"

    resumed = tmp_path / "resumed"
    rewind(tmp_path / "run", resumed, step=2, drop=3)
    res2 = run_ranks(replace(cfg, out=str(resumed / "run"), resume=True), 2, resumed)
    assert res2[0]["losses"] == losses[2:]  # bit for bit under autocast too
    assert res2[0]["param_sum"] == res[0]["param_sum"]
