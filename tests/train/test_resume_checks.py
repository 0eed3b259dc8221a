"""What ``--resume`` checks of a checkpoint (issue 45), fast and single-process: the world size it
was saved with (another one resumes and is said, issue 54; also through the Python API, rank 0's
:func:`choose_checkpoint`), a damaged ``meta.json`` passed over for the checkpoint before it by
the launcher's cheap look as by rank 0, and a run that prunes while another command looks for its newest checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from sparsebalance.engine.runtime import Runtime
from sparsebalance.train import TrainConfig, resume
from sparsebalance.train import checkpoint as ckpt
from sparsebalance.train.checkpoint import CHECKSUMS, find_checkpoint, save_checkpoint, sha256
from sparsebalance.train.config_io import to_dict

CPU1 = Runtime(0, 1, torch.device("cpu"))


def _save(run: Path, step: int, ranks: int = 2) -> Path:
    cfg = TrainConfig(out=str(run), steps=10)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    rngs = [{"torch": torch.get_rng_state()} for _ in range(ranks)]
    save_checkpoint(run, step, model, opt, sched, {"step": step, "config": to_dict(cfg)}, rngs, True, keep_last=0)
    return run / "checkpoints" / f"step-{step:06d}"


def _without_world_size(path: Path) -> None:
    """``path`` as a checkpoint written before ``meta.json`` recorded its ranks."""
    meta = json.loads((path / "meta.json").read_text())
    del meta["world_size"]
    (path / "meta.json").write_text(json.dumps(meta))
    sums = json.loads((path / CHECKSUMS).read_text())
    (path / CHECKSUMS).write_text(json.dumps({**sums, "meta.json": sha256(path / "meta.json")}))


def test_the_world_size_is_saved_and_read_back(tmp_path):
    path = _save(tmp_path, 4, ranks=3)
    assert json.loads((path / "meta.json").read_text())["world_size"] == 3
    assert resume.saved_world_size(path) == 3
    _without_world_size(path)  # an older checkpoint: the length of state.pt's RNG list
    assert resume.saved_world_size(path) == 3
    assert find_checkpoint(tmp_path) == (path, [])  # still intact


def test_another_world_size_is_said_in_one_line(tmp_path):
    """Issue 54: another world size resumes (rank r takes saved rank r mod N's RNG state,
    :mod:`sparsebalance.train.reshard`); what that changes is one line, nothing on the saved one."""
    path = _save(tmp_path, 4, ranks=2)
    cfg = TrainConfig(out=str(tmp_path), steps=10, resume=True)
    assert resume.check_grid(path, cfg, 2) is None
    line = resume.check_grid(path, cfg, 4)
    assert "\n" not in line
    for part in (
        "checkpoints/step-000004 was saved by --pp 1 x 2 pipelines (2 ranks)",
        "resumes as --pp 1 x 4 pipelines (4 ranks)",
        "rank r restores the RNG state saved by rank r mod 2",
    ):
        assert part in line, line


def test_the_python_api_resumes_on_another_world_size(tmp_path):
    """``Trainer(cfg, runtime)`` resumes through :func:`choose_checkpoint` on rank 0: a world of
    1 from a checkpoint of 2 ranks (it died with ``IndexError`` in ``trainer.py`` at
    ``state["rng"][rank]``, then was refused) resumes, and rank 0's lines say what changes."""
    _save(tmp_path, 4, ranks=2)
    cfg = TrainConfig(out=str(tmp_path), steps=10, resume=True)
    _, lines = resume.choose_checkpoint(tmp_path, cfg, None, CPU1)
    assert "saved by --pp 1 x 2 pipelines (2 ranks) and resumes as --pp 1 x 1 pipeline (1 rank)" in lines[-1]


def test_a_truncated_meta_json_falls_back_to_the_checkpoint_before(tmp_path):
    _save(tmp_path, 1, ranks=1)
    newest = _save(tmp_path, 2, ranks=1)
    meta = newest / "meta.json"
    meta.write_bytes(meta.read_bytes()[:40])
    want = tmp_path / "checkpoints" / "step-000001"
    for verify in (False, True):  # the launcher's cheap look, rank 0's hashing one
        path, notes = find_checkpoint(tmp_path, verify=verify)
        assert path == want, verify
        assert notes == [f"checkpoint {meta}: unreadable; resuming from step-000001 instead"]
    cfg = TrainConfig(out=str(tmp_path), steps=10, resume=True)
    path, lines = resume.choose_checkpoint(tmp_path, cfg, None, CPU1)
    assert path == want and lines[0].startswith(f"checkpoint {meta}: unreadable; resuming from")


def test_the_cheap_look_checks_everything_but_the_hashes(tmp_path):
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    (newest / CHECKSUMS).unlink()
    path, notes = find_checkpoint(tmp_path, verify=False)
    assert path.name == "step-000001" and "checksums.json: missing" in notes[0]
    _save(tmp_path, 3)
    data = (tmp_path / "checkpoints" / "step-000003" / "model.pt").read_bytes()
    (tmp_path / "checkpoints" / "step-000003" / "model.pt").write_bytes(data[:-1] + b"x")
    assert find_checkpoint(tmp_path, verify=False)[0].name == "step-000003"  # not hashed
    assert find_checkpoint(tmp_path)[0].name == "step-000001"


def test_a_checkpoint_pruned_while_looking_is_not_called_damaged(tmp_path, monkeypatch):
    """``eval`` of a run that is training: the run saves step 3 and prunes step 2 (keeping 1)
    while the look verifies step 2. It said "no intact checkpoint" (step 2 missing); it looks
    again and finds step 3."""
    _save(tmp_path, 2)
    real = ckpt.verify_checkpoint
    saved = []

    def verify_while_the_run_saves(path, *args, **kwargs):
        if not saved:  # the run's next save lands now, and prunes what this look is reading
            saved.append(_save(tmp_path, 3))
            ckpt.prune_checkpoints(tmp_path / "checkpoints", 3, 1)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(ckpt, "verify_checkpoint", verify_while_the_run_saves)
    assert find_checkpoint(tmp_path, ("model.pt",)) == (saved[0], [])


def test_strategy_auto_keeps_what_it_chose_when_the_run_started(tmp_path):
    """``--strategy auto`` on resume: a run that trained with ``sab`` (a pipeline's) resumed on
    ``--pp 1`` over 2 ranks stays ``sab`` (auto alone would choose ``sab-cp``, and the resume
    would be refused for a flag never given); without a checkpoint auto chooses as before; a
    ``sab-cp`` run resumed as a pipeline cannot keep it (the resume's check says so)."""
    import json as _json
    from dataclasses import replace as _replace

    from sparsebalance.train.config import resolve_strategy
    from tests.train.harness import base_config

    cfg = _replace(base_config(tmp_path, steps=3), strategy="auto")
    assert resolve_strategy(cfg, 2).strategy == "sab-cp"
    folder = tmp_path / "run" / "checkpoints" / "step-000002"
    folder.mkdir(parents=True)
    (folder / "meta.json").write_text(_json.dumps({"config": {"strategy": "sab"}}))
    resumed = _replace(cfg, out=str(tmp_path / "run"), resume=True)
    assert resolve_strategy(resumed, 2).strategy == "sab"
    assert resolve_strategy(_replace(cfg, out=str(tmp_path / "run")), 2).strategy == "sab-cp"  # not resuming
    (folder / "meta.json").write_text(_json.dumps({"config": {"strategy": "sab-cp"}}))
    assert resolve_strategy(_replace(resumed, pp=2), 2).strategy == "sab"
