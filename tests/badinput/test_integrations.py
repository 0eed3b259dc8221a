"""``sparsebalance.attach`` and ``sparsebalance.hf.enable``: a backend the op does not know, a
second planner for one model, a profile of another model and a global batch larger than the
dataset are refused in one line when called, not at the first forward or after a profile is
measured."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tests.badinput.conftest import assert_one_line, write_profile


def _trainer(tmp_path, documents: int = 8):
    from transformers import Trainer, TrainingArguments

    from sparsebalance.models.hf import build_model

    args = TrainingArguments(output_dir=str(tmp_path / "hf"), use_cpu=True, report_to=[],
                             max_steps=1, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2)  # fmt: skip
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
]


@pytest.mark.filterwarnings("ignore::sparsebalance.latency.ProfileMismatchWarning")
@pytest.mark.parametrize(("call", "culprits"), CALLS)
def test_the_integrations_refuse_at_the_call(tmp_path, call, culprits):
    with pytest.raises(ValueError) as err:
        call(tmp_path)
    assert_one_line(err.value, *culprits)
