"""Single-process trainer checks: bad input, non-finite loss, tokenizer, fresh runs. (The
attention hook is tested in ``tests/models``, packing in ``tests/data``.)"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from sparsebalance.data import load_tokenizer
from sparsebalance.engine.runtime import Runtime
from sparsebalance.engine.step import NonFiniteLoss
from sparsebalance.train import TrainConfig, Trainer
from sparsebalance.train.checkpoint import latest_checkpoint, load_checkpoint
from tests.train.harness import base_config

CPU1 = Runtime(0, 1, torch.device("cpu"))
# The tests use an analytic (GPU) profile on purpose: the fingerprint warning is expected.
pytestmark = pytest.mark.filterwarnings("ignore::sparsebalance.latency.ProfileMismatchWarning")


def test_bad_input_is_reported_clearly(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        TrainConfig(data=str(tmp_path / "missing.jsonl"))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty"):
        Trainer(replace(base_config(tmp_path), data=str(tmp_path / "empty.jsonl")), CPU1)
    (tmp_path / "nofield.jsonl").write_text('{"body": "hello there"}\n')
    with pytest.raises(ValueError, match="text-field"):
        Trainer(replace(base_config(tmp_path), data=str(tmp_path / "nofield.jsonl")), CPU1)
    with pytest.raises(ValueError, match="--global-batch"):
        TrainConfig(global_batch=0)
    with pytest.raises(ValueError, match="exactly one"):
        TrainConfig(micro_batches=2, capacity=1024)


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    cfg = base_config(tmp_path, lr=1e30, steps=5, checkpoint_every=1, deterministic=True)
    trainer = Trainer(cfg, CPU1)
    with pytest.raises(NonFiniteLoss, match="non-finite loss"):
        trainer.run()
    good = latest_checkpoint(tmp_path / "run")
    assert good is not None
    fresh = Trainer(replace(cfg, lr=1e-3, overwrite=True), CPU1)  # only to load the checkpoint
    state = load_checkpoint(good, fresh.model, fresh.optimizer, fresh.scheduler)
    assert 1 <= state["trainer"]["step"] < 5
    assert all(torch.isfinite(p).all() for p in fresh.model.parameters())


def test_default_tokenizer_is_offline_qwen():
    tok = load_tokenizer()
    ids = tok.encode("The passkey is 12345.")
    assert tok.decode(ids) == "The passkey is 12345."
    assert tok.eos_token_id > 150000  # Qwen2.5 special tokens sit above the BPE vocabulary


def test_a_fresh_run_never_mixes_into_an_earlier_one(tmp_path):
    cfg = base_config(tmp_path, steps=1)
    Trainer(cfg, CPU1).run()
    with pytest.raises(ValueError, match="--resume to continue it or --overwrite"):
        Trainer(cfg, CPU1)
    Trainer(replace(cfg, overwrite=True), CPU1).run()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert sum('"rank": "all"' in x for x in lines) == 1  # the earlier run's metrics are gone
