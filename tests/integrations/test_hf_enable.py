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
