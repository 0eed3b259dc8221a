"""``sparsebalance.hf.enable(trainer)``: an existing Hugging Face ``Trainer`` (or TRL
``SFTTrainer``) plans its batches with SAB, runs the block-sparse attention with DST's budgets and
feeds measured times back, by composition (no Trainer subclass to adopt).

```python
trainer = Trainer(model=model, args=TrainingArguments(..., gradient_accumulation_steps=4),
                  train_dataset=tokenized)               # examples with input_ids
sparsebalance.hf.enable(trainer, capacity=4096)           # before trainer.train()
trainer.train()
```

What it does: :func:`sparsebalance.attach` on ``trainer.model``; builds the planner and the
balanced sampler over ``trainer.train_dataset`` (global batch: ``per_device_train_batch_size x
gradient_accumulation_steps x world size`` documents per optimizer step unless given; every rank
runs exactly ``gradient_accumulation_steps`` packed micro-batches per step); replaces the
instance's ``get_train_dataloader`` (its public override point) with one that returns the
planned loader; installs :class:`~.callback.SparseBalanceCallback`. The loss stays the model's
own (HF's causal-LM loss over ``shift_labels``, normalised by the Trainer's ``num_items_in_batch``:
the global target-token count with ``average_tokens_across_devices=True``).
"""

from __future__ import annotations

from pathlib import Path

from ..integrations.attach import AttachedRuntime, attach
from ..integrations.planner import PlannerConfig
from ..integrations.setup import build_sampler
from ..tuning import DSTConfig
from .callback import SparseBalanceCallback

__all__ = ["SparseBalanceCallback", "enable"]


def _check_args(trainer) -> None:
    """Refuse Trainer settings that would silently undo the plan (one line each, naming it)."""
    args = trainer.args
    if args.dataloader_num_workers:
        raise ValueError(
            f"sparsebalance.hf.enable: dataloader_num_workers={args.dataloader_num_workers}; it "
            "must be 0 (each step is planned after the previous step's feedback; packing is cheap)"
        )
    # TRL's SFTConfig has packing; transformers' TrainingArguments has not (nothing packs then)
    if getattr(args, "packing", False):
        raise ValueError(
            "sparsebalance.hf.enable: set SFTConfig(packing=False): SparseBalance's collator packs "
            "the planned documents itself"
        )
    if args.world_size > 1 and not args.average_tokens_across_devices:
        raise ValueError(
            "sparsebalance.hf.enable: set average_tokens_across_devices=True: the loss is "
            "normalised by the global target-token count (every rank's micro-batches differ)"
        )
    if args.restore_callback_states_from_checkpoint:
        raise ValueError(
            "sparsebalance.hf.enable: leave restore_callback_states_from_checkpoint=False: it "
            "would rebuild SparseBalance's callback without its planner (which restores its own "
            "state from the checkpoint)"
        )
    # transformers renamed gradient_checkpointing to activation_checkpointing: a version has one
    # or both, and a field it lacks is a feature it cannot have switched on
    if getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing",
                                                                   None):  # fmt: skip
        raise ValueError(
            "sparsebalance.hf.enable: activation_checkpointing (gradient_checkpointing) reruns "
            "attention in the backward "
            "and would select its blocks again; use sparsebalance.models.checkpointing."
            "apply_activation_checkpointing(model, 'full') (reuses the forward's layouts) instead"
        )


def _pad_token_id(trainer) -> int:
    # an HF Trainer's processing_class (a tokenizer, or None / absent on older Trainers) and the
    # model's config: either may lack pad_token_id; 0 when neither has one
    for owner in (getattr(trainer, "processing_class", None), trainer.model.config):
        pad = getattr(owner, "pad_token_id", None)
        if isinstance(pad, int):
            return pad
    return 0


def enable(
    trainer,
    *,
    capacity: int | None = None,
    global_batch: int | None = None,
    strategy: str = "sab",
    overlong: str = "split",
    dst: DSTConfig | None = None,
    profile: str | Path | None = None,
    block_size: int | None = None,
    backend: str = "auto",
    deterministic: bool = False,
    lengths=None,
) -> AttachedRuntime:
    """Make ``trainer`` plan, attend and tune with SparseBalance (see the module docstring).

    Args:
        trainer: a ``transformers.Trainer`` (or TRL trainer) not yet training, with a map-style
            ``train_dataset`` of tokenized examples (``input_ids``; TRL's ``completion_mask`` /
            ``assistant_masks`` are honoured).
        capacity: tokens per micro-batch (the memory bound); None: a rank's documents are spread
            over ``gradient_accumulation_steps`` micro-batches without a token bound.
        global_batch: documents per optimizer step over all ranks (default above).
        strategy: ``sab`` (default) | ``flops`` | ``tokens`` | ``sorted`` | ``sequential``.
        overlong: documents longer than ``capacity``: ``split`` into chunks | ``truncate`` |
            ``skip`` (counted in the telemetry). Context-parallel units are not available here.
        dst: budgets (default ``DSTConfig()``, the paper's top-k rule; ``DSTConfig(mode="off",
            budget="gamma", gamma0=1.0)`` is exact
            attention).
        profile: latency profile JSON (default: this machine's cached or measured one).
        block_size / backend: the attention's (:func:`sparsebalance.attach`); block_size None:
            the training device's default (``trainer.args.device``: 128 on CUDA, 64 on CPU).
        deterministic: no measured time enters a decision (plans reproducible bit for bit).
        lengths: tokens per example if known (else read once from the dataset).

    Returns:
        The :class:`~sparsebalance.integrations.attach.AttachedRuntime`; its ``planner.history``
        holds each step's telemetry (plan hash, predicted and measured balance, budgets).
    """
    _check_args(trainer)
    if trainer.train_dataset is None:
        raise ValueError("sparsebalance.hf.enable: the trainer has no train_dataset")
    args = trainer.args
    accum = args.gradient_accumulation_steps
    if global_batch is None:
        global_batch = args.per_device_train_batch_size * accum * max(args.world_size, 1)
    runtime = attach(trainer.model, block_size=block_size, backend=backend, device=args.device)
    config = PlannerConfig(
        global_batch=global_batch, micro_batches=accum, capacity=capacity, strategy=strategy,
        overlong=overlong, dst=dst or DSTConfig(), block_size=runtime.block_size, backend=backend,
        seed=args.seed, deterministic=deterministic,
    )  # fmt: skip
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"  # the Trainer's autocast
    sampler = build_sampler(runtime, trainer.train_dataset, config, profile, lengths,
                            device=args.device, precision=precision)  # fmt: skip
    dataset, pad = trainer.train_dataset, _pad_token_id(trainer)
    trainer.get_train_dataloader = lambda: sampler.dataloader(dataset, pad)
    trainer.add_callback(SparseBalanceCallback(sampler.planner, trainer))
    return runtime
