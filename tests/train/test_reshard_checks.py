"""What a resume on another grid still refuses, and what it says (issue 54), fast and
single-process: another ``--pp`` or ``--nproc`` is not another run, but anything that changes
the maths or the data order still is, in one line, before launch; a pipeline checkpoint of
format 2 is not resharded; the Python API resumes on another world size and says what changes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from sparsebalance.engine.runtime import Runtime
from sparsebalance.train import TrainConfig, resume
from sparsebalance.train.checkpoint import save_checkpoint
from sparsebalance.train.config_io import to_dict
from sparsebalance.train.launch import preflight
from sparsebalance.tuning import DSTConfig
from tests.train.harness import base_config

CPU1 = Runtime(0, 1, torch.device("cpu"))
OFF = DSTConfig(mode="off", budget="gamma", gamma0=0.9)


def _saved(tmp: Path, ranks: int = 2, **over) -> tuple[TrainConfig, Path]:
    """A run's config and its step-2 checkpoint saved by ``ranks`` ranks (a stand-in model:
    nothing here loads it)."""
    cfg = base_config(tmp, **{"steps": 3, "strategy": "sab", "dst": OFF, **over})
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    rngs = [{"torch": torch.get_rng_state()} for _ in range(ranks)]
    state = {"step": 2, "config": to_dict(cfg)}
    save_checkpoint(Path(cfg.out), 2, model, opt, sched, state, rngs, True, keep_last=0)
    return replace(cfg, resume=True), Path(cfg.out) / "checkpoints" / "step-000002"


def test_another_pp_is_the_same_run_but_the_global_batch_is_not(tmp_path):
    cfg, path = _saved(tmp_path, pp=2)
    assert resume.check_same_run(path, replace(cfg, pp=1), None) == ["--pp 2 -> 1"]  # said, allowed
    with pytest.raises(ValueError) as err:  # the launcher: before anything starts
        preflight(replace(cfg, pp=1, global_batch=4, seed=1), 1)
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith(f"--resume: {path} belongs to a different run (--global-batch 8 -> 4; --seed 0 -> 1)")
    assert "--pp, --pp-virtual" in line  # among those that may change


def test_a_pipeline_checkpoint_of_format_2_is_not_resharded(tmp_path):
    """Format 2 held the whole model in ``model.pt`` and the stages' optimizer states as a list:
    another split is refused before launch in one line that says how to get a format-3 one;
    another ``--nproc`` on its own split is not (every pipeline's stage s takes stage s's part)."""
    cfg, path = _saved(tmp_path, pp=2)
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, "schema_version": 2}))
    with pytest.raises(ValueError) as err:
        preflight(replace(cfg, pp=1), 1)
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith(
        "--resume: checkpoints/step-000002 is a --pp 2 checkpoint of format 2 (the whole model in model.pt, "
    ), line
    assert "not resharded: resume it with --pp 2 once" in line
    assert resume.check_grid(path, cfg, 4).startswith(
        "--resume: checkpoints/step-000002 was saved by --pp 2 x 1 pipeline (2 ranks) and resumes as --pp 2 x 2 "
        "pipelines (4 ranks): parameters and optimizer state as saved"
    )


def test_the_python_api_resumes_on_another_world_size_and_says_what_changes(tmp_path):
    """``Trainer(cfg, runtime)`` resumes through rank 0's :func:`choose_checkpoint`: a world of 1
    from a checkpoint of 2 ranks (refused before: each rank restored its own RNG state) now
    resumes, and its lines say so; on the saved grid nothing more is said."""
    cfg, path = _saved(tmp_path, ranks=2)
    got, lines = resume.choose_checkpoint(Path(cfg.out), cfg, None, CPU1)
    assert got == path and lines[0] == "resuming from step-000002"
    assert lines[1] == (
        "--resume: checkpoints/step-000002 was saved by --pp 1 x 2 pipelines (2 ranks) and resumes as --pp 1 x 1 "
        "pipeline (1 rank): parameters and optimizer state as saved (every pipeline loads the same); rank r "
        "restores the RNG state saved by rank r mod 2; step, data position, LR schedule and latency calibration "
        "kept; the plans are made for 1 pipeline of 1 stage: the losses follow an uninterrupted run's up to "
        "rounding with --dst-mode off (another summation order), and with DST on its budgets follow the new plans"
    )
    (tmp_path / "one").mkdir()
    _, path = _saved(tmp_path / "one", ranks=1)
    assert resume.check_grid(path, cfg, 1) is None
