"""Checkpoints that cannot run code, carry a format version, are pruned, survive a full disk and
replace a same-step checkpoint only once the new one is in place (``train/checkpoint.py``,
``train/convert.py``)."""

from __future__ import annotations

import errno
import json
import os
import random

import numpy as np
import pytest
import torch

from sparsebalance.cli import main as cli_main
from sparsebalance.engine.runtime import rng_state, set_rng_state
from sparsebalance.train.checkpoint import (
    CHECKSUMS,
    CheckpointFormatError,
    clean_temporaries,
    find_checkpoint,
    load_checkpoint,
    load_state,
    save_checkpoint,
    sha256,
    verify_checkpoint,
)
from sparsebalance.train.convert import convert_checkpoint
from sparsebalance.train.convert import main as convert_main
from sparsebalance.versions import CHECKPOINT


def _model(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model, opt, sched


def _train(model, opt, sched):
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    sched.step()


def _save(run, step, keep_last=3):
    model, opt, sched = _model(step)
    _train(model, opt, sched)
    np.random.seed(step)
    save_checkpoint(
        run, step, model, opt, sched, {"step": step, "config": {"model": "m"}}, [rng_state()], True, keep_last=keep_last
    )
    return model, opt


def _resum(folder):
    names = sorted(p.name for p in folder.iterdir() if p.name != CHECKSUMS)
    (folder / CHECKSUMS).write_text(json.dumps({n: sha256(folder / n) for n in names}))


# ------------------------------------------------------------------ weights-only loading
class Payload:
    """What an attacker plants in a pickle: unpickling it runs code (here: writes a file)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_planted_pickle_is_refused_and_never_runs(tmp_path):
    _save(tmp_path, 1)
    ckpt = tmp_path / "checkpoints" / "step-000001"
    marker = tmp_path / "pwned"
    state = torch.load(ckpt / "state.pt", weights_only=True)
    state["trainer"]["extra"] = Payload(marker)
    torch.save(state, ckpt / "state.pt")
    _resum(ckpt)  # the attacker rewrites checksums.json too: they detect damage, not tampering
    path, _ = find_checkpoint(tmp_path)
    assert path == ckpt
    model, opt, sched = _model()
    with pytest.raises(ValueError, match=r"state\.pt: unreadable"):
        load_checkpoint(path, model, opt, sched)
    with pytest.raises(ValueError, match=r"state\.pt: unreadable"):
        load_state(path)  # what bench-e2e's prediction reads
    assert not marker.exists()


def test_every_file_loads_weights_only_and_restores_the_state(tmp_path):
    model, opt = _save(tmp_path, 2)
    expected = np.random.rand(4)  # numpy draws right after the saved state
    ckpt = tmp_path / "checkpoints" / "step-000002"
    for name in ("model.pt", "state.pt"):
        torch.load(ckpt / name, weights_only=True)
    fresh, fopt, fsched = _model(7)
    state = load_checkpoint(ckpt, fresh, fopt, fsched)
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["exp_avg"], fopt.state[b]["exp_avg"])
    assert fsched.last_epoch == 1
    np.random.seed(99)
    set_rng_state(state["rng"][0])
    assert np.array_equal(np.random.rand(4), expected)
    assert json.loads((ckpt / "meta.json").read_text())["schema_version"] == CHECKPOINT.version


# ------------------------------------------------------------------ format versions
def _format_1(run, step=3):
    """A checkpoint as SparseBalance wrote it before versions: numpy's RNG state pickled."""
    model, opt, sched = _model(step)
    _train(model, opt, sched)
    ckpt = run / "checkpoints" / f"step-{step:06d}"
    ckpt.mkdir(parents=True)
    np.random.seed(5)
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(), "cuda": None}
    torch.save(model.state_dict(), ckpt / "model.pt")
    trainer = {"step": step, "config": {"model": "m"}}
    state = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "rng": [rng], "trainer": trainer}
    torch.save(state, ckpt / "state.pt")
    (ckpt / "meta.json").write_text(json.dumps({"step": step, "model": "m", "config": {}}))
    _resum(ckpt)
    (run / "checkpoints" / "latest").write_text(ckpt.name + "\n")
    return model, opt, ckpt


def test_an_old_checkpoint_is_refused_in_one_line_then_converted(tmp_path, capsys):
    model, opt, ckpt = _format_1(tmp_path)
    with pytest.raises(CheckpointFormatError) as err:
        find_checkpoint(tmp_path)  # refused, not skipped for an older one
    line = str(err.value)
    assert "\n" not in line and "schema version 1" in line
    assert "python -m sparsebalance.train.convert" in line
    assert convert_main([str(tmp_path)]) == 0
    assert "converted" in capsys.readouterr().out
    assert convert_checkpoint(ckpt) is False  # already current
    path, notes = find_checkpoint(tmp_path)
    assert path == ckpt and notes == []
    fresh, fopt, fsched = _model(11)
    state = load_checkpoint(ckpt, fresh, fopt, fsched)
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["exp_avg_sq"], fopt.state[b]["exp_avg_sq"])
    np.random.seed(5)
    expected = np.random.rand(3)
    np.random.seed(0)
    set_rng_state(state["rng"][0])
    assert np.array_equal(np.random.rand(3), expected)
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["config_schema_version"] == 1  # what it was written under, not today's


def test_a_newer_checkpoint_says_upgrade(tmp_path):
    _save(tmp_path, 1)
    ckpt = tmp_path / "checkpoints" / "step-000001"
    meta = json.loads((ckpt / "meta.json").read_text())
    (ckpt / "meta.json").write_text(json.dumps({**meta, "schema_version": CHECKPOINT.version + 1}))
    _resum(ckpt)
    with pytest.raises(CheckpointFormatError, match=r"newer SparseBalance.*upgrade SparseBalance"):
        verify_checkpoint(ckpt)


def test_a_checkpoint_without_checksums_is_refused(tmp_path):
    _save(tmp_path, 1)
    (tmp_path / "checkpoints" / "step-000001" / CHECKSUMS).unlink()
    path, notes = find_checkpoint(tmp_path)
    assert path is None and "checksums.json: missing" in notes[0]


# ------------------------------------------------------------------ pruning, disk, replacement
def test_only_the_newest_checkpoints_are_kept(tmp_path):
    for step in range(1, 6):
        _save(tmp_path, step)
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert names == ["step-000003", "step-000004", "step-000005"]
    _save(tmp_path, 6, keep_last=0)  # 0 keeps every one
    assert len(list((tmp_path / "checkpoints").glob("step-*"))) == 4


def test_a_full_disk_is_one_line_and_leaves_nothing_half_written(tmp_path, monkeypatch):
    _save(tmp_path, 1)
    real = torch.save

    def full(obj, f, *a, **kw):
        real(obj, f, *a, **kw)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(ValueError, match="checkpoint step-000002: no space left in") as err:
        _save(tmp_path, 2)
    assert "\n" not in str(err.value) and "--resume" in str(err.value)
    monkeypatch.undo()
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001"]
    assert find_checkpoint(tmp_path)[0] == root / "step-000001"


def test_a_same_step_checkpoint_is_replaced_only_once_the_new_one_is_in_place(tmp_path, monkeypatch):
    _save(tmp_path, 1)
    root = tmp_path / "checkpoints"
    (root / "step-000001" / "from-the-first-save").write_text("x")
    real = os.replace

    def fail_to_install(src, dst):  # the new folder is complete, its rename fails
        if os.path.basename(src).startswith(".step-000001.tmp"):
            raise OSError(5, "EIO")
        real(src, dst)

    monkeypatch.setattr(os, "replace", fail_to_install)
    with pytest.raises(ValueError, match=r"could not be written .*EIO.*step-000001 is intact"):
        _save(tmp_path, 1)  # the rewrite fails: the old step-1 must still be there
    monkeypatch.undo()
    assert (root / "step-000001" / "from-the-first-save").is_file()
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001"]
    assert find_checkpoint(tmp_path)[0] == root / "step-000001"
    _save(tmp_path, 1)  # and a rewrite that succeeds replaces it
    assert not (root / "step-000001" / "from-the-first-save").exists()
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001"]


def test_stale_temporaries_are_cleaned_at_start(tmp_path):
    _save(tmp_path, 1)
    root = tmp_path / "checkpoints"
    (root / ".step-000002.tmp-123-abcd").mkdir()  # a kill during a save
    (root / ".step-000002.tmp").mkdir()  # an earlier version's name
    (root / ".step-000001.old-beef").mkdir()
    (root / "latest.tmp").write_text("x")
    removed = clean_temporaries(tmp_path)
    assert len(removed) == 4
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001"]


def test_the_cli_resume_of_an_old_run_is_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    _format_1(run)
    rc = cli_main(["train", "--nproc", "1", "--resume", "--out", str(run), "--steps", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert "schema version 1" in err[0] and "sparsebalance.train.convert" in err[0]


def test_files_and_folders_are_fsynced(tmp_path, monkeypatch):
    synced = []
    real_open, real_fsync = os.open, os.fsync
    names = {}

    def track_open(path, flags, *a, **k):
        fd = real_open(path, flags, *a, **k)
        names[fd] = os.path.basename(os.fspath(path)).split(".tmp-")[0]
        return fd

    def track_fsync(fd):
        synced.append(names.get(fd, "?"))
        real_fsync(fd)

    monkeypatch.setattr(os, "open", track_open)
    monkeypatch.setattr(os, "fsync", track_fsync)
    _save(tmp_path, 1)
    monkeypatch.undo()
    for name in ("model.pt", "state.pt", "meta.json", CHECKSUMS, ".step-000001", "latest", "checkpoints"):
        assert name in synced, (name, synced)
