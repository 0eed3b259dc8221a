"""The Python API: config dataclasses take values of their fields' types only (one line naming
``Class.field``, a ``TypeError``; nothing coerced), and the ``Trainer`` refuses a profile of
another run and a model it cannot run before anything is profiled or trained."""

from __future__ import annotations

import math

import pytest
import torch

from sparsebalance.engine.runtime import Runtime
from sparsebalance.integrations import PlannerConfig
from sparsebalance.simulate import SimConfig, run_simulation
from sparsebalance.train import TrainConfig, Trainer
from sparsebalance.tuning import DSTConfig
from tests.badinput.conftest import (
    assert_one_line,
    gpt2_model,
    sliding_window_model,
    write_profile,
)
from tests.train.harness import write_dataset

# (config class, keyword arguments) -> what the one line must name
WRONG_TYPES = [
    pytest.param(TrainConfig, {"steps": 2.7}, ["TrainConfig.steps", "an integer"], id="float"),
    pytest.param(TrainConfig, {"steps": True}, ["TrainConfig.steps", "an integer"], id="bool"),
    pytest.param(TrainConfig, {"lr": "1e-3"}, ["TrainConfig.lr", "a finite number"], id="str"),
    pytest.param(TrainConfig, {"grad_clip": math.nan}, ["TrainConfig.grad_clip", "finite"], id="nan"),
    pytest.param(TrainConfig, {"out": 5}, ["TrainConfig.out", "a string"], id="out-int"),
    pytest.param(
        TrainConfig,
        {"deterministic": "no"},
        ["TrainConfig.deterministic", "true or"],
        id="bool-str",
    ),
    pytest.param(TrainConfig, {"dst": {"mode": "off"}}, ["TrainConfig.dst", "a DSTConfig"], id="dst-dict"),
    pytest.param(DSTConfig, {"layer_feedback": "yes"}, ["DSTConfig.layer_feedback"], id="dst-bool"),
    pytest.param(
        SimConfig,
        {"capacity": 4096, "steps": 2.5},
        ["SimConfig.steps", "an integer"],
        id="sim-steps",
    ),
    pytest.param(
        SimConfig,
        {"capacity": 4096, "curve_alpha": (1.0, "x")},
        ["SimConfig.curve_alpha", "a list of 2 finite numbers"],
        id="sim-tuple",
    ),
    pytest.param(
        PlannerConfig,
        {"global_batch": 8.0, "micro_batches": 2},
        ["PlannerConfig.global_batch", "an integer"],
        id="planner",
    ),
]


@pytest.mark.parametrize(("cls", "kwargs", "culprits"), WRONG_TYPES)
def test_a_config_value_of_the_wrong_type_is_refused(tmp_path, cls, kwargs, culprits):
    if cls is TrainConfig:
        kwargs = {"out": str(tmp_path / "run"), "device": "cpu", **kwargs}
    with pytest.raises(TypeError) as err:
        cls(**kwargs)
    assert_one_line(err.value, *culprits)


# TrainConfig keyword arguments of the right type but out of range -> what the one line must
# name: the field the caller passed, with its flag (the command line names the flag alone)
OUT_OF_RANGE = [
    pytest.param({"lr": 0.0}, ["TrainConfig.lr (--lr) must be > 0, got 0.0"], id="lr"),
    pytest.param({"grad_clip": -1.0}, ["TrainConfig.grad_clip (--grad-clip) must be >= 0"], id="grad-clip"),
    pytest.param({"weight_decay": -0.1}, ["TrainConfig.weight_decay (--weight-decay)"], id="weight-decay"),
    pytest.param({"warmup_steps": -1}, ["TrainConfig.warmup_steps (--warmup-steps) must be"], id="warmup-steps"),
    pytest.param({"steps": 0}, ["TrainConfig.steps (--steps) must be >= 1"], id="steps"),
    pytest.param({"schedule": "step"}, ["TrainConfig.schedule (--schedule) must be one of"], id="schedule"),
    pytest.param(
        {"micro_batches": 2},
        ["TrainConfig.micro_batches (--micro-batches) and TrainConfig.capacity (--capacity)"],
        id="both-bounds",
    ),
    pytest.param(
        {"capacity": "auto"},
        ["TrainConfig.capacity='auto' (--capacity) on CPU needs TrainConfig.memory_budget (--memory-budget)"],
        id="auto-capacity",
    ),
    pytest.param(
        {"capacity": "auto", "memory_budget": "nanGB"},
        ["TrainConfig.memory_budget: --memory-budget must be a finite number"],
        id="memory-budget",
    ),
    pytest.param({"block_size": 0}, ["TrainConfig.block_size: --block-size"], id="block-size"),
    pytest.param({"backend": "nope"}, ["TrainConfig.backend='nope' (--backend)"], id="backend"),
    pytest.param({"tokenizer": "missing"}, ["TrainConfig.tokenizer='missing' (--tokenizer)"], id="tokenizer-missing"),
    pytest.param(
        {"resume": True, "overwrite": True},
        ["TrainConfig.resume (--resume)", "TrainConfig.overwrite (--overwrite)"],
        id="resume-and-overwrite",
    ),
]


@pytest.mark.parametrize(("kwargs", "culprits"), OUT_OF_RANGE)
def test_an_out_of_range_value_names_the_field_and_the_flag(tmp_path, kwargs, culprits):
    with pytest.raises(ValueError) as err:
        TrainConfig(device="cpu", out=str(tmp_path / "run"), **kwargs)
    assert_one_line(err.value, *culprits)


def _config(tmp_path, **over) -> TrainConfig:
    fields = dict(
        data=str(write_dataset(tmp_path)),
        out=str(tmp_path / "run"),
        steps=2,
        global_batch=4,
        capacity=512,
        block_size=32,
        device="cpu",
        strategy="sab",
        profile=str(write_profile(tmp_path)),
    )
    return TrainConfig(**{**fields, **over})


# what the Trainer is given -> what its one line must name
TRAINER_CASES = [
    pytest.param(
        lambda tmp: {"profile": str(write_profile(tmp, "q.json", "qwen2.5-0.5b"))},
        ["--profile", "num_layers 24 vs 4"],
        id="profile-of-another-model",
    ),
    pytest.param(
        lambda tmp: {"profile": str(write_profile(tmp, "b.json", block_size=64))},
        ["--profile", "block_size 64 vs 32"],
        id="profile-of-another-block-size",
    ),
    pytest.param(
        lambda tmp: {"model": str(sliding_window_model(tmp))},
        ["TrainConfig.model=", "(--model)", "sliding-window"],
        id="sliding-window-model",
    ),
    pytest.param(
        lambda tmp: {"model": str(gpt2_model(tmp))},
        ["TrainConfig.model=", "(--model)", "model type 'gpt2' is not supported"],
        id="gpt2-model",
    ),
]


@pytest.mark.filterwarnings("ignore::sparsebalance.latency.ProfileMismatchWarning")
@pytest.mark.parametrize(("over", "culprits"), TRAINER_CASES)
def test_the_trainer_refuses_before_profiling_or_training(tmp_path, over, culprits):
    cfg = _config(tmp_path, **over(tmp_path))
    with pytest.raises(ValueError) as err:
        Trainer(cfg, Runtime(0, 1, torch.device("cpu")))
    assert_one_line(err.value, *culprits)
    assert not (tmp_path / "run").exists()


def test_a_simulation_refuses_a_profile_of_another_model(tmp_path):
    """``model`` with ``profile``: the profile prices its own model only (it was ignored)."""
    config = SimConfig(capacity=4096, steps=2, profile=str(write_profile(tmp_path)), model="qwen2.5-0.5b")
    with pytest.raises(ValueError) as err:
        run_simulation(config)
    assert_one_line(err.value, "SimConfig.profile (--profile)", "SimConfig.model (--model)", "num_layers 4 vs 24")


def test_the_trainer_refuses_to_resume_with_fewer_steps_than_trained(tmp_path):
    from sparsebalance.train.checkpoint import save_checkpoint
    from sparsebalance.train.config_io import to_dict

    done = _config(tmp_path, steps=10)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    save_checkpoint(tmp_path / "run", 10, model, opt, sched, {"step": 10, "config": to_dict(done)}, [], True)
    cfg = _config(tmp_path, steps=6, resume=True)
    with pytest.raises(ValueError) as err:
        Trainer(cfg, Runtime(0, 1, torch.device("cpu")))
    assert_one_line(err.value, "TrainConfig.steps (--steps) 6", "already has 10 steps")


def test_cuda_on_a_machine_without_it_is_named_before_the_block_size(tmp_path, monkeypatch):
    """Issue 45: ``TrainConfig(device='cuda', block_size=32)`` on a CPU-only machine blamed the
    block size (flex on CUDA needs multiples of 128) and never said that there is no CUDA."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # whatever this machine has
    with pytest.raises(ValueError) as err:
        TrainConfig(out=str(tmp_path / "run"), device="cuda", block_size=32)
    assert_one_line(err.value, "TrainConfig.device='cuda' (--device)", "CUDA is not available")
    assert str(err.value).index("CUDA is not available") < str(err.value).index("--block-size")
    assert not (tmp_path / "run").exists()
