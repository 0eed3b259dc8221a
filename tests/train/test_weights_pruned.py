"""Issue 45 (weak): ``eval`` of a run that is still training, which saves a checkpoint and
prunes the oldest between ``eval``'s look and its read, reads the newer checkpoint instead of
blaming the pruned one (it said "give its base model with --base", a vocab-map message or
"model.pt: missing"); pruned at every look, it says so in one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from sparsebalance.train import weights
from sparsebalance.train.checkpoint import CHECKSUMS, sha256
from sparsebalance.versions import CHECKPOINT

VOCAB = {"151643": 1, "7": 2}


def _save(run, step: int):
    """A checkpoint of the tiny model (seed = step) as eval reads it, and ``latest`` naming it."""
    from sparsebalance.models.hf import build_model

    ckpt = run / "checkpoints" / f"step-{step:06d}"
    ckpt.mkdir(parents=True)
    torch.save(build_model("tiny", seed=step).state_dict(), ckpt / "model.pt")
    meta = {"step": step, "model": "tiny", "schema_version": CHECKPOINT.version}
    (ckpt / "meta.json").write_text(json.dumps(meta))
    (ckpt / "vocab_map.json").write_text(json.dumps(VOCAB))
    sums = {n: sha256(ckpt / n) for n in ("model.pt", "meta.json", "vocab_map.json")}
    (ckpt / CHECKSUMS).write_text(json.dumps(sums))
    (run / "checkpoints" / "latest").write_text(ckpt.name + "\n")
    return ckpt


class _TrainingRun:
    """Right after each of eval's looks, the run saves the next step and prunes the one found
    (``--keep-checkpoints 1``), ``times`` times."""

    def __init__(self, run, times: int):
        self.run, self.times, self.step = run, times, 2
        self.real = weights.find_checkpoint

    def __call__(self, *args, **kwargs):
        found = self.real(*args, **kwargs)
        if self.times > 0 and found[0] is not None:
            self.times -= 1
            self.step += 1
            _save(self.run, self.step)
            shutil.rmtree(found[0])
        return found


def _params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.state_dict().values()])


def test_a_checkpoint_pruned_between_the_look_and_the_read_is_replaced_by_the_newer(tmp_path, monkeypatch):
    from sparsebalance.models.hf import build_model

    run = tmp_path / "run"
    _save(run, 1)
    _save(run, 2)
    monkeypatch.setattr(weights, "find_checkpoint", _TrainingRun(run, times=1))
    model, vmap = weights.load_trained_model(str(run))
    assert torch.equal(_params(model), _params(build_model("tiny", seed=3)))  # the newer one
    assert vmap == {151643: 1, 7: 2}


def test_a_run_that_prunes_at_every_look_is_one_line_saying_retry(tmp_path, monkeypatch):
    run = tmp_path / "run"
    _save(run, 2)
    monkeypatch.setattr(weights, "find_checkpoint", _TrainingRun(run, times=100))
    with pytest.raises(ValueError) as err:
        weights.load_trained_model(str(run))
    line = str(err.value)
    assert line.startswith(f"--model {run}: its newest checkpoint was pruned while it was read"), line
    assert line.endswith(": retry") and "\n" not in line


def test_a_named_checkpoint_removed_while_read_says_so(tmp_path, monkeypatch):
    run = tmp_path / "run"
    ckpt = _save(run, 2)
    real = weights.load_weights

    def pruned_meanwhile(path, device="cpu"):
        shutil.rmtree(path)
        return real(path, device)

    monkeypatch.setattr(weights, "load_weights", pruned_meanwhile)
    with pytest.raises(ValueError) as err:
        weights.load_trained_model(str(ckpt))
    line = str(err.value)
    assert line.startswith(f"--model {ckpt}: the checkpoint was removed while it was read"), line
    assert "\n" not in line


def test_a_damaged_checkpoint_is_still_named_not_taken_for_pruned(tmp_path, monkeypatch):
    """The re-look finds the same checkpoint: the failure is its own, said as before."""
    run = tmp_path / "run"
    _save(run, 2)
    real = weights.load_weights

    def unreadable(path, device="cpu"):
        raise ValueError(f"checkpoint {path / 'model.pt'}: unreadable (EOFError: cut short)")

    monkeypatch.setattr(weights, "load_weights", unreadable)
    with pytest.raises(ValueError, match=r"model\.pt: unreadable"):
        weights.load_trained_model(str(run))
    monkeypatch.setattr(weights, "load_weights", real)
    assert weights.load_trained_model(str(run))[1] == {151643: 1, 7: 2}
