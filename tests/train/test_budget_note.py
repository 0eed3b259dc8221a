"""Issue 55: the demo's two runs, stepped together on the same ranks, print the budget line once
(it printed it twice, word for word); a run with another budget still says its own."""

from __future__ import annotations

from dataclasses import replace

import torch

from sparsebalance.engine.runtime import Runtime
from sparsebalance.train import Trainer
from tests.train.harness import base_config


def test_runs_on_one_runtime_say_a_shared_budget_line_once(tmp_path, capfd):
    rt = Runtime(0, 1, torch.device("cpu"))
    cfg = base_config(tmp_path, steps=1)
    Trainer(replace(cfg, out=str(tmp_path / "a")), rt)
    Trainer(replace(cfg, out=str(tmp_path / "b"), strategy="sequential"), rt)
    err = capfd.readouterr().err
    assert err.count("sparsebalance train: budget: top-k") == 1, err
    Trainer(replace(cfg, out=str(tmp_path / "c"), dst=replace(cfg.dst, budget_tokens=64)), rt)
    err = capfd.readouterr().err
    assert err.count("sparsebalance train: budget: top-k 64 tokens") == 1, err


def test_another_runtime_says_it_again(tmp_path, capfd):
    cfg = base_config(tmp_path, steps=1)
    for name in ("a", "b"):
        Trainer(replace(cfg, out=str(tmp_path / name)), Runtime(0, 1, torch.device("cpu")))
    assert capfd.readouterr().err.count("sparsebalance train: budget: top-k") == 2
