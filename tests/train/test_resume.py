"""Resume: the same run or a refusal listing the differences; the LR schedule follows a changed
``--steps`` from the first resumed step; metrics never hold a step twice; SIGTERM stops at a step
boundary with a checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import signal
from dataclasses import replace

import pytest
import torch

from sparsebalance.engine.runtime import Runtime
from sparsebalance.train import Trainer
from sparsebalance.train.signals import Stopped, StopSignals
from tests.train.harness import base_config, write_dataset

CPU1 = Runtime(0, 1, torch.device("cpu"))
pytestmark = [
    pytest.mark.timeout(900),  # real training steps: seconds alone, minutes on a loaded machine
    pytest.mark.filterwarnings("ignore::sparsebalance.latency.ProfileMismatchWarning"),
]


def _steps(run):
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if r["rank"] == "all"]


def test_resume_refuses_a_different_run_and_lists_the_differences(tmp_path):
    cfg = base_config(tmp_path, steps=1)
    Trainer(cfg, CPU1).run()
    resume = replace(cfg, resume=True)
    changes = [
        (dict(seed=1), "--seed 0 -> 1"),
        (dict(global_batch=4), "--global-batch 8 -> 4"),
        (dict(strategy="tokens", lr=1e-3), "--lr 0.003 -> 0.001; --strategy 'sab' -> 'tokens'"),
        (dict(block_size=64, tokenizer=None), "--block-size 32 -> 64"),
    ]
    for change, listed in changes:
        with pytest.raises(ValueError, match="belongs to a different run") as err:
            Trainer(replace(resume, **change), CPU1)
        assert listed in str(err.value)
    other = tmp_path / "other"
    other.mkdir()
    data = write_dataset(other)
    data.write_text(data.read_text().replace("4821", "9999"))  # same path shape, other content
    with pytest.raises(ValueError, match="data content"):
        Trainer(replace(resume, data=str(data)), CPU1)


def test_more_steps_on_resume_follow_the_new_schedule_and_metrics_are_cut_back(tmp_path, capsys):
    cfg = base_config(tmp_path, steps=3, checkpoint_every=1, schedule="cosine", warmup_steps=0)
    Trainer(cfg, CPU1).run()
    run = tmp_path / "run"
    # as if killed after step 3 was logged but before its checkpoint; a torn line at the end
    shutil.rmtree(run / "checkpoints" / "step-000003")
    (run / "checkpoints" / "latest").write_text("step-000002\n")
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "rank"')
    capsys.readouterr()
    trainer = Trainer(replace(cfg, resume=True, steps=4), CPU1)
    assert "resuming from step-000002 (--steps 3 -> 4)" in capsys.readouterr().err
    lr = trainer.optimizer.param_groups[0]["lr"]
    assert lr == pytest.approx(cfg.lr * 0.55)  # cosine at 2 of 4 steps; the old one gave 0.325
    result = trainer.run()
    assert result["steps"] == 4 and len(result["losses"]) == 2
    assert _steps(run) == [1, 2, 3, 4]  # step 3 once, the torn line gone


def test_sigterm_stops_at_the_step_boundary_with_a_checkpoint(tmp_path):
    cfg = base_config(tmp_path, steps=5)
    trainer = Trainer(cfg, CPU1)
    trainer.stops = StopSignals().install()
    run_step = trainer.run_step

    def step_then_signal():
        result = run_step()
        os.kill(os.getpid(), signal.SIGTERM)  # arrives mid-run: only a flag until the boundary
        return result

    trainer.run_step = step_then_signal
    try:
        with pytest.raises(Stopped, match="stopped by SIGTERM after step 1: checkpoint") as err:
            trainer.run()
    finally:
        trainer.stops.restore()
    assert err.value.exit_code == 143
    assert (tmp_path / "run" / "checkpoints" / "step-000001" / "checksums.json").is_file()
    assert _steps(tmp_path / "run") == [1]
