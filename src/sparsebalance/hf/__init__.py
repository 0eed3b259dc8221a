"""``sparsebalance.hf.enable(trainer)``: an existing Hugging Face ``Trainer`` (or TRL
``SFTTrainer``) plans its batches with SAB, runs the block-sparse attention with DST's budgets and
feeds measured times back, by composition (no Trainer subclass to adopt).

```python
trainer = Trainer(model=model, args=TrainingArguments(..., gradient_accumulation_steps=4),
                  train_dataset=tokenized)               # examples with input_ids
sparsebalance.hf.enable(trainer, capacity=4096)           # before trainer.train()
trainer.train()
```

The first ``enable`` for a model, device, block size and budget kind measures a latency profile
on rank 0 (about a minute, said first in one line on stderr) and caches it; ``profile=PATH``
passes one instead.

What it does: :func:`sparsebalance.attach` on ``trainer.model``; builds the planner and the
balanced sampler over ``trainer.train_dataset`` (global batch: ``per_device_train_batch_size x
gradient_accumulation_steps x world size`` documents per optimizer step unless given; every rank
runs exactly ``gradient_accumulation_steps`` packed micro-batches per step); replaces the
instance's ``get_train_dataloader`` (its public override point) with one that returns the
planned loader; installs :class:`~.callback.SparseBalanceCallback`. The loss stays the model's
own (HF's causal-LM loss over ``shift_labels``, normalised by the Trainer's ``num_items_in_batch``:
the global target-token count with ``average_tokens_across_devices=True``).

What it refuses, one line each: an object that is not a Trainer (a model: attach it with
:func:`sparsebalance.attach` and build the Trainer with it), ``Trainer(model_init=...)`` (it
builds a new, unattached model in ``train()``), the settings of :func:`_check_args`, a second
call asking for another block size or backend than the attached model's. When ``train()`` starts
(and before every step) the ``TrainingArguments`` the plan was built from
(``gradient_accumulation_steps``, ``per_device_train_batch_size`` when it made the global batch,
the world size, ``seed``) must still hold their values at ``enable``, and ``trainer.model`` must
be the attached model; the Trainer follows a changed ``max_steps`` / ``num_train_epochs`` itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

import torch
from transformers import Trainer

from ..engine import DSTConfig, StepReport
from ..integrations.attach import (
    AttachedRuntime,
    attach,
    attached_runtime,
    check_block_size,
    reconcile,
)
from ..integrations.planner import PlannerConfig
from ..integrations.setup import build_sampler
from .callback import COMPACT, SparseBalanceCallback

__all__ = ["SparseBalanceCallback", "enable"]


def _check_trainer(trainer) -> None:
    """``enable`` takes a Trainer (a model is the common slip: say what to call for it)."""
    if isinstance(trainer, torch.nn.Module):
        raise TypeError(
            f"sparsebalance.hf.enable takes a transformers Trainer, got the model "
            f"{type(trainer).__name__}: for a model call sparsebalance.attach(model), then build "
            "Trainer(model=model, ...) and call sparsebalance.hf.enable(trainer)"
        )
    if not isinstance(trainer, Trainer):
        raise TypeError(
            f"sparsebalance.hf.enable takes a transformers Trainer (or a TRL trainer), got {type(trainer).__name__}"
        )
    if trainer.model_init is not None:
        raise ValueError(
            "sparsebalance.hf.enable: the Trainer was built with model_init, which builds a new "
            "model in train() that would train with its own attention, not the attached one: "
            "build it with Trainer(model=model, ...)"
        )


def _check_args(args, caller: str = "sparsebalance.hf.enable") -> None:
    """Refuse Trainer settings that would silently undo the plan (one line each, naming it);
    checked by ``enable`` and again when ``train()`` starts."""
    if args.dataloader_num_workers:
        raise ValueError(
            f"{caller}: dataloader_num_workers={args.dataloader_num_workers}; it "
            "must be 0 (each step is planned after the previous step's feedback; packing is cheap)"
        )
    # TRL's SFTConfig has packing; transformers' TrainingArguments has not (nothing packs then)
    if getattr(args, "packing", False):
        raise ValueError(
            f"{caller}: set SFTConfig(packing=False): SparseBalance's collator packs the planned documents itself"
        )
    if args.world_size > 1 and not args.average_tokens_across_devices:
        raise ValueError(
            f"{caller}: set average_tokens_across_devices=True: the loss is "
            "normalised by the global target-token count (every rank's micro-batches differ)"
        )
    if args.restore_callback_states_from_checkpoint:
        raise ValueError(
            f"{caller}: leave restore_callback_states_from_checkpoint=False: it "
            "would rebuild SparseBalance's callback without its planner (which restores its own "
            "state from the checkpoint)"
        )
    # transformers renamed gradient_checkpointing to activation_checkpointing: a version has one
    # or both, and a field it lacks is a feature it cannot have switched on
    if getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", None):
        raise ValueError(
            f"{caller}: activation_checkpointing (gradient_checkpointing) reruns "
            "attention in the backward and would select its blocks again: set "
            "activation_checkpointing=False (TRL's configs turn it on by default) and use "
            "sparsebalance.models.checkpointing.apply_activation_checkpointing(model, 'full') "
            "(reuses the forward's layouts) instead"
        )


def _pad_token_id(trainer) -> int:
    # an HF Trainer's processing_class (a tokenizer, or None / absent on older Trainers) and the
    # model's config: either may lack pad_token_id; 0 when neither has one
    for owner in (getattr(trainer, "processing_class", None), trainer.model.config):
        pad = getattr(owner, "pad_token_id", None)
        if isinstance(pad, int):
            return pad
    return 0


def _planned_args(args, global_batch: int, given: bool) -> dict[str, tuple[object, str]]:
    """The ``TrainingArguments`` the plan is built from: name -> (value at ``enable``, why a
    change would break the run) (:meth:`SparseBalanceCallback.check_args`)."""
    fixed = {
        "gradient_accumulation_steps": (
            args.gradient_accumulation_steps,
            "every planned step holds that many micro-batches per rank; the Trainer would group "
            "them into steps of another size",
        ),
        "world_size": (args.world_size, "each step's documents are planned over that many ranks"),
        "seed": (args.seed, "the planner drew its document order with it"),
    }
    if not given:
        fixed["per_device_train_batch_size"] = (
            args.per_device_train_batch_size,
            f"the planned steps take {global_batch} documents (per_device_train_batch_size x "
            "gradient_accumulation_steps x ranks at enable)",
        )
    return fixed


def _planned_dataloader(trainer, runtime: AttachedRuntime, sampler, callback, dataset, pad):
    """The ``get_train_dataloader`` that :func:`enable` installs: the sampler's planned loader,
    after refusing what changed since enable (arguments, model, dataset)."""

    def train_dataloader():
        # train() asks for its loader first: a setting changed since enable is refused here,
        # before anything is trained
        _check_args(trainer.args, "sparsebalance.hf (at train())")
        if trainer.model is not runtime.model:
            raise ValueError(
                f"sparsebalance.hf (at train()): trainer.model ({type(trainer.model).__name__}) is "
                "not the model sparsebalance.hf.enable attached (it was replaced after enable) and "
                "would train with its own attention: set it back, or attach the new model and "
                "enable a new Trainer"
            )
        if trainer.train_dataset is not dataset:
            raise ValueError(
                "sparsebalance.hf (at train()): trainer.train_dataset was replaced after "
                "sparsebalance.hf.enable, which planned the steps over the one it had then: set "
                "it back, or enable a new Trainer (and model) with the new dataset"
            )
        callback.check_args(trainer.args)
        return sampler.dataloader(dataset, pad)

    return train_dataloader


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
    backend: str | None = None,
    deterministic: bool = False,
    lengths=None,
    log: str | Sequence[str] = "compact",
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
            budget="gamma", gamma0=1.0)`` is exact attention).
        profile: latency profile JSON (``sparsebalance profile --out``, or an analytic one).
            Default: the profile cached for this model, device, block size and budget kind
            (``~/.cache/sparsebalance/profiles``), else one measured here on rank 0: about a
            minute, said first in one line on stderr, then cached for every later run of this
            setup (any budget of the kind, micro-batches up to its capacity).
        block_size / backend: the attention's (:func:`sparsebalance.attach`); None: the
            attached model's if ``attach`` chose them, else the defaults (block size: the
            training device's, ``trainer.args.device``: 128 on CUDA, 64 on CPU; backend
            ``auto``). Another value than an earlier ``attach`` chose is refused.
        deterministic: no measured time enters a decision (plans reproducible bit for bit).
        lengths: tokens per example if known (else read once from the dataset).
        log: the ``sparsebalance/*`` numbers each training log gets: ``compact`` (default: the
            balance, bubble, density, budgets and SparseBalance's own cost;
            :data:`~.callback.COMPACT`), ``all`` (every number of the step, ~27), or a list of
            names (``["efficiency", "dst_budget_cut"]``). ``runtime.planner.history`` keeps all.

    Returns:
        The :class:`~sparsebalance.integrations.attach.AttachedRuntime`; its ``planner.history``
        holds each step's telemetry (plan hash, predicted and measured balance, budgets).
    """
    _check_trainer(trainer)
    _check_args(trainer.args)
    if trainer.train_dataset is None:
        raise ValueError("sparsebalance.hf.enable: the trainer has no train_dataset")
    keys = _log_keys(log)
    runtime = _attach(trainer, block_size, backend)
    config = _planner_config(trainer.args, runtime, global_batch, capacity, strategy, overlong, dst, deterministic)
    _install(trainer, runtime, config, profile, lengths, given=global_batch is not None, keys=keys)
    return runtime


def _log_keys(log: str | Sequence[str]) -> tuple[str, ...] | None:
    """``enable``'s ``log=``: the step numbers a training log gets (None: all); refused in one
    line when it names none of them."""
    if log == "compact":
        return COMPACT
    if log == "all":
        return None
    names = (log,) if isinstance(log, str) else tuple(log)
    known = {f.name for f in fields(StepReport)}
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(
            f"sparsebalance.hf.enable: log must be 'compact', 'all' or step numbers' names (StepReport fields), "
            f"got {unknown or log!r}"
        )
    return names


def _attach(trainer, block_size: int | None, backend: str | None) -> AttachedRuntime:
    """:func:`attach` on ``trainer.model`` at the training device; a model attached before must
    agree with this call's block size and backend."""
    args = trainer.args
    check_block_size(block_size, "sparsebalance.hf.enable")
    existing = attached_runtime(trainer.model)
    if existing is not None:  # attached before: this call's settings must agree (one line if not)
        reconcile(existing, "sparsebalance.hf.enable", block_size=block_size, backend=backend, device=args.device)
    return attach(trainer.model, block_size=block_size, backend=backend, device=args.device)


def _planner_config(
    args,
    runtime: AttachedRuntime,
    global_batch: int | None,
    capacity: int | None,
    strategy: str,
    overlong: str,
    dst: DSTConfig | None,
    deterministic: bool,
) -> PlannerConfig:
    """The planner's config from ``enable``'s arguments and the Trainer's (global batch default:
    ``per_device_train_batch_size x gradient_accumulation_steps x world size``)."""
    accum = args.gradient_accumulation_steps
    if global_batch is None:
        global_batch = args.per_device_train_batch_size * accum * max(args.world_size, 1)
    return PlannerConfig(
        global_batch=global_batch,
        micro_batches=accum,
        capacity=capacity,
        strategy=strategy,
        overlong=overlong,
        dst=dst or DSTConfig(),
        block_size=runtime.block_size,
        backend=runtime.backend,
        seed=args.seed,
        deterministic=deterministic,
    )


def _install(
    trainer, runtime: AttachedRuntime, config: PlannerConfig, profile, lengths, *, given: bool, keys=COMPACT
) -> None:
    """Build the balanced sampler (the latency profile measured here if none is cached), then
    give ``trainer`` the planned loader and the callback."""
    args = trainer.args
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"  # the Trainer's autocast
    sampler = build_sampler(
        runtime, trainer.train_dataset, config, profile, lengths, device=args.device, precision=precision
    )
    dataset, pad = trainer.train_dataset, _pad_token_id(trainer)
    fixed = _planned_args(args, config.global_batch, given)
    callback = SparseBalanceCallback(sampler.planner, trainer, fixed, keys)
    trainer.get_train_dataloader = _planned_dataloader(trainer, runtime, sampler, callback, dataset, pad)
    trainer.add_callback(callback)
