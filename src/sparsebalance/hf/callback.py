"""The ``TrainerCallback`` :func:`sparsebalance.hf.enable` installs: times each micro-batch from
the Trainer's own events, runs the step's feedback (latency model, density estimator) after the
optimizer step, puts the telemetry into the Trainer's training logs, and keeps the planner's
state in the Trainer's checkpoints (``trainer_state.json``: JSON, no pickle).

Micro-batch ``m``'s time runs from ``on_step_begin`` (m = 0) or the previous ``on_substep_end``
to its own ``on_substep_end``; the last one ends when DDP handed its last gradient bucket to the
all-reduce (a communication hook stamps it: the wait for slower ranks is not compute), or at
``on_pre_optimizer_step`` without DDP.

Telemetry reaches the logs through ``Trainer.log`` (the Trainer's public override point, wrapped
on the instance as ``enable`` does with ``get_train_dataloader``), not through ``on_log``: by the
time any callback's ``on_log`` runs, the Trainer has already appended its copy of the logs to
``state.log_history``, and the ``report_to`` callbacks listed before ours have sent theirs. The
wrapper adds the ``sparsebalance/*`` means since the last log to every training log (one with a
``loss``) before the Trainer's own ``log`` runs, so ``log_history`` and every callback see one
entry with the loss and the telemetry, whatever order the callbacks were added in.

Two checks keep a run from training something other than what was planned: before every step,
the ``TrainingArguments`` the plan was built from (:meth:`SparseBalanceCallback.check_args`;
the Trainer reads ``gradient_accumulation_steps`` again at every step); after it, that the
step's micro-batches ran through the attached attention (a model whose attention was switched
away after ``attach`` would train dense while the telemetry showed the planned budgets).
"""

from __future__ import annotations

import itertools
import sys
import time

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ..engine import log_values
from ..engine.parallelize import ReadyClock

COMPACT = (
    "efficiency",
    "bubble_fraction",
    "plan_efficiency",
    "mean_density",
    "budget_mean",
    "budget_min",
    "budget_max",
    "overhead_s",
)
"""The ``sparsebalance/*`` keys a training log gets by default (``log="compact"``): the balance
measured and planned, the bubble, what attention kept, and what SparseBalance itself cost. The
rest of a step's numbers (~27 in all) with ``log="all"``; every one stays in
``planner.history``."""


class SparseBalanceCallback(TrainerCallback, ExportableState):
    """See the module docstring; built by :func:`sparsebalance.hf.enable`."""

    def __init__(
        self,
        planner=None,
        trainer=None,
        fixed: dict[str, tuple[object, str]] | None = None,
        keys: tuple[str, ...] | None = COMPACT,
    ) -> None:
        self.planner = planner
        self.trainer = trainer
        self.fixed = dict(fixed or {})
        """``TrainingArguments`` name -> (its value when the plan was built, why it matters)."""
        self.keys = keys
        """The step numbers a training log gets (under ``sparsebalance/``); None: all of them."""
        self._stamps: list[float] = []
        self._clock: ReadyClock | None = None
        self._logged = 0
        self._wrapped_log = None  # the trainer's log method before ours (wrapped once)

    def state(self) -> dict:
        """What ``trainer_state.json`` keeps (``stateful_callbacks``): the planner's learned
        state (latency calibration, density estimator), JSON only."""
        planner = {} if self.planner is None else self.planner.state_dict()
        return {"args": {}, "attributes": {"sparsebalance": planner}}

    def on_train_begin(self, args, state, control, **kwargs):
        name = type(self).__name__
        if state.stateful_callbacks is None:
            state.stateful_callbacks = {}
        saved = state.stateful_callbacks.get(name)
        if isinstance(saved, list):  # one entry per instance of this class: ours is the only one
            saved = saved[-1]
        learned = (saved or {}).get("attributes", {}).get("sparsebalance")
        if state.global_step > 0 and learned:
            self.planner.load_state_dict(learned)
        elif state.global_step > 0 and state.is_world_process_zero:
            print(
                f"sparsebalance: the checkpoint at step {state.global_step} holds no "
                "SparseBalance state: the latency calibration and the density estimator start "
                "afresh",
                file=sys.stderr,
            )
        # a checkpoint written without SparseBalance has no entry, which saving would need
        state.stateful_callbacks.setdefault(name, self.state())
        self._logged = len(self.planner.history)
        self._hook_ddp()
        self._wrap_log()

    def _wrap_log(self) -> None:
        """Make ``trainer.log`` add the telemetry to training logs before the Trainer keeps and
        sends them (see the module docstring); once per trainer, ``train()`` may run again."""
        if self.trainer is None or self._wrapped_log is not None:
            return
        original = self._wrapped_log = self.trainer.log

        def log(logs: dict, *args, **kwargs):
            if "loss" in logs:  # training logs only (not eval, not the end-of-train summary)
                logs.update(self.log_values())
            return original(logs, *args, **kwargs)

        self.trainer.log = log

    def log_values(self) -> dict:
        """The ``sparsebalance/*`` means of the steps finished since the last call (empty when
        none); what each training log gets."""
        values = log_values(self.planner.history, self._logged)
        self._logged = len(self.planner.history)
        if self.keys is None:
            return values
        wanted = {f"sparsebalance/{k}" for k in self.keys}
        return {k: v for k, v in values.items() if k in wanted}

    def _hook_ddp(self) -> None:
        """Stamp when DDP hands the last gradient bucket over (the default all-reduce runs)."""
        import torch

        # the HF Trainer's model_wrapped (its DDP wrapper once it made one); a callback built
        # without a trainer (None) has nothing to hook
        wrapped = getattr(self.trainer, "model_wrapped", None)
        if self._clock is not None or not isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
            return
        from ..clock import Clock

        # host stamps: the callback times micro-batches from the Trainer's host-side events (on
        # CUDA they are launch times; the trainer's own executor reads device events instead)
        clock = ReadyClock(Clock("cpu"))
        try:
            wrapped.register_comm_hook(clock, ReadyClock.hook)
        except RuntimeError:  # a hook is registered already (accelerate's comm_hook option)
            return
        self._clock = clock

    def check_args(self, args) -> None:
        """Refuse, in one line, a ``TrainingArguments`` value the plan was built from that has
        changed since ``sparsebalance.hf.enable``."""
        for name, (value, why) in self.fixed.items():
            # TrainingArguments fields (world_size is its property): names from enable's table
            now = getattr(args, name)
            if now != value:
                raise ValueError(
                    f"sparsebalance.hf: trainer.args.{name} is {now!r} but was {value!r} at "
                    f"sparsebalance.hf.enable ({why}): set it back to {value!r}, or set it before "
                    "sparsebalance.hf.enable (which plans once per model: build the model and the "
                    "Trainer again)"
                )

    def on_step_begin(self, args, state, control, **kwargs):
        self.check_args(args)
        if self._clock is not None:
            self._clock.last = None
        self._stamps = [time.perf_counter()]

    def on_substep_end(self, args, state, control, **kwargs):
        self._stamps.append(time.perf_counter())

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        ready = self._clock.last if self._clock is not None else None
        self._stamps.append(ready.host if ready is not None else time.perf_counter())

    def on_step_end(self, args, state, control, **kwargs):
        work = self.planner.current
        planned = [] if work is None else [t for t in work.tickets if not t.filler]
        if planned and not any(t.attention.stats for t in planned):
            raise ValueError(
                f"sparsebalance.hf: step {state.global_step} trained without SparseBalance's "
                "attention (no planned micro-batch reached it): the model's attention was "
                "switched away after sparsebalance.attach (set_attn_implementation?) or the "
                "model trained is not the attached one; attach the model the Trainer trains"
            )
        stamps, self._stamps = self._stamps, []
        seconds = [b - a for a, b in itertools.pairwise(stamps)]
        if work is None or len(seconds) != len(work.tickets):
            seconds = None  # not every micro-batch was seen (a step interrupted): not measured
        self.planner.finish(work, seconds)
