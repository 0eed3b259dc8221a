"""gpu tier (issue 26, item 8): the trainer on CUDA. An emulated-ranks step of the Qwen2.5-0.5B
architecture (random init) at 16K tokens per micro-batch, with the defaults a GPU run gets
(block 128, flex, bf16 autocast, device clock); and fp16 with loss scaling saved in checkpoints."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sparsebalance.engine.runtime import Runtime
from sparsebalance.latency import analytic_profile
from sparsebalance.models import load_shapes
from sparsebalance.train import TrainConfig, Trainer
from tests.train.harness import base_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore::sparsebalance.latency.ProfileMismatchWarning"),
    pytest.mark.filterwarnings("ignore::sparsebalance.latency.OutsideGridWarning"),
]
GPU = Runtime(0, 1, torch.device("cuda"))


def test_emulated_ranks_train_the_qwen2_5_0_5b_architecture_at_16k(tmp_path):
    profile = tmp_path / "profile.json"
    analytic_profile(load_shapes("qwen2.5-0.5b"), "h100", block_size=128).save(profile)
    cfg = TrainConfig(model="qwen2.5-0.5b", device="cuda", emulate_ranks=4, capacity=16384,
                      global_batch=8, steps=2, num_builtin=32, min_len=1024, max_len=16384,
                      profile=str(profile), out=str(tmp_path / "run"))  # fmt: skip
    assert cfg.block_size == 128 and cfg.precision == "auto"
    trainer = Trainer(cfg, GPU)
    assert trainer.precision.name == "bf16"
    out = trainer.run()
    assert len(out["losses"]) == 2 and all(math.isfinite(x) for x in out["losses"])
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    ranks = [x for x in lines if x["rank"] != "all"]
    assert len(ranks) == 2 * 4 and all(r["compute_s"] > 0 and r["tokens"] > 0 for r in ranks)
    assert all(0 < r["density"] <= 1 for r in ranks)


def test_fp16_loss_scaling_trains_and_is_checkpointed(tmp_path):
    profile = tmp_path / "profile.json"
    analytic_profile(load_shapes("tiny"), "h100", block_size=128).save(profile)
    cfg = base_config(tmp_path, steps=2, device="cuda", block_size=128, precision="fp16",
                      profile=str(profile))  # fmt: skip
    trainer = Trainer(cfg, GPU)
    out = trainer.run()
    assert all(math.isfinite(x) for x in out["losses"])
    assert trainer.scaler is not None and trainer.scaler.get_scale() > 0
    state = torch.load(tmp_path / "run" / "checkpoints" / "step-000002" / "state.pt",
                       map_location="cpu", weights_only=False)  # fmt: skip
    assert state["trainer"]["grad_scaler"]["scale"] == trainer.scaler.get_scale()
