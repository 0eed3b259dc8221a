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
    cfg = TrainConfig(
        model="qwen2.5-0.5b",
        device="cuda",
        emulate_ranks=4,
        capacity=16384,
        global_batch=8,
        steps=2,
        num_builtin=32,
        min_len=1024,
        max_len=16384,
        profile=str(profile),
        out=str(tmp_path / "run"),
    )
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
    cfg = base_config(tmp_path, steps=2, device="cuda", block_size=128, precision="fp16", profile=str(profile))
    trainer = Trainer(cfg, GPU)
    out = trainer.run()
    assert all(math.isfinite(x) for x in out["losses"])
    assert trainer.scaler is not None and trainer.scaler.get_scale() > 0
    state = torch.load(
        tmp_path / "run" / "checkpoints" / "step-000002" / "state.pt", map_location="cpu", weights_only=False
    )
    assert state["trainer"]["grad_scaler"]["scale"] == trainer.scaler.get_scale()


def test_a_nan_in_the_attention_input_skips_the_step_on_cuda(tmp_path, monkeypatch):
    """Flex contains nothing (issue 36): a NaN in one layer's values reaches the loss or the
    gradients, and the step's check skips it, applies nothing, and the run goes on."""
    from sparsebalance.models import attention as module

    profile = tmp_path / "profile.json"
    analytic_profile(load_shapes("tiny"), "h100", block_size=128).save(profile)
    cfg = base_config(tmp_path, steps=3, device="cuda", precision="bf16", profile=str(profile))
    trainer = Trainer(cfg, GPU)
    original, calls = module._attend, {"n": 0}

    def poisoned(ctx, q, k, v, layout, scaling):
        calls["n"] += 1
        if trainer.step == 1:  # every layer of step 2
            v = v.clone()
            v[3, 0, 0] = math.nan
        return original(ctx, q, k, v, layout, scaling)

    monkeypatch.setattr(module, "_attend", poisoned)
    trainer.run()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    skipped = [r["skipped_nonfinite"] for r in lines if r["rank"] == "all"]
    assert skipped == [False, True, False] and calls["n"] > 0
    assert all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())
