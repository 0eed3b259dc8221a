"""Issue 54, item 4, on real gloo processes: in a PP2 run with DST on, both stages hold the same
ledger of their pipeline's rank (replayed from the shared plan), and each stage chose, for every
one of its layers, exactly what that ledger (one process deciding every layer) allots: with the
coverage bound off (p = 1) no stage spends beyond it."""

from __future__ import annotations

import numpy as np
import pytest

from sparsebalance.train import Trainer
from sparsebalance.tuning import DSTConfig
from tests.train.harness import base_config, run_trainers


def _ledger_body(trainer: Trainer, rank: int) -> dict:
    trainer.run_step()
    dp = trainer.stage.layout.dp
    ctl = trainer.engine._layers[-1].solo.get(dp)
    if ctl is None:
        return {"controller": False}
    ledger = ctl._ledger()
    records = ctl.records  # the stage's units, in its decision order (micro-batch, layer)
    return {
        "controller": True,
        "stage_of": ctl._stage_of.tolist(),
        "layers": sorted({r.layer for r in records}),
        "cost": ledger.cost.tolist(),
        "left": ledger.left.tolist(),
        "mine": [ledger.cost[r.microbatch, r.layer] == r.predicted_seconds for r in records],
        "budgets": sorted({r.budget for r in records}),
    }


@pytest.mark.distributed
def test_both_stages_decide_from_the_ranks_ledger(tmp_path):
    cfg = base_config(tmp_path, steps=1, pp=2, strategy="sab", dst=DSTConfig(budget_tokens=32, p=1.0))
    results = run_trainers(_ledger_body, cfg, 2, tmp_path, "ledger")
    assert all(r["controller"] for r in results)
    first, last = results
    assert first["stage_of"] == last["stage_of"] and sorted(set(first["stage_of"])) == [0, 1]
    np.testing.assert_array_equal(first["cost"], last["cost"])  # one ledger, replayed on each stage
    np.testing.assert_array_equal(first["left"], last["left"])
    for r, s in zip(results, (0, 1), strict=True):
        assert r["layers"] == [i for i, st in enumerate(r["stage_of"]) if st == s]  # its own layers only
        assert r["mine"] and all(r["mine"]), r["mine"]
