"""TRL SFTTrainer + SparseBalance: TRL's own packing stays off, SparseBalance's collator packs
the planned documents; completion masks (``completion_mask``) are honoured.

    python examples/trl_sft.py          # or: torchrun --nproc-per-node 2 examples/trl_sft.py
"""

import os
import sys
import tempfile

from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

import sparsebalance
import sparsebalance.hf
from sparsebalance.latency import analytic_profile
from sparsebalance.models import load_shapes
from sparsebalance.models.hf import build_model

sys.path.insert(0, os.path.dirname(__file__))
from hf_trainer import documents  # the same synthetic token documents


def tokenizer():
    """TRL wants a processing class; the documents are token ids already (nothing downloaded)."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def main(out: str, steps: int = 2) -> list[float]:
    model = build_model("tiny")
    model.config.eos_token_id = model.generation_config.eos_token_id = 1  # the tokenizer's <eos>
    sparsebalance.attach(model, block_size=32)
    # an example reads better with its arguments together:
    # fmt: off
    args = SFTConfig(
        output_dir=out, packing=False, activation_checkpointing=False, bf16=False,
        dataset_kwargs={"skip_prepare_dataset": True},  # already tokenized
        per_device_train_batch_size=1, gradient_accumulation_steps=4, max_steps=steps, learning_rate=3e-3,
        logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
    )
    # fmt: on
    trainer = SFTTrainer(model=model, args=args, train_dataset=documents(), processing_class=tokenizer())
    profile = f"{out}/profile-{os.environ.get('RANK', '0')}.json"
    analytic_profile(load_shapes("tiny"), "h100", block_size=32).save(profile)
    sparsebalance.hf.enable(trainer, capacity=1024, profile=profile, block_size=32)
    trainer.train()
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


if __name__ == "__main__":
    losses = main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
    if os.environ.get("RANK", "0") == "0":  # once per run, not per rank
        print("losses", losses)
    sparsebalance.shutdown()  # frees the trainer, then the process group: a clean exit on every rank
