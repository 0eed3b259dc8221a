"""Issue 55: ``simulate`` and ``plan`` run with no arguments, with ``train``'s defaults (before:
``give exactly one of --micro-batches M and --capacity C``; ``plan`` also wanted ``--lengths`` and
``--world-size``)."""

from __future__ import annotations

import dataclasses

from sparsebalance.cli import main
from sparsebalance.simulate import SimConfig
from sparsebalance.train.config import TrainConfig

TRAIN = {f.name: f.default for f in dataclasses.fields(TrainConfig)}


def test_simulate_needs_no_bound(capsys):
    assert SimConfig().capacity == TRAIN["capacity"] == 4096
    assert SimConfig(micro_batches=2).capacity is None  # a micro-batch count replaces it
    assert main(["simulate", "--steps", "2"]) == 0  # nothing else given
    out = capsys.readouterr().out
    assert "2 steps x 8 samples per rank, C = 4096" in out and "| sab+dst |" in out


def test_plan_needs_no_arguments(capsys):
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    batch = TRAIN["global_batch"]
    assert first.startswith(f"{batch} samples (train's first global batch of its built-in data), ")
    assert first.endswith(", R = 2, C = 4096")
    assert "| sab |" in out
