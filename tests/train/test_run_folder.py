"""``--out`` is checked before anything is written or prepared: an earlier run needs ``--resume``
or ``--overwrite``, a folder that is not a run's is never written into, ``--overwrite`` removes
the whole earlier run (TensorBoard included), and ``--demo`` has its own folder."""

from __future__ import annotations

import json

import pytest
import torch

from sparsebalance.cli import main
from sparsebalance.engine.runtime import Runtime
from sparsebalance.train import Trainer
from sparsebalance.train.demo import DEMO_DEFAULTS, demo_configs
from tests.train.harness import base_config

pytestmark = pytest.mark.filterwarnings("ignore::sparsebalance.latency.ProfileMismatchWarning")


@pytest.fixture
def no_data_preparation(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("data prepared before --out was checked")

    monkeypatch.setattr("sparsebalance.data.load_corpus", refuse)


def test_an_earlier_run_is_refused_before_anything_is_written(tmp_path, capsys, no_data_preparation):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")  # (a lone tensorboard/ is a start stopped before step 1: issue 55)
    (run / "launch-config.json").write_text('{"schema_version": 1, "steps": 7}\n')
    before = (run / "launch-config.json").read_text()
    assert main(["train", "--nproc", "1", "--out", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds an earlier run (metrics.jsonl)" in err[0]
    assert "--resume" in err[0] and "--overwrite" in err[0]
    assert (run / "launch-config.json").read_text() == before  # not overwritten
    assert sorted(p.name for p in run.iterdir()) == ["launch-config.json", "metrics.jsonl"]


def test_a_model_folder_is_never_written_into(tmp_path, capsys, no_data_preparation):
    model_dir = tmp_path / "qwen"
    model_dir.mkdir()
    hf = json.dumps({"model_type": "qwen2", "hidden_size": 896})
    (model_dir / "config.json").write_text(hf)
    for extra in ([], ["--overwrite"]):
        assert main(["train", "--nproc", "1", "--out", str(model_dir), *extra]) == 2
        assert "config.json is not a SparseBalance run's" in capsys.readouterr().err
    assert (model_dir / "config.json").read_text() == hf
    assert sorted(p.name for p in model_dir.iterdir()) == ["config.json"]


def test_overwrite_removes_the_whole_earlier_run(tmp_path):
    cfg = base_config(tmp_path, steps=1)
    run = tmp_path / "run"
    for name in ("tensorboard", "checkpoints"):
        (run / name).mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "report.md").write_text("old report\n")
    (run / "notes.txt").write_text("mine\n")  # not a run's file: kept
    trainer = Trainer(base_config(tmp_path, steps=1, overwrite=True), Runtime(0, 1, torch.device("cpu")))
    assert {p.name for p in trainer._stale} == {"tensorboard", "checkpoints", "metrics.jsonl", "report.md"}
    with pytest.raises(ValueError, match="holds an earlier run"):
        Trainer(cfg, Runtime(0, 1, torch.device("cpu")))


def test_the_demo_has_its_own_folder(tmp_path):
    assert DEMO_DEFAULTS["out"] == "runs/demo"
    from sparsebalance.train import TrainConfig

    plain_run = tmp_path / "train"
    (plain_run / "checkpoints").mkdir(parents=True)
    with pytest.raises(ValueError, match="holds a training run; --demo"):
        demo_configs(TrainConfig(out=str(plain_run), overwrite=True))
    runs = demo_configs(TrainConfig(out=str(tmp_path / "demo")))
    assert {c.out for c in runs.values()} == {str(tmp_path / "demo" / n) for n in runs}


def test_a_start_that_failed_before_training_can_be_rerun(tmp_path):
    from sparsebalance.train import TrainConfig
    from sparsebalance.train.launch import check_run_folder

    run = tmp_path / "run"
    run.mkdir()
    (run / "launch-config.json").write_text('{"schema_version": 1}\n')  # the worker then failed
    check_run_folder(TrainConfig(out=str(run)))  # nothing trained: no --overwrite needed
