"""``sparsebalance.attach`` and ``sparsebalance.hf.enable``: a backend the op does not know, a
second planner for one model, a profile of another model and a global batch larger than the
dataset are refused in one line when called, not at the first forward or after a profile is
measured. So are (issue 45) a second ``attach`` / ``enable`` asking for another block size or
backend than the model was attached with, ``enable`` given a model or a Trainer built with
``model_init``, a block size that is not a positive integer, CUDA on a machine without it and a
token id outside the model's vocabulary."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tests.badinput.conftest import assert_one_line, write_profile


def _trainer(tmp_path, documents: int = 8):
    from transformers import Trainer, TrainingArguments

    from sparsebalance.models.hf import build_model

    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        use_cpu=True,
        report_to=[],
        max_steps=1,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
    )
    data = [{"input_ids": list(range(3, 40 + i))} for i in range(documents)]
    return Trainer(model=build_model("tiny"), args=args, train_dataset=data)


def _enable_twice(tmp_path):
    import sparsebalance.hf

    trainer = _trainer(tmp_path)
    profile = write_profile(tmp_path, block_size=64)
    sparsebalance.hf.enable(trainer, capacity=512, profile=profile)
    sparsebalance.hf.enable(trainer, capacity=512, profile=profile)


def _enable_with_another_models_profile(tmp_path):
    import sparsebalance.hf

    profile = write_profile(tmp_path, "qwen.json", "qwen2.5-0.5b", block_size=64)
    sparsebalance.hf.enable(_trainer(tmp_path), capacity=512, profile=profile)


def _enable_with_a_global_batch_over_the_dataset(tmp_path):
    import sparsebalance.hf

    sparsebalance.hf.enable(_trainer(tmp_path, documents=8), capacity=512, global_batch=9)


def _attach_an_unknown_backend(tmp_path):
    import sparsebalance
    from sparsebalance.models.hf import build_model

    sparsebalance.attach(build_model("tiny"), backend="nope")


def _attach_twice_with_another_block_size(tmp_path):
    import sparsebalance
    from sparsebalance.models.hf import build_model

    model = build_model("tiny")
    sparsebalance.attach(model, block_size=32)
    sparsebalance.attach(model, block_size=64)


def _attach_twice_with_another_backend(tmp_path):
    import sparsebalance
    from sparsebalance.models.hf import build_model

    model = build_model("tiny")
    sparsebalance.attach(model, backend="torch")
    sparsebalance.attach(model, backend="reference")


def _enable_with_another_block_size_than_attached(tmp_path):
    import sparsebalance
    import sparsebalance.hf

    trainer = _trainer(tmp_path)
    sparsebalance.attach(trainer.model, block_size=32)
    profile = write_profile(tmp_path, block_size=64)
    sparsebalance.hf.enable(trainer, capacity=512, profile=profile, block_size=64)


def _enable_a_model(tmp_path):
    import sparsebalance.hf
    from sparsebalance.models.hf import build_model

    sparsebalance.hf.enable(build_model("tiny"))


def _enable_a_model_init_trainer(tmp_path):
    from transformers import Trainer, TrainingArguments

    import sparsebalance.hf
    from sparsebalance.models.hf import build_model

    args = TrainingArguments(output_dir=str(tmp_path / "hf"), use_cpu=True, report_to=[], max_steps=1)
    data = [{"input_ids": list(range(3, 40))}] * 8
    trainer = Trainer(model_init=lambda: build_model("tiny"), args=args, train_dataset=data)
    sparsebalance.hf.enable(trainer, capacity=512, profile=write_profile(tmp_path, block_size=64))


def _attach_a_block_size_string(tmp_path):
    import sparsebalance
    from sparsebalance.models.hf import build_model

    sparsebalance.attach(build_model("tiny"), block_size="x")


def _attach_cuda_without_cuda(tmp_path):
    import torch

    import sparsebalance
    from sparsebalance.models.hf import build_model

    with pytest.MonkeyPatch.context() as mp:  # a CPU-only machine, whatever this one has
        mp.setattr(torch.cuda, "is_available", lambda: False)
        sparsebalance.attach(build_model("tiny"), device="cuda")


def _enable_a_dataset_with_an_id_outside_the_vocabulary(tmp_path):
    import sparsebalance.hf

    trainer = _trainer(tmp_path)
    trainer.train_dataset[3]["input_ids"][7] = 5000  # the tiny model has 4096 ids
    sparsebalance.hf.enable(trainer, capacity=512)  # refused before the profile is measured


def _enable_an_hf_dataset_with_an_id_outside_the_vocabulary(tmp_path):
    datasets = pytest.importorskip("datasets")
    import sparsebalance.hf

    trainer = _trainer(tmp_path)
    rows = [list(ex["input_ids"]) for ex in trainer.train_dataset]
    rows[5][0] = -1
    trainer.train_dataset = datasets.Dataset.from_dict({"input_ids": rows})
    sparsebalance.hf.enable(trainer, capacity=512)


# a call -> what its one line must name
CALLS = [
    pytest.param(_enable_twice, ["already has a step planner"], id="enable-twice"),
    pytest.param(
        _enable_with_another_models_profile,
        ["qwen.json", "num_layers 24 vs 4"],
        id="profile-of-another-model",
    ),
    pytest.param(
        _enable_with_a_global_batch_over_the_dataset,
        ["global_batch 9 exceeds the dataset's 8 documents"],
        id="global-batch",
    ),
    pytest.param(_attach_an_unknown_backend, ["sparsebalance.attach", "'nope'"], id="backend"),
    pytest.param(
        _attach_twice_with_another_block_size,
        ["sparsebalance.attach", "attached already with block_size=32", "block_size=64"],
        id="attach-twice-block-size",
    ),
    pytest.param(
        _attach_twice_with_another_backend,
        ["attached already with backend='torch'", "backend='reference'"],
        id="attach-twice-backend",
    ),
    pytest.param(
        _enable_with_another_block_size_than_attached,
        ["sparsebalance.hf.enable", "attached already with block_size=32", "block_size=64"],
        id="enable-after-attach",
    ),
    pytest.param(
        _enable_a_model,
        ["takes a transformers Trainer", "Qwen2ForCausalLM", "sparsebalance.attach(model)"],
        id="enable-a-model",
    ),
    pytest.param(_enable_a_model_init_trainer, ["model_init", "model=model"], id="model-init"),
    pytest.param(
        _attach_a_block_size_string,
        ["sparsebalance.attach", "block_size must be a positive integer, got 'x'"],
        id="block-size-str",
    ),
    pytest.param(
        _attach_cuda_without_cuda,
        ["sparsebalance.attach", "'cuda'", "CUDA is not available"],
        id="attach-cuda",
    ),
    pytest.param(
        _enable_a_dataset_with_an_id_outside_the_vocabulary,
        ["example 3 of the dataset holds token id 5000 at position 7", "vocabulary of 4096"],
        id="id-outside-vocabulary",
    ),
    pytest.param(
        _enable_an_hf_dataset_with_an_id_outside_the_vocabulary,
        ["example 5 of the dataset holds token id -1 at position 0", "vocabulary of 4096"],
        id="hf-dataset-id-outside-vocabulary",
    ),
]


@pytest.mark.filterwarnings("ignore::sparsebalance.latency.ProfileMismatchWarning")
@pytest.mark.parametrize(("call", "culprits"), CALLS)
def test_the_integrations_refuse_at_the_call(tmp_path, call, culprits):
    with pytest.raises((ValueError, TypeError)) as err:
        call(tmp_path)
    assert_one_line(err.value, *culprits)


@pytest.mark.filterwarnings("ignore::sparsebalance.latency.ProfileMismatchWarning")
def test_the_same_settings_again_return_the_same_runtime(tmp_path):
    """What a second call may do: repeat a setting or leave it out (the documented attach then
    enable), which returns the attached runtime unchanged."""
    import sparsebalance
    import sparsebalance.hf

    trainer = _trainer(tmp_path)
    runtime = sparsebalance.attach(trainer.model, block_size=32, backend="torch")
    assert sparsebalance.attach(trainer.model) is runtime
    assert sparsebalance.attach(trainer.model, block_size=32, backend="torch") is runtime
    profile = write_profile(tmp_path, block_size=32)
    assert sparsebalance.hf.enable(trainer, capacity=512, profile=profile) is runtime
    assert runtime.block_size == runtime.planner.config.block_size == 32
    assert runtime.planner.config.backend == "torch"  # was "auto" whatever attach had chosen
