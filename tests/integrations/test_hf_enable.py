"""``sparsebalance.hf.enable`` refuses Trainer settings that would undo the plan, one line each,
naming the setting (one process; nothing is trained)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")


def _trainer(tmp_path, **over):
    from transformers import Trainer, TrainingArguments

    from sparsebalance.models.hf import build_model

    kw = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1)
    kw.update(over)
    data = [{"input_ids": list(range(3, 40))}] * 8
    return Trainer(model=build_model("tiny"), args=TrainingArguments(**kw), train_dataset=data)


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"dataloader_num_workers": 2}, "dataloader_num_workers=2; it must be 0"),
        ({"activation_checkpointing": True}, r"activation_checkpointing \(gradient_checkpo"),
        ({"restore_callback_states_from_checkpoint": True}, "restore_callback_states"),
    ],
)
def test_enable_refuses(tmp_path, over, message):
    import sparsebalance.hf

    trainer = _trainer(tmp_path, **over)
    with pytest.raises(ValueError, match=message):
        sparsebalance.hf.enable(trainer)


def test_enable_refuses_trl_packing(tmp_path):
    import sparsebalance.hf

    trainer = _trainer(tmp_path)
    trainer.args.packing = True  # what SFTConfig(packing=True) sets
    with pytest.raises(ValueError, match=r"SFTConfig\(packing=False\)"):
        sparsebalance.hf.enable(trainer)


def test_enable_refuses_context_parallel_strategy(tmp_path):
    import sparsebalance.hf

    with pytest.raises(ValueError, match=r"sab-cp.*overlong='split'"):
        sparsebalance.hf.enable(_trainer(tmp_path), strategy="sab-cp")


def test_enable_defaults_to_the_training_devices_block_size(tmp_path, monkeypatch):
    """Issue 37's drift: hf.enable defaulted to block 64, which flex cannot compile on CUDA (the
    documented GPU example stopped with an error about the CLI's --block-size). The block now
    comes from the training device, once, for the attention and the planner alike."""
    import torch
    from transformers import TrainingArguments

    import sparsebalance.hf
    from sparsebalance.integrations import setup
    from sparsebalance.latency import LatencyModel, analytic_profile

    trainer = _trainer(tmp_path, max_steps=1)
    monkeypatch.setattr(TrainingArguments, "device", property(lambda self: torch.device("cuda")))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the device, faked whole
    kernels = []  # no CUDA here: the start-up is stood in for, after the kernel is resolved

    def start(shapes, kernel, *args, **kwargs):
        kernels.append(kernel)
        return LatencyModel(analytic_profile(shapes, "h100", block_size=kernel.block_size))

    monkeypatch.setattr(setup, "load_latency_model", start)
    runtime = sparsebalance.hf.enable(trainer, capacity=512)
    assert runtime.block_size == 128
    assert runtime.planner.config.block_size == 128
    assert kernels[0].block_size == 128 and kernels[0].backend == "flex"
    assert kernels[0].device.type == "cuda"


@pytest.mark.filterwarnings("ignore::sparsebalance.latency.ProfileMismatchWarning")
def test_enable_on_cpu_keeps_the_cpu_block_size(tmp_path):
    import sparsebalance.hf
    from sparsebalance.latency import analytic_profile
    from sparsebalance.models import load_shapes

    profile = tmp_path / "h100.json"
    analytic_profile(load_shapes("tiny"), "h100", block_size=64).save(profile)
    runtime = sparsebalance.hf.enable(_trainer(tmp_path), capacity=512, profile=profile)
    assert runtime.block_size == runtime.planner.config.block_size == 64


def test_the_integrations_profile_the_layouts_of_the_budget_kind(tmp_path, monkeypatch):
    """Issue 37's other drift: the integrations' latency start-up profiled threshold-shaped
    layouts under the default top-k budget; it is the engine's start-up now, which follows the
    budget kind as sparsebalance train does."""
    import numpy as np

    from sparsebalance.engine import startup
    from sparsebalance.integrations import PlannerConfig, attach
    from sparsebalance.integrations.setup import latency_model
    from sparsebalance.latency import LatencyModel, analytic_profile
    from sparsebalance.models import load_shapes
    from sparsebalance.models.hf import build_model
    from sparsebalance.tuning import DSTConfig

    asked = []

    def fake(shapes, device, dtype, backend, block_size, **kw):
        asked.append(kw.get("layout"))
        return LatencyModel(analytic_profile(load_shapes("tiny"), "h100", block_size=block_size))

    monkeypatch.setattr(startup, "default_latency_model", fake)
    model = build_model("tiny")
    attach(model, block_size=64)
    lengths = np.full(16, 100)
    for dst, want in [(DSTConfig(), "top-k"), (DSTConfig(budget="gamma"), "threshold")]:
        config = PlannerConfig(8, 4, 512, dst=dst, block_size=64)
        latency_model(model, config, None, lengths, None)
        assert asked[-1] == want


def test_a_block_size_attach_left_to_the_default_follows_the_training_device(tmp_path, monkeypatch):
    """Issue 45: the documented order (attach the model as loaded, on the CPU, then enable a
    Trainer on CUDA) kept the CPU's block of 64, which flex cannot compile on CUDA: the enable
    stopped naming a --block-size nobody had passed. A block size attach defaulted follows the
    device enable trains on; one it was given stays (a different one is refused)."""
    import torch
    from transformers import TrainingArguments

    import sparsebalance
    import sparsebalance.hf
    from sparsebalance.integrations import setup
    from sparsebalance.latency import LatencyModel, analytic_profile

    trainer = _trainer(tmp_path, max_steps=1)
    runtime = sparsebalance.attach(trainer.model)  # where the model is: the CPU's block
    assert runtime.block_size == 64
    monkeypatch.setattr(TrainingArguments, "device", property(lambda self: torch.device("cuda")))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the device, faked whole
    monkeypatch.setattr(
        setup,
        "load_latency_model",
        lambda shapes, kernel, *a, **k: LatencyModel(analytic_profile(shapes, "h100", block_size=kernel.block_size)),
    )
    assert sparsebalance.hf.enable(trainer, capacity=512) is runtime
    assert runtime.block_size == runtime.planner.config.block_size == 128
