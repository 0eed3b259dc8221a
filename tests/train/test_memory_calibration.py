"""``--capacity auto`` uses the memory coefficients ``profile --memory`` measured for the setup."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from sparsebalance.engine.runtime import Runtime
from sparsebalance.latency import fingerprint, load_profile
from sparsebalance.latency import memory_fit as mf
from sparsebalance.latency.host_memory import current_rss_bytes
from sparsebalance.latency.memory import cpu_coefficients
from sparsebalance.latency.memory_fit import MemoryCalibration, MemoryProbe, memory_fingerprint
from sparsebalance.models import ModelShapes
from sparsebalance.models.hf import build_model
from sparsebalance.train import Trainer
from tests.train.harness import base_config

CPU1 = Runtime(0, 1, torch.device("cpu"))
pytestmark = pytest.mark.filterwarnings("ignore::sparsebalance.latency.ProfileMismatchWarning")


def calibration(cfg, act_bytes: float, overhead: float, **fp_over) -> MemoryCalibration:
    """A calibration for the trainer's running fingerprint (as the trainer computes it)."""
    model = build_model(cfg.model, "cpu", torch.float32)
    shapes = ModelShapes.from_hf_config(model.config.to_dict(), name=Path(cfg.model).name)
    fp = fingerprint(shapes, torch.device("cpu"), "fp32", "torch", cfg.block_size)
    running = {**memory_fingerprint(fp, True), **fp_over}
    probes = (MemoryProbe(512, "off", "chunked", 3e8, 4e8), MemoryProbe(1024, "off", "chunked", 3e8, 5e8))
    return MemoryCalibration(running, act_bytes, overhead, probes, (0.0, 0.0), (0.1, 0.1))


def test_capacity_auto_uses_the_profiles_measured_coefficients(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(mf, "CACHE_DIR", tmp_path / "cache")  # no stray cached calibration
    base = current_rss_bytes()
    cfg = base_config(tmp_path, steps=1, capacity="auto", memory_budget=str(base + 2**30))
    analytic = Trainer(cfg, CPU1)
    assert "analytic coefficients" in capsys.readouterr().err  # the --capacity auto line says which
    profile = load_profile(cfg.profile)
    profile.meta["memory"] = calibration(cfg, 4 * cpu_coefficients(0).act_bytes, 0.0).to_json()
    profile.save(cfg.profile)
    measured = Trainer(replace(cfg, out=str(tmp_path / "m")), CPU1)
    assert "measured coefficients from the --profile" in capsys.readouterr().err  # the --capacity auto line says which
    # four times the bytes per saved element: a clearly smaller micro-batch fits
    assert measured.cfg.capacity < 0.6 * analytic.cfg.capacity
    assert measured.memory_bound.capacity() == measured.cfg.capacity
    # a calibration of another setup (other block size) is not used
    other = calibration(cfg, 16.0, 0.0, block_size=cfg.block_size * 2).to_json()
    profile.meta["memory"] = other
    profile.save(cfg.profile)
    again = Trainer(replace(cfg, out=str(tmp_path / "o")), CPU1)
    assert "measured on another setup" in capsys.readouterr().err  # the --capacity auto line says which
    # (analytic again: the base is this process's resident size, which grew with each trainer)
    assert again.cfg.capacity > 2 * measured.cfg.capacity
    assert json.loads(json.dumps(other))["schema"] == mf.SCHEMA


def test_sab_cp_plans_with_the_memory_bound(tmp_path, monkeypatch):
    """``--strategy sab-cp --capacity auto``: the trainer's ContextCost carries the memory bound
    (each document's minimum CP degree), built from the same model that set the capacity."""
    monkeypatch.setattr(mf, "CACHE_DIR", tmp_path / "cache")
    base = current_rss_bytes()
    cfg = base_config(tmp_path, steps=1, capacity="auto", memory_budget=str(base + 2**30), strategy="sab-cp")
    trainer = Trainer(cfg, CPU1)
    bound = trainer.memory_bound
    assert trainer.engine.cost.memory is bound and bound.capacity() == trainer.cfg.capacity
    long = 3 * trainer.cfg.capacity
    k = int(trainer.engine.cost.min_degree(np.array([long]), trainer.cfg.capacity, 8)[0])
    assert k >= 3 and bound.fits(long, k)
