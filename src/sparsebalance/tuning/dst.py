"""DST step level: anchor-guided budgets per worker (a rank, or ranks joined by CP units).

Input: every worker's micro-batches (documents with their estimated density at the base budget),
a ``CostModel`` (duck-typed: only the protocol in :mod:`sparsebalance.workload` is used) and the
:mod:`knob <.knob>` that prices any budget (top-k or gamma). Output: a
:class:`~sparsebalance.tuning.records.StepDecision`.

The rule, the SparseBalance paper's (``tolerance = 0``, ``raise_to = "anchor"``):

1. ``t_w`` = predicted time of worker w at the base budget; ``T_anchor = anchor(t)`` (min, mean,
   median or max).
2. Bottlenecks (``t_w > (1 + tolerance) T_anchor``) get the largest budget ``v`` in the feasible
   set ``F = {v : T_w(v) <= (1 + tolerance) T_anchor, C_w(base) - C_w(v) <= p}``, ``C`` the gate's
   coverage. ``F`` is an interval ``[v_cov, v_time]``; when it is empty (the time target needs
   more compression than the coverage bound allows) the worker is cut as far as the bound allows,
   ``v_cov``, and misses the target (the paper gives no rule for this case).
3. Every other worker below the raise target (``raise_to = "anchor"``: ``T_anchor``; ``"step"``:
   ``T'``, the step time after the cuts) is raised to the largest budget predicted within it,
   and no further than stays below the slowest other worker if attention cost ``skew_margin``
   times more or less than predicted (:mod:`.skew`: a model off in its attention / rest split
   must not turn a raise into a new straggler).

Coverage at this level: the workload's coverage model when it has one (the simulator's); without
one (the trainer, before the forward) ``v_cov`` is the knob's floor and the bound is enforced per
layer by the :class:`~.layer.LayerController`, which has the layer's real gate scores.

``mode="down"`` stops after step 2; ``mode="off"`` keeps the base budget everywhere (the baseline
and SAB-only ablations). The tuner is a plain object without state between steps.

Pipelines (``decide(..., pipeline=)``, ``PlanConfig.pipeline``): workers are pipelines (1F1B,
interleaved or ZB-H1) timed by their makespans (:mod:`.pipeline_workload`), and after the rule
above (one budget per pipeline) every micro-batch gets its own budget (:mod:`.microbatch_dst`:
the critical micro-batches cut, the others raised, no pipeline predicted slower than with its one
budget). Both levels' raises are guarded against the skew (:class:`~.skew.PipelineSkew`: each op
priced as rest + s x attention, the makespans checked at ``s = 1/m``, 1 and ``m`` and bounded
exactly in between).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from ..batching.pipeline import PipelineShape
from ..workload import CostModel, MicroBatch
from .config import ANCHORS, MODES, DSTConfig, add_dst_arguments
from .curve import DensityCurve
from .knob import GammaKnob, Knob, search_many, search_one
from .microbatch_dst import MicroBatchPrices, RankLevel, decide_microbatches
from .pipeline_workload import PipelineWorkload
from .plan_workload import PlanWorkload, StepWorkload
from .records import CUT, KEPT, RAISED, RankDecision, StepDecision, StepTargets
from .skew import PipelineSkew, safe_raises

__all__ = ["ANCHORS", "MODES", "DSTConfig", "DSTTuner", "RankWorkload", "add_dst_arguments"]

_ANCHOR_FNS: dict[str, Callable[[np.ndarray], float]] = {
    "min": np.min,
    "mean": np.mean,
    "median": np.median,
    "max": np.max,
}


class RankWorkload:
    """One rank's micro-batches as padded ``(M, K)`` arrays, priced at any budget: the scalar
    reference that :class:`PlanWorkload` (all ranks at once, what :meth:`DSTTuner.decide` uses)
    is tested against, bit for bit, through :meth:`DSTTuner.decide_rank`.

    ``lengths`` int64 ``(M, K)`` (0 = empty slot) and ``d0`` float64 ``(M, K)`` (1.0 in empty
    slots); ``seconds(v)`` is ``sum(cost_model.predict_many(lengths, knob.density(...)))``.
    """

    def __init__(self, microbatches: Sequence[MicroBatch], cost_model: CostModel, knob: Knob) -> None:
        m = len(microbatches)
        k = max((len(mb.lengths) for mb in microbatches), default=0)
        self.lengths = np.zeros((m, k), dtype=np.int64)
        self.d0 = np.ones((m, k), dtype=np.float64)
        for i, mb in enumerate(microbatches):
            self.lengths[i, : len(mb.lengths)] = mb.lengths
            self.d0[i, : len(mb.densities)] = mb.densities
        self.cost_model = cost_model
        self.knob = knob
        self._weights = self.lengths.astype(np.float64) ** 2

    @property
    def max_length(self) -> int:
        return int(self.lengths.max(initial=0))

    def densities(self, value: float) -> np.ndarray:
        """``(M, K)`` predicted densities at budget ``value``."""
        return self.knob.density(self.lengths, self.d0, value)

    def seconds(self, value: float) -> float:
        """Predicted forward + backward seconds of all micro-batches at ``value``."""
        if self.lengths.shape[0] == 0:  # no micro-batch at all (an empty one still has overhead)
            return 0.0
        return float(np.sum(self.cost_model.predict_many(self.lengths, self.densities(value))))

    def attention_seconds(self, value: float) -> float:
        """Predicted attention seconds (all layers) at ``value``."""
        if self.lengths.size == 0:
            return 0.0
        valid = self.lengths > 0  # padded slots are not documents (a cost model may reject 0)
        per_layer = np.zeros(self.lengths.shape)
        per_layer[valid] = self.cost_model.layer_attention_seconds(self.lengths[valid], self.densities(value)[valid])
        return float(self.cost_model.num_layers * np.sum(per_layer))

    def mean_density(self, value: float) -> float:
        """Length²-weighted mean density at ``value`` (1.0 for an empty rank)."""
        total = self._weights.sum()
        return float((self._weights * self.densities(value)).sum() / total) if total else 1.0


@dataclass(frozen=True)
class StepArrays:
    """:meth:`DSTTuner.decide_arrays`: a :class:`StepDecision`'s numbers as ``(W,)`` float64
    arrays (worker order), the per-worker fields of :class:`RankDecision` by name."""

    targets: StepTargets
    budgets: np.ndarray
    times_after: np.ndarray
    density_before: np.ndarray
    density_after: np.ndarray
    attention_before: np.ndarray
    attention_after: np.ndarray
    microbatch_budgets: tuple[np.ndarray, ...] | None = None
    """Pipelines (:class:`PipelineWorkload`, mode not off): each rank's ``(M_r,)`` budgets per
    micro-batch (:mod:`.microbatch_dst`; ``budgets`` is then their mean per rank); else None."""


class DSTTuner:
    """Step-level DST (see the module docstring). Stateless between calls.

    Args:
        config: the settings; curve: gamma's density response (default the prior);
        ``block_size``: the resolved kernel's (:func:`~sparsebalance.engine.resolve_kernel`; top-k
        budgets are stated in tokens), or ``knob``: built already (it carries its block size).
        Exactly one of the two.
    """

    def __init__(
        self,
        config: DSTConfig | None = None,
        curve: DensityCurve | None = None,
        *,
        block_size: int | None = None,
        knob: Knob | None = None,
    ) -> None:
        self.config = config or DSTConfig()
        if (block_size is None) == (knob is None):
            raise TypeError("DSTTuner: pass exactly one of block_size (the kernel's) or knob")
        self.knob = knob if knob is not None else self.config.knob(block_size, curve)
        if self.knob.kind != self.config.budget:
            raise ValueError(f"the knob is {self.knob.kind}, the config's --budget is {self.config.budget}")

    @property
    def curve(self) -> DensityCurve | None:
        """The gamma knob's density curve (None for top-k)."""
        return self.knob.curve if isinstance(self.knob, GammaKnob) else None

    @property
    def base(self) -> float:
        return float(self.knob.base)

    def workload(self, microbatches: Sequence[MicroBatch], cost_model: CostModel) -> RankWorkload:
        return RankWorkload(microbatches, cost_model, self.knob)

    def rank_times(self, microbatches: Sequence[MicroBatch], cost_model: CostModel) -> tuple[float, float]:
        """This rank's predicted time at the base budget and at the floor (what ranks exchange)."""
        w = self.workload(microbatches, cost_model)
        return w.seconds(self.knob.base), w.seconds(self._floor())

    def _floor(self) -> float:
        """The deepest cut without a coverage model: the knob's floor, or the base with p = 0."""
        return float(self.knob.base if self.config.p == 0 else self.knob.lo)

    def step_targets(self, times_before: Sequence[float], times_floor: Sequence[float]) -> StepTargets:
        """Anchor, cut threshold, ``T'``, the raise target and roles from ``(W,)`` times at the
        base budget and at the deepest allowed cut. Pure and deterministic: every rank computes
        the same from the same times."""
        cfg = self.config
        t0 = np.asarray(times_before, dtype=np.float64)
        tf = np.asarray(times_floor, dtype=np.float64)
        if t0.ndim != 1 or t0.shape != tf.shape or t0.size == 0:
            raise ValueError(
                f"times_before and times_floor must be two (R,) arrays with R >= 1, got {t0.shape} and {tf.shape}"
            )
        anchor = float(_ANCHOR_FNS[cfg.anchor](t0))
        threshold = (1.0 + cfg.tolerance) * anchor
        cut = np.zeros(t0.shape, dtype=bool) if cfg.mode == "off" else t0 > threshold
        post_cut = float(np.where(cut, np.maximum(threshold, tf), t0).max())
        raise_to = anchor if cfg.raise_to == "anchor" else post_cut
        raise_ = (cfg.mode == "bidirectional") & ~cut & (t0 < raise_to)
        roles = tuple(CUT if c else RAISED if r else KEPT for c, r in zip(cut, raise_, strict=True))
        return StepTargets(
            anchor_seconds=anchor,
            cut_threshold=threshold,
            post_cut_seconds=post_cut,
            raise_seconds=raise_to,
            times_before=tuple(float(x) for x in t0),
            times_floor=tuple(float(x) for x in tf),
            roles=roles,
        )

    def decide_rank(
        self,
        rank: int,
        microbatches: Sequence[MicroBatch],
        cost_model: CostModel,
        targets: StepTargets,
    ) -> RankDecision:
        """One rank's budget given the shared ``targets`` (needs only its own micro-batches):
        the per-rank reference of :meth:`decide` (no coverage model), one scalar search per
        rank. The rule without the skew margin only (``skew_margin`` 1): a guarded raise reads
        the other workers' decided budgets (:mod:`.skew`)."""
        if self.config.skew_margin != 1.0 and self.config.mode == "bidirectional":
            raise ValueError("decide_rank is the per-rank reference of the rule with skew_margin 1")
        knob = self.knob
        w = self.workload(microbatches, cost_model)
        role = targets.roles[rank]
        value, floor = float(knob.base), self._floor()
        if role == CUT:
            if targets.times_floor[rank] > targets.cut_threshold:
                value = floor
            else:
                value = search_one(knob, lambda v: w.seconds(v) - targets.cut_threshold, floor, knob.base)
        elif role == RAISED:
            hi = float(knob.upper(np.array([w.max_length]))[0])
            value = search_one(knob, lambda v: w.seconds(v) - targets.raise_seconds, knob.base, hi)
        after = w.seconds(value)
        return RankDecision(
            rank=rank,
            role=role,
            budget=value,
            target_seconds=after,
            predicted_before=targets.times_before[rank],
            predicted_after=after,
            density_before=w.mean_density(knob.base),
            density_after=w.mean_density(value),
            attention_before=w.attention_seconds(knob.base),
            attention_after=w.attention_seconds(value),
        )

    def decide(
        self,
        plan: Sequence[Sequence[MicroBatch]],
        cost_model: CostModel,
        workload: PlanWorkload | PipelineWorkload | None = None,
        pipeline: PipelineShape | None = None,
        *,
        per_microbatch: bool = True,
    ) -> StepDecision:
        """The whole step from the plan (rank -> micro-batches), identical on every rank.

        ``pipeline`` (``PlanConfig.pipeline``: the schedule, split, stage scales, backward ratio and
        ZB-H1's weight share): every rank is a pipeline and its time is the pipeline's makespan
        (:class:`~.pipeline_workload.PipelineWorkload`): the anchor, the cuts and the raises read
        makespans, and ``RankDecision``'s times are makespans. Then each micro-batch gets its own
        budget (``RankDecision.microbatch_budgets``, ``budget`` their mean; :mod:`.microbatch_dst`),
        unless ``per_microbatch`` is False (one budget per pipeline). None: rank sums, one budget
        per rank.

        Vectorised over ranks (:mod:`.plan_workload`): the same budgets and times as
        :meth:`decide_rank` for every rank, in a few ``predict_many`` calls per search probe.
        ``workload``: a :class:`PlanWorkload` of this plan, cost model and knob, to share its
        prices between several tuners (the simulator's ablations); built here when ``None``.
        """
        if len(plan) == 0:
            raise ValueError("DST needs at least one rank in the plan, got 0")
        if workload is None:
            workload = PlanWorkload(plan, cost_model, self.knob)
        elif not (workload.num_ranks == len(plan) and workload.cost_model is cost_model):
            raise ValueError("decide: the workload was built for another plan, cost model or knob")
        if isinstance(workload, PipelineWorkload) and workload.shape != pipeline:
            raise ValueError("decide: the workload prices another pipeline than ``pipeline``")
        if pipeline is not None and not isinstance(workload, PipelineWorkload):
            workload = PipelineWorkload(workload, pipeline)
        a = self.decide_arrays(workload, per_microbatch=per_microbatch)
        mbs = [None] * len(plan) if a.microbatch_budgets is None else [tuple(m.tolist()) for m in a.microbatch_budgets]
        ranks = tuple(
            RankDecision(r, role, v, t, b, t, db, da, ab, aa, mb)
            for r, (role, v, t, b, db, da, ab, aa, mb) in enumerate(
                zip(
                    a.targets.roles,
                    a.budgets.tolist(),
                    a.times_after.tolist(),
                    a.targets.times_before,
                    a.density_before.tolist(),
                    a.density_after.tolist(),
                    a.attention_before.tolist(),
                    a.attention_after.tolist(),
                    mbs,
                    strict=True,
                )
            )
        )
        return self.assemble(a.targets, ranks)

    def coverage_floor(self, work: StepWorkload) -> np.ndarray:
        """``(W,)`` the smallest budget each worker may be cut to: the knob's floor, raised to
        the smallest value within the coverage bound ``C(base) - C(v) <= p`` when the workload
        has a coverage model; the base itself with p = 0."""
        knob, p = self.knob, self.config.p
        n = work.num_ranks
        base, lo = np.full(n, float(knob.base)), np.full(n, self._floor())
        if self.config.mode == "off" or p == 0 or p >= 1:
            return base if self.config.mode == "off" or p == 0 else lo
        if not work.has_coverage:
            return lo
        c_base = work.coverage(base)

        def g(v, sel):
            return work.coverage(v, sel) - (c_base - p)

        return search_many(knob, g, lo, base, np.ones(n, dtype=bool), largest=False)

    def decide_arrays(self, workload: StepWorkload, *, per_microbatch: bool = True) -> StepArrays:
        """:meth:`decide` on a plan's :class:`PlanWorkload` (or a ``UnitWorkload``, or a
        :class:`PipelineWorkload`: then budgets per micro-batch unless ``per_microbatch`` is
        False), as ``(W,)`` arrays without one :class:`RankDecision` per worker (what the
        simulator reads for thousands of ranks)."""
        if workload.num_ranks == 0:
            raise ValueError("DST needs at least one rank in the plan, got 0")
        if workload.knob != self.knob:
            raise ValueError("decide: the workload was built for another plan, cost model or knob")
        knob, work = self.knob, workload
        n = work.num_ranks
        full = np.ones(n, dtype=bool)
        base = np.full(n, float(knob.base))
        floor = self.coverage_floor(work)
        targets = self.step_targets(work.seconds(base), work.seconds(floor))
        roles = np.asarray(targets.roles)
        empty = np.asarray(targets.times_floor) > targets.cut_threshold  # F is empty: the floor
        cut = (roles == CUT) & ~empty
        value = np.where((roles == CUT) & empty, floor, base)
        raised = roles == RAISED
        hi = np.maximum(knob.upper(work.max_lengths), base)
        # the cuts (largest in [floor, base] within the cut threshold) and the raises (largest in
        # [base, hi] within the raise target) in one search: each worker's search is its own, so
        # its budget is what a search of its set alone finds, and a probe prices both sets at once
        limit = np.where(cut, targets.cut_threshold, targets.raise_seconds)
        lo_v, hi_v, both = np.where(cut, floor, base), np.where(cut, base, hi), cut | raised
        value = np.where(both, search_many(knob, lambda v, s: work.seconds(v, s) - limit, lo_v, hi_v, both), value)
        skew = None
        if not isinstance(work, PipelineWorkload):
            value = safe_raises(work, knob, value, raised, base, self.config.skew_margin)
        elif self.config.skew_margin > 1.0 and self.config.mode != "off" and (raised.any() or per_microbatch):
            # makespans are convex in the skew, not linear: the reference is fitted once, from
            # the pipelines not raised, and both levels' raises are checked against it
            skew = PipelineSkew(MicroBatchPrices(work), self.config.skew_margin)
            value = skew.safe_raises(knob, value, raised, base)
        arrays = StepArrays(
            targets=targets,
            budgets=value,
            times_after=work.seconds(value, full),
            density_before=work.mean_density(base),
            density_after=work.mean_density(value),
            attention_before=work.attention_seconds(base),
            attention_after=work.attention_seconds(value),
        )
        if not (per_microbatch and isinstance(work, PipelineWorkload) and self.config.mode != "off"):
            return arrays
        rank = RankLevel(value, arrays.times_after, arrays.density_after, arrays.attention_after, skew)
        mb = decide_microbatches(work, self.config, _ANCHOR_FNS[self.config.anchor], rank)
        return replace(
            arrays,
            budgets=mb.mean_budgets,
            times_after=mb.times_after,
            density_after=mb.density_after,
            attention_after=mb.attention_after,
            microbatch_budgets=mb.budgets,
        )

    def assemble(self, targets: StepTargets, ranks: Sequence[RankDecision]) -> StepDecision:
        """A :class:`StepDecision` from shared targets and every rank's decision."""
        cfg = self.config
        return StepDecision(cfg.mode, cfg.anchor, cfg.p, targets, tuple(ranks), self.knob.kind, float(self.knob.base))
