"""Issue 55: what the launcher says and accepts before a ``--pp`` run starts. It counted processes
where the trainer counts pipelines (``--nproc 2 --pp 2 --global-batch 1`` was refused though one
pipeline with one document per step trains), and told a pipeline run that ``--strategy sab-cp``
would train its over-long documents whole (a pipeline cannot run it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sparsebalance.train import TrainConfig
from sparsebalance.train.launch import overlong_note, preflight
from sparsebalance.tuning import DSTConfig
from tests.train.harness import base_config

OFF = DSTConfig(mode="off", budget="gamma", gamma0=0.9)


def _cfg(tmp: Path, **over) -> TrainConfig:
    return base_config(tmp, **{"steps": 3, "strategy": "sab", "dst": OFF, **over})


def test_one_pipeline_needs_one_document_per_step_not_one_per_stage(tmp_path):
    assert preflight(_cfg(tmp_path, pp=2, global_batch=1), 2) is None
    assert preflight(_cfg(tmp_path, pp=2, global_batch=2), 4) is None  # two pipelines, one each
    with pytest.raises(ValueError, match=r"^--global-batch 1 is smaller than the 2 ranks: every rank needs"):
        preflight(_cfg(tmp_path, pp=2, global_batch=1), 4)  # two pipelines, one document
    with pytest.raises(ValueError, match=r"^--global-batch 1 is smaller than the 2 ranks"):
        preflight(_cfg(tmp_path, global_batch=1), 2)  # without --pp: two ranks, as before


def test_the_over_long_note_of_a_pipeline_does_not_offer_sab_cp(tmp_path):
    lengths = np.array([100, 700, 900])
    note = overlong_note(_cfg(tmp_path, pp=2, capacity=512), lengths, 2)
    assert note == (
        "2 of 3 documents are longer than --capacity 512: --overlong split: cut into 512-token chunks "
        "trained as separate documents (CP units cannot run with --pp 2)"
    )
