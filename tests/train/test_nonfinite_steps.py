"""Issue 36, item 1: non-finite values are a step-level matter. A step whose loss or gradients are
NaN/inf is skipped (nothing applied: no optimizer step, gradients dropped), said in one line and
counted in the step's metrics; more than ``--max-nonfinite-steps`` in a row stop the run."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sparsebalance.engine.execute import RankExecutor
from sparsebalance.engine.runtime import Runtime
from sparsebalance.engine.step import NonFiniteLoss
from sparsebalance.train import Trainer
from tests.train.harness import base_config

CPU1 = Runtime(0, 1, torch.device("cpu"))
pytestmark = pytest.mark.filterwarnings("ignore::sparsebalance.latency.ProfileMismatchWarning")


def _poison_gradients_at(monkeypatch, bad_steps: set[int]):
    """The backward of every micro-batch of the listed steps leaves a NaN in one gradient."""
    seen = {"step": 0}
    original = RankExecutor.run

    def run(self, step, rank, origin=None, ahead=None):
        seen["step"] += rank == 0
        work = original(self, step, rank, origin, ahead)
        if seen["step"] in bad_steps:
            p = next(p for p in self.par.model.parameters() if p.grad is not None)
            p.grad.view(-1)[0] = math.nan
        return work

    monkeypatch.setattr(RankExecutor, "run", run)


def test_a_step_with_nan_gradients_is_skipped_counted_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    _poison_gradients_at(monkeypatch, {2})
    cfg = base_config(tmp_path, steps=3)
    trainer = Trainer(cfg, CPU1)
    trainer.run()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    summary = [x for x in lines if x.get("rank") == "all"]
    assert [s["skipped_nonfinite"] for s in summary] == [False, True, False]
    # two optimizer steps were applied, not three
    state = trainer.optimizer.state[next(iter(trainer.optimizer.state))]
    assert int(state["step"]) == 2
    assert all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())
    err = capsys.readouterr().err
    assert "step 2: non-finite gradients" in err and "nothing applied" in err


def test_more_non_finite_steps_in_a_row_than_allowed_stop_the_run(tmp_path, monkeypatch):
    _poison_gradients_at(monkeypatch, {2, 3})
    cfg = base_config(tmp_path, steps=4, max_nonfinite_steps=1)
    trainer = Trainer(cfg, CPU1)
    with pytest.raises(NonFiniteLoss, match=r"step 3.*2 non-finite step\(s\) in a row"):
        trainer.run()
    state = trainer.optimizer.state[next(iter(trainer.optimizer.state))]
    assert int(state["step"]) == 1  # neither bad step was applied


def test_max_nonfinite_steps_is_checked():
    from sparsebalance.train import TrainConfig

    with pytest.raises(ValueError, match="max-nonfinite-steps"):
        TrainConfig(max_nonfinite_steps=-1)
