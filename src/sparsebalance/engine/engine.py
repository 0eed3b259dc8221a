"""``StepEngine``: the one seam every front end touches, the same on every rank.

It holds the latency model, the density estimator, DST's tuner and (for context-parallel plans)
the cost model that prices split documents, and answers three verbs per step::

    samples --begin--> TunedStep                 (SAB's plan, agreed by every rank; DST's budgets)
    (tuned, rank, micro-batch, pack) --attention--> PackedAttention
                                                 (budget, DST's layer controller and timer, dense
                                                  promotion, fillers, CP units: decided here)
    (tuned, rank, results) --finish--> StepReport
                                                 (every rank's records, bubbles, feedback)

``sparsebalance train``'s :class:`~.step.StepRunner` runs a tuned step with its own executor,
syncs gradients itself and then calls :meth:`StepEngine.feedback`; the integrations hand this
rank's micro-batches to another trainer's loop and report their times back through
:meth:`StepEngine.finish`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ..batching import DensityEstimator, PlanConfig, make_estimator, plan_batch
from ..batching.schedule import resolve_layers
from ..latency import LatencyModel
from ..models.attention import PackedAttention
from ..ops import Budget
from ..tuning import DSTConfig, DSTTuner, LayerController, decide_units
from ..workload import CostModel, MicroBatch, Sample
from .cp_unit import pass_schedule
from .feedback import apply_feedback
from .kernel import Kernel
from .layers import LayerTimer, layer_feedback, packed_attention
from .records import MicroBatchResult, RankRecord, StepFeedback, StepPlan, TunedStep
from .stage_calibration import StageCalibration
from .summary import StepReport, derive_bubbles

FILLER_BUDGET = Budget(gamma=1.0)
"""A filler micro-batch's (two tokens, no target): every causal block."""


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
    units = [f"unit {u.slot} (ranks {list(u.ranks)})" for u in plan.units if set(u.ranks) & set(odd)]
    where = f"; CP units they take part in: {', '.join(units)}" if units else ""
    raise RuntimeError(
        f"ranks {odd} derived a different plan from the other ranks (hashes {hashes}): their "
        f"inputs diverged, the step is stopped{where}"
    )


@dataclass
class _StepLayers:
    """DST's layer controllers of one tuned step, built on a rank's first :meth:`attention`."""

    tuned: TunedStep
    solo: dict[int, LayerController | None] = field(default_factory=dict)
    """Rank -> the controller of its one-rank micro-batches (None: budgets fixed)."""
    units: dict[tuple[int, int], LayerController] = field(default_factory=dict)
    """(rank, unit) -> the controller of a CP unit this rank takes part in."""

    def of(self, rank: int) -> list[LayerController]:
        mine = [self.solo[rank]] if self.solo.get(rank) is not None else []
        return mine + [c for (r, _), c in self.units.items() if r == rank]


class StepEngine:
    """The step's verbs over the run's models (see the module docstring).

    Args:
        plan: how a global batch is planned (:class:`~sparsebalance.batching.PlanConfig`).
        latency: the latency model (the same on every rank; :func:`~.startup.load_latency_model`).
        dst: DST's settings (the tuner and its knob are built from them and the kernel's block).
        sample: sample id -> :class:`Sample` (length and source, for the estimator's feedback).
        kernel: the run's attention kernel (:func:`~.kernel.resolve_kernel`): its block size
            (the knob states top-k budgets in tokens), backend and GQA mode reach every
            attention context; its device is where the micro-batches train: off the CPU nothing
            inside a step may wait for it (DST's layer controllers decide on it), and only on
            the CPU do layer host times feed DST's closed loop.
        world_size: the processes whose gradient sync averages (the loss scale's numerator).
        estimator: the density estimator SAB plans with, or its ``--estimator`` name.
        all_gather: ``obj -> [obj of every rank]`` (one rank: ``[obj]``).
        cost: what plans and DST price with, when not ``latency`` itself (``sab-cp``'s
            ``ContextCost``, which prices documents split over several ranks).
        per_doc_weighting: every document's tokens share one total loss weight (LongAlign).
        deterministic: no measured time enters any decision.
    """

    def __init__(
        self,
        plan: PlanConfig,
        latency: LatencyModel,
        dst: DSTConfig,
        sample: Callable[[int], Sample],
        *,
        kernel: Kernel,
        world_size: int,
        estimator: DensityEstimator | str = "auto",
        all_gather: Callable[[object], list] | None = None,
        cost: CostModel | None = None,
        per_doc_weighting: bool = False,
        deterministic: bool = False,
    ) -> None:
        self.config = plan
        self.latency = latency
        self.kernel = kernel
        self.tuner = DSTTuner(dst, block_size=kernel.block_size)
        self.estimator = make_estimator(estimator, self.tuner.knob) if isinstance(estimator, str) else estimator
        self.sample = sample
        self.block_size, self.backend, self.device = kernel.block_size, kernel.backend, kernel.device
        self.world_size = world_size
        self.all_gather = all_gather or (lambda obj: [obj])
        self.cost = cost
        self.per_doc_weighting, self.deterministic = per_doc_weighting, deterministic
        self.layer_times = layer_feedback(dst, deterministic, self.device)
        """DST's closed loop gets measured layer host times (CPU, not deterministic)."""
        self.stage_calibration = StageCalibration(plan.pipeline_stages)
        """``--pp``: the pipeline stages' learned pricing (backward ratio, a scale per stage)."""
        self._layers: list[_StepLayers] = []  # the last two steps' (a loader may run ahead)

    @property
    def num_ranks(self) -> int:
        return self.config.world_size

    @property
    def knob(self):
        return self.tuner.knob

    # ------------------------------------------------------------------ begin
    def begin(self, samples: list[Sample], ahead: bool = False) -> TunedStep:
        """Plan (SAB) and tune (DST) the global batch ``samples``: every rank derives the same
        plan (one all-gather checks it), a budget per rank (per worker with CP units, per
        micro-batch of a pipeline) and the loss scale ``world_size / global weight``.
        ``ahead``: planned before the previous step's feedback (``--plan-ahead``)."""
        return self._tune(self.plan(samples), ahead)

    def plan(self, samples: list[Sample]) -> StepPlan:
        """SAB alone: samples -> ranks -> micro-batches; every rank derived the same (checked)."""
        plan = plan_batch(samples, self.cost or self.latency, self.planning_config(), estimator=self.estimator)
        hashes = self.all_gather(plan.hash())
        check_plan_agreement(hashes, plan)
        units, rank_units = plan.execution()
        # Every unit once (a CP unit appears in each of its ranks' lists).
        weight = sum(
            label_weight(MicroBatch(u.sample_ids, u.lengths, u.densities), self.per_doc_weighting) for u in units
        )
        return StepPlan(plan, hashes[0], weight, units, rank_units, pass_schedule(units, rank_units))

    def planning_config(self) -> PlanConfig:
        """The plan's config, its pipeline stages priced as measured so far
        (:attr:`stage_calibration`: the identity until a step was measured); without a
        pipeline, the config itself."""
        if self.config.pipeline_stages == 1:
            return self.config
        return replace(self.config, **self.stage_calibration.pricing())

    def _tune(self, planned: StepPlan, ahead: bool = False) -> TunedStep:
        plan = planned.plan
        t0 = time.perf_counter()
        # with CP units the workers are ranks joined by units, one budget each
        if plan.units:
            decision = decide_units(self.tuner, plan, self.cost or self.latency)
        else:
            # a pipeline's ranks are timed by their 1F1B makespans (anchor, cuts and raises),
            # its stages priced as the planner priced them
            pipeline = self.planning_config().pipeline(self.latency.num_layers)
            decision = self.tuner.decide(plan.ranks, self.latency, pipeline=pipeline)
        scale = self.world_size / max(planned.global_weight, 1e-9)
        tuned = TunedStep(planned, decision, scale, time.perf_counter() - t0, ahead)
        self._layers = [*self._layers[-1:], _StepLayers(tuned)]
        return tuned

    # ------------------------------------------------------------------ attention
    def attention(
        self,
        tuned: TunedStep,
        rank: int,
        microbatch: int | None,
        cu_seqlens: torch.Tensor,
        lengths: Sequence[int],
        *,
        ring=None,
        start: float | None = None,
    ) -> PackedAttention:
        """The attention context of ``rank``'s micro-batch ``microbatch`` of ``tuned`` (its
        index in the rank's plan order; None: a filler, two tokens at exact attention).

        Args:
            cu_seqlens: int32 ``(N + 1,)`` of the packed micro-batch (this rank's shard's, for a
                CP unit); ``lengths``: its documents' tokens on the host.
            ring: a CP unit's ring (:func:`~.cp_unit.unit_batch`); required for a CP unit.
            start: host time the micro-batch's forward starts (``perf_counter``), when known:
                DST's closed loop then times its first layer too.
        """
        if microbatch is None:
            return packed_attention(
                cu_seqlens,
                lengths,
                FILLER_BUDGET,
                block_size=self.block_size,
                backend=self.backend,
                gqa=self.kernel.gqa,
            )
        planned = tuned.planned
        decision = tuned.decision.ranks[rank]
        # a pipeline's micro-batches have a budget each (the critical ones cut, the others raised)
        mbs = decision.microbatch_budgets
        value = decision.budget if mbs is None else mbs[microbatch]
        budget = self.knob.budget(Budget(top_k=0), value)
        u = planned.rank_units[rank][microbatch]
        unit = planned.units[u]
        if unit.degree > 1:
            if ring is None:
                raise ValueError(f"micro-batch {microbatch} of rank {rank} is a CP unit: pass its ring")
            return self._unit_attention(tuned, rank, u, value, budget, cu_seqlens, lengths, ring)
        # the controller's micro-batch m: the rank's m-th one-rank micro-batch in plan order
        m = sum(1 for v in planned.rank_units[rank][:microbatch] if planned.units[v].degree == 1)
        controller = self._controller(tuned, rank)
        timer = LayerTimer(controller, m, self.layer_times)
        if start is not None:
            timer.start(start)
        return packed_attention(
            cu_seqlens,
            lengths,
            budget,
            block_size=self.block_size,
            backend=self.backend,
            controller=controller,
            m=m,
            timer=timer,
            dense_from=self.latency.profile.dense_from,
            gqa=self.kernel.gqa,
        )

    def _unit_attention(
        self,
        tuned: TunedStep,
        rank: int,
        u: int,
        value: float,
        budget: Budget,
        cu_seqlens: torch.Tensor,
        lengths: Sequence[int],
        ring,
    ) -> PackedAttention:
        """The attention context of CP unit ``u`` on ``rank``: its ring, its unit's layer budgets."""
        controller = self._unit_controller(tuned, rank, u, value)
        choose = None if controller is None else lambda layer, e: controller.choose(0, layer, e)
        return PackedAttention(
            cu_seqlens,
            budget,
            self.block_size,
            self.backend,
            choose_budget=choose,
            ring=ring,
            lengths=tuple(int(n) for n in lengths),
            gqa=self.kernel.gqa,
        )

    def _step_layers(self, tuned: TunedStep) -> _StepLayers:
        for layers in self._layers:
            if layers.tuned is tuned:
                return layers
        raise ValueError("attention() of a step this engine did not begin (or two steps ago)")

    def _controller(self, tuned: TunedStep, rank: int) -> LayerController | None:
        """DST's closed-loop layer controller of ``rank``'s one-rank micro-batches (None with
        ``mode="off"`` or when the rank has none), built once per step and rank."""
        layers = self._step_layers(tuned)
        if rank in layers.solo:
            return layers.solo[rank]
        planned, dst = tuned.planned, self.tuner.config
        plan, units = planned.plan, planned.units
        solo = [plan.ranks[rank][j] for j, u in enumerate(planned.rank_units[rank]) if units[u].degree == 1]
        controller = None
        if dst.mode != "off" and solo:
            controller = LayerController.from_decision(
                tuned.decision.ranks[rank], solo, self.latency, dst, knob=self.knob, device=self.device
            )
            # its CP units are not the controller's; a pipeline's target is a makespan, not the
            # sum of its micro-batches' seconds the controller spends: it keeps the decision's sum
            # (planned at each micro-batch's own budget: each unit is allotted its planned share)
            if len(solo) < len(plan.ranks[rank]) or self.config.pipeline_stages > 1:
                controller.target_seconds = float(controller.planned.sum())
            elif tuned.ahead:  # priced by the model before the last feedback: its target, re-based
                decided = tuned.decision.ranks[rank]
                controller.target_seconds *= float(controller.planned.sum()) / max(decided.predicted_after, 1e-12)
            if self.config.pipeline_stages > 1:  # a stage decides its layers as one process would
                shape = self.planning_config().pipeline(self.latency.num_layers)
                stage_of = np.repeat(np.arange(shape.layers.size) % shape.num_stages, shape.layers)
                controller.share_by_stage(stage_of, self.block_size, self.latency.profile.dense_from)
        layers.solo[rank] = controller
        return controller

    def _unit_controller(self, tuned: TunedStep, rank: int, u: int, value: float) -> LayerController | None:
        """A CP unit's controller: built from the step decision alone (the unit's ranks share one
        budget) and fed no measured times, so every rank of the unit chooses the same budget from
        the same estimate without a message."""
        if self.tuner.config.mode == "off":
            return None
        layers = self._step_layers(tuned)
        if (rank, u) not in layers.units:
            unit = tuned.planned.units[u]
            mb = MicroBatch(unit.sample_ids, unit.lengths, unit.densities)
            ctl = LayerController(
                [mb], self.latency, self.tuner.config, 0.0, value=value, knob=self.knob, device=self.device
            )
            ctl.target_seconds = float(ctl.planned.sum())  # the unit's own prediction at its budget
            layers.units[rank, u] = ctl
        return layers.units[rank, u]

    # ------------------------------------------------------------------ finish
    def record(self, tuned: TunedStep, rank: int, results: Sequence[MicroBatchResult]) -> RankRecord:
        """This rank's :class:`RankRecord` of ``tuned`` from its micro-batch ``results``, with
        its layer controllers' decision time and coverage-bound stops (no collective)."""
        record = RankRecord.from_results(tuned.decision.ranks[rank], list(results))
        controllers = self._step_layers(tuned).of(rank)
        record.dst_layer_s = sum(c.decide_seconds for c in controllers)
        record.coverage_limited = sum(c.num_coverage_limited for c in controllers)
        return record

    def finish(
        self,
        tuned: TunedStep,
        rank: int,
        results: Sequence[MicroBatchResult],
        measured: bool = True,
        *,
        step: int,
        **front_end,
    ) -> StepReport:
        """After step ``step`` (another trainer synced and stepped): every rank's record from
        this rank's micro-batch ``results`` (one all-gather), each with its derived bubble,
        folded into the latency model and the estimator (their times only when ``measured``),
        and the step's :class:`StepReport` (``front_end``: the fields only the caller knows)."""
        records = self.all_gather(self.record(tuned, rank, results))
        derive_bubbles(records)
        self.feedback(records, measured)
        return self.report(tuned, records, step=step, measured=measured, **front_end)

    def report(
        self, tuned: TunedStep, records: list[RankRecord], *, step: int, measured: bool = True, **front_end
    ) -> StepReport:
        """The :class:`StepReport` of step ``step`` from every rank's ``records`` (the plan's
        strategy, DST's mode and budget kind filled in; times measured only when ``measured``
        and not deterministic)."""
        return StepReport.of(
            tuned,
            records,
            step=step,
            strategy=self.config.strategy,
            dst_mode=self.tuner.config.mode,
            budget_kind=self.knob.kind,
            measured=measured and not self.deterministic,
            **front_end,
        )

    def feedback(self, records: list[RankRecord], measured: bool = True) -> StepFeedback:
        """Fold the step's micro-batches (every rank's, rank order) into the latency model and
        the density estimator, and with pipelines their stages' times into
        :attr:`stage_calibration` (priced by the latency model before this step's update: what
        priced the step); times only when ``measured`` and not deterministic (what
        :meth:`finish` does after its gather; the own loop syncs its records itself)."""
        feedback = StepFeedback.from_records(records)
        timed = measured and not self.deterministic
        if timed and self.config.pipeline_stages > 1:
            cfg = self.config
            virtual = resolve_layers(
                self.latency.num_layers, cfg.pipeline_stages * cfg.pipeline_virtual, cfg.stage_layers
            )
            layers = virtual.reshape(cfg.pipeline_virtual, -1).sum(axis=0)  # per rank: its chunks (--pp-virtual)
            self.stage_calibration.observe(feedback.microbatches, self.latency, layers)
        apply_feedback(
            feedback,
            self.latency,
            self.estimator,
            self.knob,
            self.sample,
            use_timings=timed,
            context=self.cost,
        )
        return feedback

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """JSON-ready: the latency model's calibration, the estimator's state, the ring
        terms of ``sab-cp``'s cost model (None without one) and the pipeline stages' pricing."""
        return {
            "latency": self.latency.state_dict(),
            "estimator": self.estimator.state_dict(),
            "context": None if self.cost is None else self.cost.state_dict(),
            "stage_calibration": self.stage_calibration.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (a state from before the stages' pricing: the identity)."""
        self.latency.load_state_dict(state["latency"])
        self.estimator.load_state_dict(state["estimator"])
        self.stage_calibration.load_state_dict(state.get("stage_calibration"))
        if self.cost is not None and state.get("context") is not None:
            self.cost.load_state_dict(state["context"])
