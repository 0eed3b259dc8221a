"""Issue 55 (bad): a ``--capacity auto`` run could not be resumed with its own command. Its
checkpoint holds the capacity auto resolved (320), so ``--resume --capacity auto`` was refused as
``--capacity 320 -> 'auto'``, with advice (``--overwrite``) that deletes the run. Now ``auto`` on
resume keeps the capacity the run started with, even when a fresh fit would choose another."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from sparsebalance.engine.runtime import Runtime
from sparsebalance.latency import memory_fit as mf
from sparsebalance.latency.host_memory import current_rss_bytes
from sparsebalance.train import Trainer, build
from sparsebalance.train.config_io import to_dict
from sparsebalance.train.launch import preflight
from sparsebalance.train.resume import differences
from tests.train.harness import base_config

CPU1 = Runtime(0, 1, torch.device("cpu"))
pytestmark = pytest.mark.filterwarnings("ignore::sparsebalance.latency.ProfileMismatchWarning")


def test_auto_is_not_a_difference_from_the_capacity_it_resolved(tmp_path):
    auto = base_config(tmp_path, capacity="auto", memory_budget="2GiB")
    assert differences(to_dict(replace(auto, capacity=320)), auto) == []
    # a fixed capacity stays run-defining, both ways round
    assert differences(to_dict(replace(auto, capacity=320)), replace(auto, capacity=256)) == ["--capacity 320 -> 256"]
    assert differences(to_dict(auto), replace(auto, capacity=320)) == ["--capacity 'auto' -> 320"]


@pytest.mark.timeout(600)  # two one-step runs: seconds alone
def test_a_capacity_auto_run_resumes_with_its_own_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(mf, "CACHE_DIR", tmp_path / "cache")  # no stray cached calibration
    budget = str(current_rss_bytes() + 2**30)
    cfg = base_config(tmp_path, steps=1, capacity="auto", memory_budget=budget, strategy="sab")
    first = Trainer(cfg, CPU1)
    first.run()
    started = first.cfg.capacity
    assert isinstance(started, int)
    # the same command with --resume (and more steps): the launcher and the trainer accept it
    again = replace(cfg, steps=2, resume=True)
    assert preflight(again, 1) is None
    fit = build.fit_capacity

    def another_fit(*args, **kw):  # what a fresh start may resolve: another block
        capacity, bound = fit(*args, **kw)
        return capacity + 32, bound

    monkeypatch.setattr(build, "fit_capacity", another_fit)
    capsys.readouterr()
    resumed = Trainer(again, CPU1)
    assert resumed.cfg.capacity == started and resumed.step == 1
    assert f"--capacity auto keeps the run's {started} tokens" in capsys.readouterr().err
    resumed.run()
    assert resumed.step == 2
