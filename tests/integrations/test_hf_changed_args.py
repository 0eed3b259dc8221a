"""What changes after ``sparsebalance.hf.enable`` (issue 45): the ``TrainingArguments`` the plan
was built from, the Trainer's model and dataset, the model's attention. Each is refused in one
line naming what changed, before a step trains where it can be seen then (``train()`` asks for
its loader first), else at the next step's begin or end. (A changed ``max_steps`` or
``num_train_epochs`` is followed: the Trainer counts steps from the planned loader at ``train()``.)
One process on CPU, the tiny model, an analytic profile (nothing measured, nothing downloaded).

Before the fix, a changed ``gradient_accumulation_steps`` regrouped the planned micro-batches
into steps of another size (the reported losses went 8.40, 0.0, 0.0 with grad norm 0), and a
changed batch size or seed was silently ignored."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tests.badinput.conftest import assert_one_line

pytestmark = pytest.mark.filterwarnings("ignore::sparsebalance.latency.ProfileMismatchWarning")
LENGTHS = (40, 64, 48, 80, 36, 56, 44, 72)  # short: a CPU backward is slow


def _trainer(tmp_path, callbacks=(), global_batch=None, **over):
    """A tiny Trainer (2 documents x 2 micro-batches per step, 2 steps) enabled on the CPU."""
    from transformers import Trainer, TrainingArguments

    import sparsebalance.hf
    from sparsebalance.latency import analytic_profile
    from sparsebalance.models import load_shapes
    from sparsebalance.models.hf import build_model

    profile = tmp_path / "profile.json"
    analytic_profile(load_shapes("tiny"), "h100", block_size=32).save(profile)
    kw = dict(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to=[],
        max_steps=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        learning_rate=1e-3,
        logging_steps=1,
    )
    kw.update(over)
    data = [{"input_ids": list(range(3, 3 + n))} for n in LENGTHS]
    trainer = Trainer(
        model=build_model("tiny"), args=TrainingArguments(**kw), train_dataset=data, callbacks=list(callbacks)
    )
    runtime = sparsebalance.hf.enable(
        trainer, capacity=512, profile=profile, block_size=32, deterministic=True, global_batch=global_batch
    )
    return trainer, runtime


@pytest.mark.parametrize(
    ("name", "value", "culprits"),
    [
        pytest.param(
            "gradient_accumulation_steps",
            4,
            ["trainer.args.gradient_accumulation_steps is 4 but was 2", "micro-batches"],
            id="gradient-accumulation",
        ),
        pytest.param(
            "per_device_train_batch_size",
            3,
            ["trainer.args.per_device_train_batch_size is 3 but was 2", "4 documents"],
            id="batch-size",
        ),
        pytest.param("seed", 7, ["trainer.args.seed is 7 but was 0", "document order"], id="seed"),
    ],
)
def test_an_argument_changed_after_enable_is_refused_before_a_step(tmp_path, name, value, culprits):
    trainer, runtime = _trainer(tmp_path)
    setattr(trainer.args, name, value)
    with pytest.raises(ValueError) as err:
        trainer.train()
    assert_one_line(err.value, *culprits, "set it back to")
    assert trainer.state.global_step == 0 and runtime.forwards == 0  # nothing trained


def test_the_batch_size_is_free_when_the_global_batch_was_given(tmp_path):
    trainer, _ = _trainer(tmp_path, global_batch=4)
    trainer.args.per_device_train_batch_size = 3  # enable did not read it
    assert len(trainer.get_train_dataloader()) == 2 * 2  # 2 steps x 2 micro-batches


def test_a_change_during_training_is_refused_at_the_next_step(tmp_path):
    """Another callback changes gradient_accumulation_steps after step 1: the Trainer reads it
    again at every step, so step 2 would be regrouped; it is refused at its begin."""
    from transformers import TrainerCallback

    class Changer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            args.gradient_accumulation_steps = 1

    trainer, _ = _trainer(tmp_path, callbacks=[Changer()])
    with pytest.raises(ValueError) as err:
        trainer.train()
    assert_one_line(err.value, "trainer.args.gradient_accumulation_steps is 1 but was 2")
    assert trainer.state.global_step == 1


def test_a_replaced_model_or_dataset_is_refused_at_train(tmp_path):
    from sparsebalance.models.hf import build_model

    trainer, runtime = _trainer(tmp_path)
    trainer.train_dataset = [{"input_ids": list(range(3, 50))}] * 8
    with pytest.raises(ValueError) as err:
        trainer.train()
    assert_one_line(err.value, "trainer.train_dataset was replaced after sparsebalance.hf.enable")
    trainer, runtime = _trainer(tmp_path)
    trainer.model = build_model("tiny")
    with pytest.raises(ValueError) as err:
        trainer.train()
    assert_one_line(err.value, "trainer.model (Qwen2ForCausalLM) is not the model")
    assert runtime.forwards == 0


def test_attention_switched_away_after_enable_is_refused_after_the_first_step(tmp_path):
    """The planner logged budgets and densities of a model that trained with SDPA."""
    trainer, runtime = _trainer(tmp_path)
    trainer.model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError) as err:
        trainer.train()
    assert_one_line(err.value, "step 1 trained without SparseBalance's attention")
    assert runtime.forwards == 0 and not runtime.planner.history


def test_an_out_of_vocabulary_id_is_refused_when_first_drawn(tmp_path):
    """With the lengths given, enable reads no token: the collator refuses the example when it
    is first drawn (today's raw IndexError came from the embedding, in the first forward)."""
    from transformers import Trainer, TrainingArguments

    import sparsebalance.hf
    from sparsebalance.latency import analytic_profile
    from sparsebalance.models import load_shapes
    from sparsebalance.models.hf import build_model

    profile = tmp_path / "profile.json"
    analytic_profile(load_shapes("tiny"), "h100", block_size=32).save(profile)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to=[],
        max_steps=1,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        save_strategy="no",
        disable_tqdm=True,
    )
    data = [{"input_ids": list(range(3, 3 + n))} for n in (40, 50, 60, 70)]
    data[2]["input_ids"][5] = 4096  # the tiny model's vocabulary is 4096 ids
    trainer = Trainer(model=build_model("tiny"), args=args, train_dataset=data)
    runtime = sparsebalance.hf.enable(trainer, capacity=512, profile=profile, block_size=32, lengths=[40, 50, 60, 70])
    with pytest.raises(ValueError) as err:
        trainer.train()
    assert_one_line(err.value, "example 2 of the dataset holds token id 4096 at position 5", "vocabulary of 4096 ids")
    assert runtime.forwards == 0
