"""A pipeline checkpoint's stage files (issue 54): each stage of the first pipeline writes its own
parameters and optimizer state, and each rank reads only its own stage's, so no rank holds
another stage's tensors; ``eval`` merges the stages in one process; a checkpoint of format 2
(``model.pt`` holding the whole model) still resumes and loads; a full disk while a stage writes
is one line."""

from __future__ import annotations

import errno
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from sparsebalance.train import TrainConfig
from sparsebalance.train.checkpoint import CHECKSUMS, load_weights, sha256
from sparsebalance.train.shards import MODEL_SHARD, OPTIM_SHARD
from sparsebalance.train.weights import load_trained_model
from sparsebalance.tuning import DSTConfig
from tests.train.harness import base_config, rewind, run_ranks, run_trainers

OFF = DSTConfig(mode="off", budget="gamma", gamma0=0.9)


def _cfg(tmp: Path, **over) -> TrainConfig:
    return base_config(tmp, **{"steps": 2, "strategy": "sab", "dst": OFF, "checkpoint_every": 2, "pp": 2, **over})


def _watched(trainer, rank: int) -> dict:
    """Train with the stages' point-to-point object sends refused, recording every file this rank
    saves (and the model names in it); then load the checkpoint again into zeroed parameters,
    recording every file this rank reads, and compare the stage with what it saved."""
    import torch.distributed as dist

    from sparsebalance.train import checkpoint, pipeline_checkpoint

    def refused(*args, **kwargs):
        raise AssertionError("a stage's tensors were sent to another rank")

    dist.send_object_list = dist.recv_object_list = refused
    saved, read = {}, []
    real_save, real_load = pipeline_checkpoint._save, pipeline_checkpoint._load

    def save(obj, path):
        saved[path.name] = sorted(obj) if path.name.startswith("model-stage") else None
        return real_save(obj, path)

    def load(path, *args):
        read.append(path.name)
        return real_load(path, *args)

    pipeline_checkpoint._save = checkpoint._save = save
    pipeline_checkpoint._load = load
    trainer.run()
    want = {n: t.detach().clone() for n, t in trainer.model.state_dict().items() if n in trainer.stage.names}
    with torch.no_grad():
        for p in trainer.stage.parameters_owned():
            p.zero_()
    path = trainer.run_dir / "checkpoints" / "step-000002"
    groups = trainer.runner.executor.groups
    stage = trainer.stage
    pipeline_checkpoint.load_pipeline_checkpoint(
        path, stage, trainer.optimizer, trainer.scheduler, trainer.rt, groups.objects
    )
    have = trainer.model.state_dict()
    same = all(torch.equal(have[n], t) for n, t in want.items())
    return {"saved": saved, "read": read, "names": sorted(stage.names), "stage": stage.layout.stage, "same": same}


@pytest.mark.distributed
@pytest.mark.parametrize("virtual", [1, pytest.param(2, marks=pytest.mark.slow)], ids=["pp2", "pp2-v2"])
def test_each_stage_writes_and_reads_only_its_own_files(tmp_path, virtual):
    results = run_trainers(_watched, _cfg(tmp_path, pp_virtual=virtual), 2, tmp_path)
    ckpt = tmp_path / "run" / "checkpoints" / "step-000002"
    stage_files = {MODEL_SHARD.format(s) for s in range(2)} | {OPTIM_SHARD.format(s) for s in range(2)}
    assert not (ckpt / "model.pt").exists()
    assert stage_files <= set(json.loads((ckpt / CHECKSUMS).read_text()))  # every file verifiable
    for rank, res in enumerate(results):
        mine = {MODEL_SHARD.format(rank), OPTIM_SHARD.format(rank)}
        assert res["stage"] == rank
        assert set(res["saved"]) - {"state.pt"} == mine  # its own stage's files only
        assert res["saved"][MODEL_SHARD.format(rank)] == res["names"]  # its own parameters only
        assert ("state.pt" in res["saved"]) == (rank == 0)  # the shared files: rank 0's
        assert set(res["read"]) - {"state.pt"} == mine and ("state.pt" in res["read"]) == (rank == 0)
        assert res["same"]  # the stage's parameters, back from its own files
    whole = load_weights(ckpt)  # eval's reader: the stages merged in one process
    assert set(whole) == set(results[0]["names"]) | set(results[1]["names"])
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["latest", "step-000002"]  # no staging left


def _as_format_2(ckpt: Path) -> None:
    """Rewrite pipeline checkpoint ``ckpt`` as the previous version wrote it: the stages' model
    files merged into ``model.pt``, their optimizer states a list in ``state.pt``."""
    stages = sorted(ckpt.glob("model-stage-*.pt"))
    model_sd, optimizers = {}, []
    for s in range(len(stages)):
        model_sd.update(torch.load(ckpt / MODEL_SHARD.format(s), weights_only=True))
        optimizers.append(torch.load(ckpt / OPTIM_SHARD.format(s), weights_only=True))
        (ckpt / MODEL_SHARD.format(s)).unlink()
        (ckpt / OPTIM_SHARD.format(s)).unlink()
    state = torch.load(ckpt / "state.pt", weights_only=True)
    torch.save(model_sd, ckpt / "model.pt")
    torch.save({"optimizer": optimizers, **state}, ckpt / "state.pt")
    meta = json.loads((ckpt / "meta.json").read_text())
    (ckpt / "meta.json").write_text(json.dumps({**meta, "schema_version": 2}) + "\n")
    sums = {p.name: sha256(p) for p in sorted(ckpt.iterdir()) if p.name != CHECKSUMS}
    (ckpt / CHECKSUMS).write_text(json.dumps(sums, indent=1) + "\n")


@pytest.mark.slow  # default tier time (~10 min on 2 cores): its correctness is CI's slow tier
@pytest.mark.distributed
def test_a_checkpoint_of_format_2_still_resumes_and_loads_the_same_weights(tmp_path):
    cfg = _cfg(tmp_path, steps=4)
    full = run_ranks(cfg, 2, tmp_path)
    new = tmp_path / "run" / "checkpoints" / "step-000002"
    again = tmp_path / "again"
    rewind(tmp_path / "run", again, step=2, drop=4)
    old = again / "run" / "checkpoints" / "step-000002"
    _as_format_2(old)
    # eval's readers: the same tensors from the stage files and from format 2's model.pt
    merged, whole = load_weights(new), load_weights(old)
    assert list(merged) == list(whole)
    for name, tensor in whole.items():
        assert torch.equal(merged[name], tensor), name
    for a, b in zip(
        load_trained_model(str(new))[0].parameters(), load_trained_model(str(old))[0].parameters(), strict=True
    ):
        assert torch.equal(a, b)
    resumed = run_ranks(replace(cfg, out=str(again / "run"), resume=True), 2, again)
    assert resumed[0]["losses"] == pytest.approx(full[0]["losses"][2:], rel=1e-6, abs=1e-6)
    final = load_weights(again / "run" / "checkpoints" / "step-000004")  # written as stage files again
    assert not (again / "run" / "checkpoints" / "step-000004" / "model.pt").exists()
    for name, tensor in load_weights(tmp_path / "run" / "checkpoints" / "step-000004").items():
        torch.testing.assert_close(final[name], tensor, rtol=1e-6, atol=1e-7, msg=name)


def _full_on_stage_1(trainer, rank: int) -> dict:
    """Step 2's checkpoint meets a full disk while stage 1 writes its files: every rank's error."""
    from sparsebalance.train import pipeline_checkpoint

    real_save = pipeline_checkpoint._save

    def save(obj, path):
        if rank == 1 and path.parent.name.startswith(".step-000002"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path)

    pipeline_checkpoint._save = save
    try:
        trainer.run()
    except ValueError as err:
        return {"line": str(err)}
    return {"line": None}


@pytest.mark.distributed
def test_a_full_disk_while_a_stage_writes_is_one_line_on_every_rank(tmp_path):
    cfg = _cfg(tmp_path, steps=3, checkpoint_every=1)
    results = run_trainers(_full_on_stage_1, cfg, 2, tmp_path)
    root = tmp_path / "run" / "checkpoints"
    for res in results:
        assert res["line"] is not None and "\n" not in res["line"]
        assert res["line"].startswith(f"checkpoint step-000002: no space left in {root} (disk full")
        assert "step-000001 is intact" in res["line"]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001"]  # nothing partial left
    assert (root / "latest").read_text().strip() == "step-000001"
