"""HF Trainer + SparseBalance: SAB plans, the block-sparse attention, DST budgets, feedback.

    python examples/hf_trainer.py                                  # one CPU process
    torchrun --nproc-per-node 2 examples/hf_trainer.py             # 2 ranks (gloo on CPU)

The tiny model and heavy-tailed synthetic token documents keep it to seconds on a CPU; with your
own model and tokenized dataset only the two sparsebalance lines are new.
"""

import os
import sys
import tempfile

import numpy as np
from datasets import Dataset
from transformers import Trainer, TrainingArguments

import sparsebalance
import sparsebalance.hf
from sparsebalance.latency import analytic_profile
from sparsebalance.models import load_shapes
from sparsebalance.models.hf import build_model


def documents(n=64, seed=0):
    """``n`` token documents with heavy-tailed lengths (16 .. 600 tokens)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(4.6, 0.9, n).astype(int), 16, 600)
    return Dataset.from_dict({"input_ids": [rng.integers(0, 1000, k).tolist() for k in lengths]})


def main(out: str, steps: int = 2) -> list[float]:
    model = build_model("tiny")  # random weights from the shipped config; no download
    sparsebalance.attach(model, block_size=32)  # AttentionInterface registration
    # an example reads better with its arguments together:
    # fmt: off
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=1, gradient_accumulation_steps=4, max_steps=steps,
        learning_rate=3e-3, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
        ddp_find_unused_parameters=False,
    )
    # fmt: on
    trainer = Trainer(model=model, args=args, train_dataset=documents())
    # FLOP counts keep it quick; without profile= this machine's is measured once (~1 min) and cached
    profile = f"{out}/profile-{os.environ.get('RANK', '0')}.json"  # one per rank
    analytic_profile(load_shapes("tiny"), "h100", block_size=32).save(profile)
    runtime = sparsebalance.hf.enable(trainer, capacity=1024, profile=profile, block_size=32)
    trainer.train()
    for h in runtime.planner.history if trainer.is_world_process_zero() else []:  # once per run, not per rank
        print(f"step {h['step']}: predicted balance {h['plan_efficiency']:.3f}, density {h['mean_density']:.3f}")
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


if __name__ == "__main__":
    losses = main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
    if os.environ.get("RANK", "0") == "0":  # once per run, not per rank
        print("losses", losses)
    sparsebalance.shutdown()  # frees the trainer, then the process group: a clean exit on every rank
