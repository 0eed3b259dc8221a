"""The trainer with activation checkpointing, the chunked loss and --capacity auto."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch

from sparsebalance.engine.runtime import Runtime
from sparsebalance.latency.host_memory import current_rss_bytes
from sparsebalance.train import TrainConfig, Trainer
from sparsebalance.tuning import LayerController
from tests.train.harness import base_config

CPU1 = Runtime(0, 1, torch.device("cpu"))
pytestmark = pytest.mark.filterwarnings("ignore::sparsebalance.latency.ProfileMismatchWarning")


@pytest.mark.slow
def test_checkpointing_and_chunked_loss_train_like_the_plain_path(tmp_path):
    """Same losses over 2 deterministic steps (gamma < 1, DST's layer controller, per-document
    weights). Weights are not compared in fp32: AdamW turns last-bit gradient differences of
    near-zero gradients into lr-sized steps; float64 equality of loss and every gradient is tested
    in tests/models/test_checkpointing.py and tests/ops/test_loss.py."""
    runs = {}
    for name, over in {
        "plain": dict(activation_checkpointing="off", loss="plain"),
        "full+chunked": dict(activation_checkpointing="full", loss="chunked"),
        "selective+chunked": dict(activation_checkpointing="selective", loss="chunked"),
    }.items():
        (tmp_path / name).mkdir()
        cfg = base_config(tmp_path / name, steps=2, per_doc_loss_weighting=True, **over)
        trainer = Trainer(cfg, CPU1)
        runs[name] = trainer.run()["losses"]
    for name, losses in runs.items():
        assert len(losses) == 2
        assert losses == pytest.approx(runs["plain"], rel=1e-5), name


def test_controller_chooses_and_observes_each_layer_once(tmp_path, monkeypatch):
    """Timed (not deterministic) run with layer feedback and full checkpointing: the backward's
    recomputation never reaches DST's layer controller."""
    chosen, observed = Counter(), Counter()
    real_choose, real_observe = LayerController.choose, LayerController.observe

    def choose(self, m, layer, estimate):
        chosen[(id(self), m, layer)] += 1
        return real_choose(self, m, layer, estimate)

    def observe(self, m, layer, seconds):
        observed[(id(self), m, layer)] += 1
        return real_observe(self, m, layer, seconds)

    monkeypatch.setattr(LayerController, "choose", choose)
    monkeypatch.setattr(LayerController, "observe", observe)
    cfg = base_config(tmp_path, steps=1, deterministic=False, activation_checkpointing="full")
    cfg = replace(cfg, dst=replace(cfg.dst, layer_feedback=True))
    Trainer(cfg, CPU1).run()
    assert chosen and set(chosen.values()) == {1}
    assert observed.keys() == chosen.keys() and set(observed.values()) == {1}


def test_capacity_auto(tmp_path):
    # On CPU the model's base is this process's resident size (in a full test session: ~1 GB of
    # loaded modules), so the budgets are set relative to it.
    base = current_rss_bytes()
    cfg = base_config(
        tmp_path, steps=1, capacity="auto", memory_budget=str(base + 2 * 2**30), activation_checkpointing="full"
    )
    trainer = Trainer(cfg, CPU1)
    assert isinstance(trainer.cfg.capacity, int) and trainer.cfg.capacity >= 512
    small_budget = str(current_rss_bytes() + int(0.3 * 2**30))
    small = Trainer(replace(cfg, memory_budget=small_budget, out=str(tmp_path / "s")), CPU1)
    assert small.cfg.capacity < trainer.cfg.capacity
    with pytest.raises(ValueError, match="--memory-budget"):
        TrainConfig(capacity="auto", device="cpu")  # CPU: no device memory to take 90% of
    with pytest.raises(ValueError, match="--capacity"):
        TrainConfig(capacity="lots")
    with pytest.raises(ValueError, match="--activation-checkpointing"):
        TrainConfig(activation_checkpointing="sometimes")
    with pytest.raises(ValueError, match="--loss"):
        TrainConfig(loss="fused")
