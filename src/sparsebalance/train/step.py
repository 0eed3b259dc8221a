"""One training step as a chain of typed stages (types in :mod:`.records`)::

    list[Sample] -plan-> StepPlan -tune-> TunedStep -execute-> LocalWork -synchronize->
    list[RankRecord] -update-> StepSummary, StepFeedback -> apply_feedback

plan (SAB), tune (DST), execute (forward/backward per micro-batch, :mod:`.execute`),
synchronize (gradient sync and the bubble, :mod:`.parallelize`), update (optimizer), feedback
(latency model and density estimator, :mod:`.feedback`). Every rank computes identical plans,
decisions, summaries and feedback.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ..batching import DensityEstimator, PlanConfig, plan_batch
from ..latency import LatencyModel
from ..parallel import watch
from ..tuning import DSTTuner, decide_units
from ..workload import CostModel, MicroBatch, Sample
from .config import TrainConfig
from .cp_unit import pass_schedule
from .execute import RankExecutor
from .feedback import apply_feedback
from .parallelize import Parallelized
from .records import (
    LocalWork,
    RankRecord,
    StepFeedback,
    StepPlan,
    StepResult,
    StepSummary,
    TunedStep,
)
from .runtime import Runtime


class NonFiniteLoss(RuntimeError):
    """More non-finite steps in a row than ``--max-nonfinite-steps``: the run stops (none of them
    was applied)."""


def label_weight(mb: MicroBatch, per_doc_weighting: bool) -> float:
    """Total loss weight of a micro-batch (what its loss sum is normalised by)."""
    if per_doc_weighting:
        return float(sum(1 for n in mb.lengths if n > 1))
    return float(sum(n - 1 for n in mb.lengths))


def check_plan_agreement(hashes: list[str], plan) -> None:
    """Raise ``RuntimeError`` unless every rank's plan hash (``hashes[r]``) is the same, naming
    the ranks that differ from the majority and the CP units (of this rank's plan) they are in."""
    if len(set(hashes)) == 1:
        return
    common = max(set(hashes), key=lambda h: (hashes.count(h), h))
    odd = [r for r, h in enumerate(hashes) if h != common]
    units = [f"unit {u.slot} (ranks {list(u.ranks)})" for u in plan.units
             if set(u.ranks) & set(odd)]  # fmt: skip
    where = f"; CP units they take part in: {', '.join(units)}" if units else ""
    raise RuntimeError(
        f"ranks {odd} derived a different plan from the other ranks (hashes {hashes}): their "
        f"inputs diverged, the step is stopped{where}"
    )


def plan_step(
    samples: list[Sample],
    cost: CostModel,
    pcfg: PlanConfig,
    estimator: DensityEstimator,
    all_gather: Callable[[object], list],
    per_doc_weighting: bool = False,
) -> StepPlan:
    """Stage 1 (SAB) of a step, shared by :class:`StepRunner` and the trainer integrations
    (:mod:`sparsebalance.integrations`): plan the global batch ``samples``, check with one
    ``all_gather`` (``obj -> [obj of every rank]``) that every rank derived the same plan, and
    count the global loss weight (every unit once)."""
    plan = plan_batch(samples, cost, pcfg, estimator=estimator)
    hashes = all_gather(plan.hash())
    check_plan_agreement(hashes, plan)
    units, rank_units = plan.execution()
    # Every unit once (a CP unit appears in each of its ranks' lists).
    weight = sum(label_weight(MicroBatch(u.sample_ids, u.lengths, u.densities),
                              per_doc_weighting) for u in units)  # fmt: skip
    return StepPlan(plan, hashes[0], weight, units, rank_units,
                    pass_schedule(units, rank_units))  # fmt: skip


def tune_step(
    planned: StepPlan,
    tuner: DSTTuner,
    latency: LatencyModel,
    cost: CostModel | None,
    world_size: int,
) -> TunedStep:
    """Stage 2 (DST) of a step: a budget per rank (per worker with CP units, priced by ``cost``,
    else ``latency``) and the loss scale ``world_size / global weight``."""
    plan = planned.plan
    t0 = time.perf_counter()
    if plan.units:  # workers = ranks joined by CP units, one budget each
        decision = decide_units(tuner, plan, cost or latency)
    else:
        decision = tuner.decide(plan.ranks, latency)
    return TunedStep(planned, decision, world_size / max(planned.global_weight, 1e-9),
                     time.perf_counter() - t0)  # fmt: skip


@dataclass
class StepRunner:
    """Runs :meth:`run` once per step; the :class:`~sparsebalance.train.Trainer` owns it."""

    cfg: TrainConfig
    rt: Runtime
    num_ranks: int
    """Ranks planned for: the process group's size, or ``--emulate-ranks``."""
    latency: LatencyModel
    estimator: DensityEstimator
    tuner: DSTTuner
    par: Parallelized
    executor: RankExecutor
    params: list[torch.nn.Parameter]
    """The trained parameters (what is synced, clipped and stepped)."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sample: Callable[[int], Sample]
    """Sample id -> :class:`Sample` (for the density estimator's feedback)."""
    cost: CostModel | None = None
    """What plans and DST price with: a ``ContextCost`` over ``latency`` for ``sab-cp`` (it
    prices documents split over k ranks); ``latency`` itself when None."""
    ranks_per_node: int | None = None
    """The run's topology (:class:`~sparsebalance.parallel.topology.Topology`): the planner keeps
    CP units inside a node where they fit; None: the cost model's links decide."""
    scaler: torch.amp.GradScaler | None = None
    """``--precision fp16``'s loss scaling (the executor scales every backward)."""
    nonfinite_in_a_row: int = field(default=0, init=False)
    """Consecutive steps skipped for a NaN/inf loss or gradient (0 after an applied step)."""

    def run(self, samples: list[Sample], step: int) -> StepResult:
        """Step number ``step`` (1-based) on ``samples`` (the global batch, same on every rank).

        Under torchrun each process runs its own rank. With ``--emulate-ranks R`` one process
        runs the R ranks' micro-batches in turn (each timed alone): the step time of R ranks is
        then ``max(rank compute) + sync``, a real measurement of compute imbalance.
        """
        t_step = time.perf_counter()
        with watch.at(step=step, unit=None, ring_step=None, where="the plan agreement"):
            tuned = self.tune(self.plan(samples))
            local = self.execute(tuned)
            with watch.at(where="the gradient sync", unit=None):
                records = self.synchronize(local)
        optim, skipped = self.update(records, step)
        feedback = StepFeedback.from_records(records)
        apply_feedback(feedback, self.latency, self.estimator, self.tuner.knob, self.sample,
                       use_timings=not self.cfg.deterministic, context=self.cost)  # fmt: skip
        summary = self.summarize(tuned, records, optim, time.perf_counter() - t_step)
        return StepResult(records, replace(summary, skipped_nonfinite=skipped), feedback)

    def plan(self, samples: list[Sample]) -> StepPlan:
        """SAB: samples -> ranks -> micro-batches; checks that every rank derived the same."""
        cfg = self.cfg
        pcfg = PlanConfig(self.num_ranks, cfg.micro_batches, cfg.capacity, cfg.strategy,
                          cfg.overlong, cp_degree=cfg.cp,
                          ranks_per_node=self.ranks_per_node)  # fmt: skip
        return plan_step(samples, self.cost or self.latency, pcfg, self.estimator,
                         self.rt.all_gather_object, cfg.per_doc_loss_weighting)  # fmt: skip

    def tune(self, planned: StepPlan) -> TunedStep:
        """DST: a budget per rank; and the loss scale that makes every rank's loss a share of
        the global token mean (the gradient sync averages over processes; emulated ranks
        accumulate into one set of gradients)."""
        return tune_step(planned, self.tuner, self.latency, self.cost, self.rt.world_size)

    def execute(self, tuned: TunedStep) -> LocalWork:
        """Forward + backward of this process's rank (or of every emulated rank), times in
        seconds after a mark taken now (every rank has just left the plan's all-gather)."""
        origin = self.executor.clock.mark()
        if self.cfg.emulate_ranks:
            runs = [self.executor.run(tuned, r, origin) for r in range(self.num_ranks)]
            for w in runs:
                w.records[0].relative_to(None)
            return LocalWork([w.records[0] for w in runs], runs[-1].ready_s, runs[-1].done_s)
        with watch.at(where="its units"):
            return self.executor.run(tuned, self.rt.rank, origin)

    def synchronize(self, local: LocalWork) -> list[RankRecord]:
        """Gradients synced on every rank; every rank's record with its bubble and sync time.

        ``--measure-bubble exact``: a barrier (the bubble), then the all-reduce (timed alone).
        ``overlap``: the sync already ran inside the last backward; from the ranks' stamps,
        ``bubble = max(ready) - ready`` and ``sync = done - max(ready)``.
        Emulated ranks: no wait; the sync is the profile's all-reduce figure (0 if none).
        """
        if self.cfg.emulate_ranks:
            sync = float(self.latency.profile.allreduce_seconds or 0.0)
            for rec in local.records:
                rec.bubble_s, rec.sync_s = 0.0, sync
            records = local.records
        elif self.par.exact:
            (rec,) = local.records
            clock = self.par.clock  # device marks: the all-reduce's time, not its launch
            t0 = clock.mark()
            self.rt.barrier()  # the wait for the slowest rank: the bubble
            t1 = clock.mark()
            self.par.sync_gradients(self.params)
            t2 = clock.mark()
            clock.synchronize()
            rec.bubble_s, rec.sync_s = clock.seconds(t0, t1), clock.seconds(t1, t2)
            records = self.rt.all_gather_object(rec)
        else:
            works = self.rt.all_gather_object(local)
            slowest = max(w.ready_s for w in works)
            records = [w.records[0] for w in works]
            for rec, w in zip(records, works, strict=True):
                rec.bubble_s, rec.sync_s = slowest - w.ready_s, max(w.done_s - slowest, 0.0)
        peak = max(r.compute_s for r in records)
        for rec in records:
            rec.derived_bubble_s = float(peak - rec.compute_s)
        return records

    def update(self, records: list[RankRecord], step: int) -> tuple[float, bool]:
        """Clip, optimizer and scheduler step; returns the seconds it took and whether the step
        was skipped.

        The step's one check for non-finite values, on the device, read once here at the step's
        end (the attention kernels do no per-call containment: ``ops/block_sparse_flex.py``):
        the global loss, and the global gradient norm (which clipping computes anyway; fp16's
        loss scaler checks its own). A non-finite step drops its gradients and applies nothing
        (the scheduler still advances: the step's data was consumed); more than
        ``--max-nonfinite-steps`` of them in a row raise :class:`NonFiniteLoss`. Every rank
        sees the same loss and the same synced gradients, so every rank decides the same."""
        t0 = time.perf_counter()
        loss, scaler = self.global_loss(records), self.scaler
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
            if scaler.get_scale() < before and self.rt.is_main:
                print(f"sparsebalance train: step {step}: fp16 gradients overflowed at loss scale "
                      f"{before:g}: optimizer step skipped, scale now {scaler.get_scale():g}",
                      file=sys.stderr, flush=True)  # fmt: skip
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, False

    def _grad_norm(self) -> float:
        """The global gradient norm, clipped to ``--grad-clip`` if set (one read back)."""
        if self.cfg.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        else:
            grads = [p.grad for p in self.params if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if hasattr(norm, "full_tensor"):  # FSDP2: a sharded norm
            norm = norm.full_tensor()
        return float(norm)

    def _skip(self, step: int, what: str, t0: float) -> float:
        """Drop the step's gradients, count it, say so; stop past ``--max-nonfinite-steps``."""
        self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite_in_a_row += 1
        limit = self.cfg.max_nonfinite_steps
        if self.nonfinite_in_a_row > limit:
            raise NonFiniteLoss(
                f"{what} at step {step}, the {self.nonfinite_in_a_row} non-finite step(s) in a "
                f"row (--max-nonfinite-steps {limit}); none of them was applied"
            )
        if self.rt.is_main:
            print(f"sparsebalance train: step {step}: {what}: step skipped, nothing applied "
                  f"({self.nonfinite_in_a_row} in a row, --max-nonfinite-steps {limit})",
                  file=sys.stderr, flush=True)  # fmt: skip
        self.scheduler.step()
        return time.perf_counter() - t0

    @staticmethod
    def global_loss(records: list[RankRecord]) -> float:
        """Mean token loss over all ranks."""
        return sum(r.loss_sum for r in records) / max(sum(r.weight for r in records), 1e-9)

    def summarize(
        self, tuned: TunedStep, records: list[RankRecord], optim: float, elapsed: float
    ) -> StepSummary:
        """The step over all ranks (``elapsed``: wall seconds of the whole step)."""
        cfg, decision, plan = self.cfg, tuned.decision, tuned.planned.plan
        computes = np.array([r.compute_s for r in records])
        if cfg.emulate_ranks:  # the emulated cluster's step: slowest rank, then sync and optimizer
            elapsed = float(computes.max()) + records[0].sync_s + optim
        tokens = sum(r.tokens for r in records)
        peak, mean = max(float(computes.max()), 1e-12), float(computes.mean())
        return StepSummary(
            loss=self.global_loss(records),
            step_seconds=elapsed,
            max_compute_s=float(computes.max()),
            mean_compute_s=mean,
            efficiency=mean / peak,
            imbalance=peak / max(mean, 1e-12),
            bubble_fraction=1 - mean / peak,
            tokens=tokens,
            tokens_per_s=tokens / elapsed,
            optimizer_s=optim,
            mean_density=float(np.mean([r.density for r in records])),
            dst_anchor_seconds=decision.targets.anchor_seconds,
            dst_post_cut_seconds=decision.targets.post_cut_seconds,
            dst_budget_cut=decision.budget_cut,
            dst_budget_given=decision.budget_given,
            predicted_max_before_s=decision.step_seconds_before,
            predicted_max_s=decision.step_seconds_after,
            plan_hash=tuned.planned.plan_hash,
            strategy=cfg.strategy,
            dst_mode=cfg.dst.mode,
            plan_efficiency=plan.metrics.efficiency,
            num_overlong=plan.metrics.num_overlong,
            num_split_chunks=plan.metrics.num_split_chunks,
            plan_s=plan.metrics.plan_seconds,
            dst_s=tuned.dst_seconds,
            dst_layer_s=max(r.dst_layer_s for r in records),
            overhead_s=plan.metrics.plan_seconds
            + tuned.dst_seconds
            + max(r.dst_layer_s for r in records),
            budget_kind=self.tuner.knob.kind,
            coverage_limited=sum(r.coverage_limited for r in records),
            cp_documents=tuple(
                {
                    "id": i,
                    "offset": o,
                    "tokens": n,
                    "degree": u.degree,
                    "ranks": list(u.ranks),
                    "ring": u.ring,
                }
                for u in plan.units
                for i, o, n in zip(u.sample_ids, u.offsets, u.lengths, strict=True)
            ),
            lr=self.scheduler.get_last_lr()[0],
            emulated=bool(cfg.emulate_ranks),
        )
