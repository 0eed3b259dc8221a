"""The own loop's training step (``sparsebalance train``): the engine's stages plus execution,
gradient sync and the optimizer update::

    list[Sample] -plan-> StepPlan -tune-> TunedStep -execute-> LocalWork -synchronize->
    list[RankRecord] -update-> StepReport, StepFeedback -> feedback

plan and tune (SAB, DST: :class:`~.engine.StepEngine`), execute (forward/backward per
micro-batch, :mod:`.execute`), synchronize (gradient sync and the bubble, :mod:`.parallelize`),
update (optimizer, :class:`Updater`), feedback (latency model and density estimator). Every rank
computes identical plans, decisions, summaries and feedback. The trainer integrations run the same
stages through the engine and leave execution and the update to the other trainer.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..parallel import watch
from ..workload import Sample
from .engine import StepEngine
from .execute import RankExecutor
from .parallelize import Parallelized
from .records import LocalWork, RankRecord, TunedStep
from .runtime import Runtime
from .summary import StepReport, StepResult, derive_bubbles


class NonFiniteLoss(RuntimeError):
    """More non-finite steps in a row than ``--max-nonfinite-steps``: the run stops (none of them
    was applied)."""


@dataclass(frozen=True)
class UpdateConfig:
    """How the optimizer step is taken."""

    grad_clip: float = 1.0
    """Global gradient-norm clip (0 = off)."""
    max_nonfinite_steps: int = 3
    """Non-finite steps in a row that are skipped; the next one stops the run."""


@dataclass
class Updater:
    """Clip, optimizer and scheduler step, with the step's one check for non-finite values."""

    params: list[torch.nn.Parameter]
    """The trained parameters (what is synced, clipped and stepped)."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    config: UpdateConfig = field(default_factory=UpdateConfig)
    scaler: torch.amp.GradScaler | None = None
    """``--precision fp16``'s loss scaling (the executor scales every backward)."""
    is_main: bool = True
    """This rank says what it skipped (rank 0)."""
    norm: Callable[[float], float] | None = None
    """The whole model's gradient norm, clipping to its argument when above 0, where this rank
    holds part of the model (a pipeline stage: :meth:`.PipelineExecutor.grad_norm`); None: from
    ``params``."""
    keep_gradients: bool = False
    """Zero the gradients in place after a step instead of dropping them (DDP's are views of its
    all-reduce buckets: :attr:`.Parallelized.keeps_gradients`)."""
    nonfinite_in_a_row: int = field(default=0, init=False)
    """Consecutive steps skipped for a NaN/inf loss or gradient (0 after an applied step)."""

    def update(self, loss: float, step: int) -> tuple[float, bool]:
        """Clip, optimizer and scheduler step for a step of global ``loss``; returns the seconds
        it took and whether the step was skipped.

        The step's one check for non-finite values, on the device, read once here at the step's
        end (the attention kernels do no per-call containment: ``ops/block_sparse_flex.py``):
        the global loss, and the global gradient norm (which clipping computes anyway; fp16's
        loss scaler checks its own). A non-finite step drops (or, kept, zeroes) its gradients and applies nothing
        (the scheduler still advances: the step's data was consumed); more than
        ``max_nonfinite_steps`` of them in a row raise :class:`NonFiniteLoss`. Every rank sees
        the same loss and the same synced gradients, so every rank decides the same."""
        t0 = time.perf_counter()
        scaler = self.scaler
        if scaler is not None and math.isfinite(loss):  # fp16: true gradients before clipping
            scaler.unscale_(self.optimizer)
        norm = self._grad_norm() if math.isfinite(loss) else None
        if norm is not None and not math.isfinite(norm) and scaler is None:
            return self._skip(step, f"non-finite gradients (norm {norm})", t0), True
        if not math.isfinite(loss):
            return self._skip(step, f"non-finite loss ({loss})", t0), True
        self.nonfinite_in_a_row = 0
        if scaler is None:
            self.optimizer.step()
        else:
            before = scaler.get_scale()
            scaler.step(self.optimizer)
            scaler.update()
            if scaler.get_scale() < before and self.is_main:
                print(
                    f"sparsebalance train: step {step}: fp16 gradients overflowed at loss scale "
                    f"{before:g}: optimizer step skipped, scale now {scaler.get_scale():g}",
                    file=sys.stderr,
                    flush=True,
                )
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=not self.keep_gradients)
        return time.perf_counter() - t0, False

    def _grad_norm(self) -> float:
        """The global gradient norm, clipped to ``grad_clip`` if set (one read back)."""
        if self.norm is not None:
            return self.norm(self.config.grad_clip)
        if self.config.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.config.grad_clip)
        else:
            grads = [p.grad for p in self.params if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        # torch's norm is a DTensor under FSDP2 (sharded; gathered here), a plain tensor otherwise
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    def _skip(self, step: int, what: str, t0: float) -> float:
        """Drop (or zero, when kept) the step's gradients, count it, say so; stop past ``max_nonfinite_steps``."""
        self.optimizer.zero_grad(set_to_none=not self.keep_gradients)
        self.nonfinite_in_a_row += 1
        limit = self.config.max_nonfinite_steps
        if self.nonfinite_in_a_row > limit:
            raise NonFiniteLoss(
                f"{what} at step {step}, the {self.nonfinite_in_a_row} non-finite step(s) in a "
                f"row (--max-nonfinite-steps {limit}); none of them was applied"
            )
        if self.is_main:
            print(
                f"sparsebalance train: step {step}: {what}: step skipped, nothing applied "
                f"({self.nonfinite_in_a_row} in a row, --max-nonfinite-steps {limit})",
                file=sys.stderr,
                flush=True,
            )
        self.scheduler.step()
        return time.perf_counter() - t0


@dataclass
class StepRunner:
    """Runs :meth:`run` once per step; the :class:`~sparsebalance.train.Trainer` owns it."""

    engine: StepEngine
    executor: RankExecutor
    updater: Updater
    par: Parallelized
    rt: Runtime
    emulated: bool = False
    """``--emulate-ranks``: this one process runs every planned rank in turn."""
    labels: tuple[str, str] = ("", "")
    """(strategy, DST mode) as the summary names them."""
    stages: int = 1
    """``--pp``: processes per planned rank (a pipeline's stages; they share one record)."""

    @property
    def num_ranks(self) -> int:
        return self.engine.num_ranks

    @property
    def tuner(self):
        return self.engine.tuner

    def run(
        self,
        samples: list[Sample] | TunedStep,
        step: int,
        ahead: Callable[[], None] | None = None,
    ) -> StepResult:
        """Step number ``step`` (1-based) on ``samples`` (the global batch, same on every rank),
        or on the step :meth:`StepEngine.begin` already planned and tuned from them.

        Under torchrun each process runs its own rank. With ``--emulate-ranks R`` one process
        runs the R ranks' micro-batches in turn (each timed alone): the step time of R ranks is
        then ``max(rank compute) + sync``, a real measurement of compute imbalance. ``ahead``
        (``--plan-ahead``): host work (the next step's plan) run once this step's work is
        launched, before the host waits for the device.
        """
        t_step = time.perf_counter()
        with watch.at(step=step, unit=None, ring_step=None, where="the plan agreement"):
            tuned = samples if isinstance(samples, TunedStep) else self.engine.begin(samples)
            local = self.execute(tuned, ahead)
            with watch.at(where="the gradient sync", unit=None):
                records = self.synchronize(local)
        optim, skipped = self.updater.update(self.global_loss(records), step)
        feedback = self.engine.feedback(records)
        report = self.summarize(tuned, records, optim, time.perf_counter() - t_step, step, skipped)
        return StepResult(records, report, feedback)

    def execute(self, tuned: TunedStep, ahead: Callable[[], None] | None = None) -> LocalWork:
        """Forward + backward of this process's rank (or of every emulated rank), times in
        seconds after a mark taken now (every rank has just left the plan's all-gather);
        ``ahead`` runs once, after the last rank's work is launched."""
        origin = self.executor.clock.mark()
        if self.emulated:
            last = self.num_ranks - 1
            runs = [self.executor.run(tuned, r, origin, ahead if r == last else None) for r in range(self.num_ranks)]
            for w in runs:
                w.records[0].relative_to(None)
            return LocalWork([w.records[0] for w in runs], runs[-1].ready_s, runs[-1].done_s)
        with watch.at(where="its units"):
            return self.executor.run(tuned, self.rt.rank, origin, ahead)

    def synchronize(self, local: LocalWork) -> list[RankRecord]:
        """Gradients synced on every rank; every rank's record with its bubble and sync time.

        ``--measure-bubble exact``: a barrier (the bubble), then the all-reduce (timed alone).
        ``overlap``: the sync already ran inside the last backward; from the ranks' stamps,
        ``bubble = max(ready) - ready`` and ``sync = done - max(ready)``.
        Emulated ranks: no wait; the sync is the profile's all-reduce figure (0 if none).
        """
        if self.emulated:
            sync = float(self.engine.latency.profile.allreduce_seconds or 0.0)
            for rec in local.records:
                rec.bubble_s, rec.sync_s = 0.0, sync
            records = local.records
        elif self.par.exact:
            (rec,) = local.records
            clock = self.par.clock  # device marks: the all-reduce's time, not its launch
            t0 = clock.mark()
            self.rt.barrier()  # the wait for the slowest rank: the bubble
            t1 = clock.mark()
            self.par.sync_gradients(self.updater.params)
            t2 = clock.mark()
            clock.synchronize()
            rec.bubble_s, rec.sync_s = clock.seconds(t0, t1), clock.seconds(t1, t2)
            records = self.rt.all_gather_object(rec)
        else:
            works = self.rt.all_gather_object(local)[:: self.stages]  # one per pipeline
            slowest = max(w.ready_s for w in works)
            records = [w.records[0] for w in works]
            for rec, w in zip(records, works, strict=True):
                rec.bubble_s, rec.sync_s = slowest - w.ready_s, max(w.done_s - slowest, 0.0)
        derive_bubbles(records)
        return records

    @staticmethod
    def global_loss(records: list[RankRecord]) -> float:
        """Mean token loss over all ranks."""
        return sum(r.loss_sum for r in records) / max(sum(r.weight for r in records), 1e-9)

    def summarize(
        self, tuned: TunedStep, records: list[RankRecord], optim: float, elapsed: float, step: int, skipped: bool
    ) -> StepReport:
        """The step's report over all ranks (``elapsed``: wall seconds of the whole step)."""
        if self.emulated:  # the emulated cluster's step: slowest rank, then sync and optimizer
            elapsed = max(r.compute_s for r in records) + records[0].sync_s + optim
        return StepReport.of(
            tuned,
            records,
            step=step,
            strategy=self.labels[0],
            dst_mode=self.labels[1],
            budget_kind=self.tuner.knob.kind,
            loss=self.global_loss(records),
            step_seconds=elapsed,
            tokens_per_s=sum(r.tokens for r in records) / elapsed,
            optimizer_s=optim,
            lr=self.updater.scheduler.get_last_lr()[0],
            emulated=self.emulated,
            skipped_nonfinite=skipped,
        )
