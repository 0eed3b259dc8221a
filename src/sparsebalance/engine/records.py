"""What flows through one training step, stage by stage (the engine's stage types)::

    list[Sample] --plan--> StepPlan --tune--> TunedStep --execute--> LocalWork
      --synchronize--> list[RankRecord] --update--> StepResult (StepReport + StepFeedback)

- :class:`StepPlan`: the SAB plan of one global batch, agreed by every rank (hash checked).
- :class:`TunedStep`: the plan plus DST's :class:`~sparsebalance.tuning.StepDecision` and the
  loss scale every rank's backward uses.
- :class:`MicroBatchResult`: one forward + backward: measured time, densities, budgets, loss.
- :class:`LocalWork`: what this process ran (its own rank, or every emulated rank) before the
  gradient sync, with the timestamps the bubble is derived from.
- :class:`RankRecord`: one rank's share of the step, as logged (one ``metrics.jsonl`` line).
- :class:`~.summary.StepReport` (in :mod:`.summary`): the step over all ranks (the ``"rank": "all"``
  line, and every other front end's step log).
- :class:`StepFeedback`: every measured micro-batch in rank order, what recalibrates the latency
  model and the density estimator.

The JSON field names are those ``sparsebalance report`` and earlier runs use.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch

from ..batching import Plan, Unit
from ..models.attention import read_stats
from ..tuning import RankDecision, StepDecision


@dataclass(frozen=True)
class StepPlan:
    """Stage 1 (plan): the global batch assigned to ranks and micro-batches."""

    plan: Plan
    plan_hash: str
    """16 hex digits, identical on every rank (checked with one all-gather)."""
    global_weight: float
    """Total loss weight of the global batch over all ranks (the loss normaliser)."""
    units: tuple[Unit, ...] = ()
    """``plan.execution()``'s units: CP units (k > 1) first, then every one-rank micro-batch."""
    rank_units: tuple[tuple[int, ...], ...] = ()
    """Per rank, its units (indices into ``units``) in slot order."""
    rounds: tuple[tuple[int | None, ...], ...] = ()
    """Per rank, the unit run at each pass round, None for a gap
    (:func:`~sparsebalance.engine.cp_unit.pass_schedule`)."""


@dataclass(frozen=True)
class TunedStep:
    """Stage 2 (tune): the plan with DST's budgets."""

    planned: StepPlan
    decision: StepDecision
    loss_scale: float
    """Multiplies each micro-batch's loss sum before its backward: ``world_size / global_weight``
    (the gradient sync averages over processes, so the result is the global token mean)."""
    dst_seconds: float = 0.0
    """Wall seconds of DST's step-level decision."""
    ahead: bool = False
    """Planned and tuned before the previous step's feedback (``--plan-ahead``): its layer
    controllers re-base the decision's targets on the latency model they price with."""


@dataclass(frozen=True)
class MicroBatchResult:
    """One micro-batch's forward + backward on one rank."""

    seconds: float
    """Measured forward + backward (the wait for other ranks excluded where it can be told)."""
    lengths: tuple[int, ...]
    """``(N,)`` tokens per document of the pack."""
    sample_ids: tuple[int, ...]
    """``(N,)`` the documents' sample ids."""
    layer_densities: tuple[tuple[float, ...], ...]
    """``(num_layers, N)`` realized attention density per layer and document."""
    budgets: tuple[float, ...]
    """``(num_layers,)`` the budget (knob value: k or gamma) each layer ran with."""
    loss_sum: float
    """Weighted sum of the token losses (before the loss scale)."""
    weight_sum: float
    """Sum of the token loss weights."""
    slot: int = -1
    """The unit's slot in the plan's execution order (:meth:`Plan.execution`); -1 if unknown."""
    unit_ranks: tuple[int, ...] = ()
    """``(k,)`` the ranks of the unit in ring order; ``()`` = this rank alone (k = 1)."""
    ring: str = "none"
    """``none`` (one rank), ``flat`` or ``hierarchical``: how the unit's attention ran."""
    ring_wait_s: float = 0.0
    """Seconds this rank waited inside the unit (for its peers to arrive and for ring transfers
    its own compute did not hide); part of ``seconds``."""
    start_s: float | None = None
    """When the micro-batch started, in seconds after the step's plan agreement (a mark of the
    run's clock: device time on CUDA; comparable across ranks, see :class:`LocalWork`); None where
    it was not stamped (emulated ranks, :meth:`RankRecord.relative_to`)."""
    local_tokens: int = 0
    """Tokens this rank held: its shard's real tokens for a CP unit (whose ``lengths`` are the
    unit's whole documents); 0 = ``sum(lengths)``."""
    stage_seconds: tuple[tuple[float, float], ...] = ()
    """``--pp P``: ``(P, 2)`` the micro-batch's forward and backward seconds on each pipeline
    stage, in stage order (they sum to ``seconds``; what the stages' closed loop learns from,
    :mod:`.stage_calibration`); ``()`` without a pipeline."""

    @classmethod
    def from_stats(cls, seconds: float, lengths, sample_ids, stats, loss_sum, weight_sum, **extra) -> MicroBatchResult:
        """The result of a micro-batch whose attention layers left ``stats``
        (:class:`~sparsebalance.models.attention.LayerStats`, read in one host read: callers do
        it at the step's end, with ``loss_sum`` and ``weight_sum`` where they are device
        tensors); ``extra``: the other fields (slot, CP unit, start, ring wait)."""
        sums = [x for x in (loss_sum, weight_sum) if isinstance(x, torch.Tensor)]
        budgets, densities, _, read = read_stats(list(stats), *sums)  # one read
        read = iter(read)
        loss_sum, weight_sum = (next(read) if isinstance(x, torch.Tensor) else float(x) for x in (loss_sum, weight_sum))
        return cls(
            seconds=float(seconds),
            lengths=tuple(lengths),
            sample_ids=tuple(sample_ids),
            layer_densities=tuple(tuple(d) for d in densities),
            budgets=tuple(budgets),
            loss_sum=loss_sum,
            weight_sum=weight_sum,
            **extra,
        )

    @property
    def density(self) -> float | None:
        """The micro-batch's realized density over its layers: per layer the documents' densities
        weighted by length² (each document's share of the attention work), then the mean over
        layers; None without layers."""
        if not self.layer_densities:
            return None
        w = np.asarray(self.lengths, dtype=np.float64) ** 2
        dens = np.asarray(self.layer_densities, dtype=np.float64)  # (layers, N)
        return float((dens @ w).mean() / w.sum()) if w.sum() > 0 else float(dens.mean())

    @property
    def degree(self) -> int:
        """k, the number of ranks that ran this micro-batch together (1 = data parallel)."""
        return max(len(self.unit_ranks), 1)

    @property
    def tokens(self) -> int:
        """Tokens this rank ran (its shard's for a CP unit)."""
        return self.local_tokens or sum(self.lengths)

    def unit_json(self) -> dict:
        """What ``metrics.jsonl`` says about the unit (one entry of a rank's ``units``)."""
        return {
            "slot": self.slot,
            "ranks": list(self.unit_ranks),
            "degree": self.degree,
            "ring": self.ring,
            "sample_ids": list(self.sample_ids),
            "tokens": self.tokens,
            "start_s": self.start_s,
            "seconds": self.seconds,
            "ring_wait_s": self.ring_wait_s,
            "density": self.density,
            # pipelines only: [forward, backward] seconds per stage
            **({"stage_s": [list(fb) for fb in self.stage_seconds]} if self.stage_seconds else {}),
        }


@dataclass
class RankRecord:
    """One rank's share of a step: one ``metrics.jsonl`` line (``to_json``), field order kept."""

    rank: int
    compute_s: float
    """Sum of the rank's micro-batch seconds."""
    tokens: int
    microbatch_s: list[float]
    predicted_before_s: float
    """Predicted seconds at the base budget (before DST)."""
    predicted_s: float
    """Predicted seconds at the rank's budget."""
    budget: float
    """The rank's step-level budget (k or gamma)."""
    dst_role: str
    target_s: float
    budget_min: float
    """Over the rank's (micro-batch, layer) units."""
    budget_mean: float
    budget_max: float
    density: float
    """Realized density of the rank's attention work: its micro-batches' densities
    (:attr:`MicroBatchResult.density`, length²-weighted) weighted by their documents' length²."""
    bubble_s: float = 0.0
    """Measured wait for the slowest rank (see :class:`LocalWork`)."""
    sync_s: float = 0.0
    """Gradient sync seconds after the slowest rank was ready."""
    derived_bubble_s: float = 0.0
    """``max(compute_s over ranks) - compute_s``."""
    ring_wait_s: float = 0.0
    """Sum of the rank's waits inside context-parallel units (part of ``compute_s``)."""
    units: list[dict] = field(default_factory=list)
    """One entry per micro-batch in execution order (:meth:`MicroBatchResult.unit_json`): slot,
    the unit's ranks and degree k, ring kind, sample ids, tokens on this rank, start, seconds and
    ring wait (and with ``--pp``, ``stage_s``: [forward, backward] seconds per stage). Appended
    after the earlier fields: older readers see the same first fields."""
    dst_layer_s: float = 0.0
    """Seconds DST's layer controllers spent deciding this rank's budgets (part of compute_s)."""
    coverage_limited: int = 0
    """Layer decisions where the coverage bound p stopped a cut the time target asked for."""
    stages: list[dict] = field(default_factory=list)
    """``--pp P``: one entry per pipeline stage of this (data-parallel) rank, ``{stage, busy_s,
    idle_s, chunks}``: its forward + backward seconds, its bubble (the pipeline's span less its busy
    time) and its chunks of layers (``--pp-virtual``; 1: plain 1F1B); empty without a pipeline."""
    loss_sum: float = field(default=0.0, repr=False)
    weight: float = field(default=0.0, repr=False)
    microbatches: tuple[MicroBatchResult, ...] = field(default=(), repr=False)

    _NOT_LOGGED = ("loss_sum", "weight", "microbatches")

    @classmethod
    def from_results(cls, decision: RankDecision, results: list[MicroBatchResult]) -> RankRecord:
        """Aggregate one rank's micro-batch results under its DST decision."""
        layer_budgets = [g for r in results for g in r.budgets]
        parts = [
            (r.density, float(np.sum(np.asarray(r.lengths, dtype=np.float64) ** 2)))
            for r in results
            if r.density is not None
        ]
        weight = sum(w for _, w in parts)
        density = sum(d * w for d, w in parts) / weight if weight > 0 else 0.0
        return cls(
            rank=decision.rank,
            compute_s=sum(r.seconds for r in results),
            tokens=sum(r.tokens for r in results),
            microbatch_s=[r.seconds for r in results],
            predicted_before_s=decision.predicted_before,
            predicted_s=decision.predicted_after,
            budget=decision.budget,
            dst_role=decision.role,
            target_s=decision.target_seconds,
            budget_min=min(layer_budgets, default=decision.budget),
            budget_mean=float(np.mean(layer_budgets)) if layer_budgets else decision.budget,
            budget_max=max(layer_budgets, default=decision.budget),
            density=float(density),
            ring_wait_s=sum(r.ring_wait_s for r in results),
            units=[r.unit_json() for r in results],
            loss_sum=sum(r.loss_sum for r in results),
            weight=sum(r.weight_sum for r in results),
            microbatches=tuple(results),
        )

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in self._NOT_LOGGED}

    def relative_to(self, t0: float | None) -> None:
        """Micro-batch starts as seconds after ``t0`` (the step's plan agreement, a
        ``perf_counter`` stamp); ``None`` drops them (emulated ranks run in turn: their stamps
        would not be a schedule)."""
        self.microbatches = tuple(
            replace(mb, start_s=None if t0 is None or mb.start_s is None else mb.start_s - t0)
            for mb in self.microbatches
        )
        self.units = [mb.unit_json() for mb in self.microbatches]


@dataclass
class LocalWork:
    """Stage 3 (execute): the ranks this process ran, before the gradient sync.

    Times are seconds after a mark taken when the step's plan agreement (an all-gather every rank
    leaves together) returned, so they compare across ranks without a shared clock; they are the
    run's clock (:mod:`sparsebalance.clock`): ``perf_counter`` on CPU, CUDA events on the compute
    stream on a GPU, read after the rank's one synchronize.
    """

    records: list[RankRecord]
    """One record per rank run here: this process's rank, or all ranks with ``--emulate-ranks``."""
    ready_s: float = 0.0
    """When this rank's gradients were computed (the last gradient bucket was handed to the
    overlapped sync, or the last backward returned)."""
    done_s: float = 0.0
    """When this rank's gradients were synchronized (its last backward returned)."""


@dataclass(frozen=True)
class StepFeedback:
    """Every rank's measured micro-batches, in rank order (identical on every rank)."""

    microbatches: tuple[MicroBatchResult, ...]

    @classmethod
    def from_records(cls, records: list[RankRecord]) -> StepFeedback:
        return cls(tuple(mb for rec in records for mb in rec.microbatches))
