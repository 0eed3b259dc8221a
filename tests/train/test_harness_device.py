"""The test harness is device-explicit (issue 38, item 5): on a machine with CUDA the CPU tier
still builds CPU configs (block 32, which CUDA's flex would refuse), and the gpu tier's configs
are CUDA's from the start. ``torch.cuda.is_available`` is patched to True to be that machine
(``TrainConfig`` only validates: nothing here touches a GPU)."""

from __future__ import annotations

import pytest
import torch

from tests.train import test_topk_trainer
from tests.train.harness import base_config


@pytest.fixture
def cuda_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.mark.parametrize(
    "build",
    [base_config, test_topk_trainer._config],
    ids=["harness.base_config", "test_topk_trainer._config"],
)
def test_cpu_tier_configs_stay_on_the_cpu_where_cuda_exists(tmp_path, cuda_machine, build):
    cfg = build(tmp_path)
    assert cfg.device == "cpu" and not cfg.on_cuda()
    assert cfg.block_size == 32


def test_gpu_tier_config_is_built_for_cuda_from_the_start(tmp_path, cuda_machine):
    cfg = base_config(tmp_path, device="cuda")  # no block override: the harness's CUDA default
    assert cfg.on_cuda() and cfg.block_size == 128
    cfg = base_config(tmp_path, device="cuda", backend="torch", block_size=32)  # overrides apply
    assert cfg.block_size == 32 and cfg.backend == "torch"


def test_harness_refuses_auto(tmp_path):
    with pytest.raises(ValueError, match="device must be cpu or cuda"):
        base_config(tmp_path, device="auto")
