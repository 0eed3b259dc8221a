"""DST over pipelines: a plan's ranks priced as pipelines (their makespans), not as sums.

With P > 1 pipeline stages a rank's step time is its pipeline's makespan
(:mod:`sparsebalance.batching.schedule`; the schedule ``PlanConfig.pipeline`` names: 1F1B,
interleaved 1F1B or ZB-H1, whose exact makespan :class:`~sparsebalance.batching.pipeline.
PipelineShape` prices): for 1F1B about ``(sum of micro-batch times + (P - 1) x the
slowest) / P``, order included. :class:`PipelineWorkload` implements
:class:`~.plan_workload.StepWorkload` with that time, so :meth:`DSTTuner.decide_arrays
<sparsebalance.tuning.dst.DSTTuner.decide_arrays>` runs unchanged and its anchor (min / mean /
median / max), its bottlenecks (pipelines whose makespan exceeds the cut threshold) and its raise
targets are all read on makespans: a rank's budget is cut until its critical path meets the
anchor, and a rank with a short pipeline is raised until its makespan reaches it, its bubble
time becoming attention. That rank level decides one budget per rank (cutting k shrinks the long
documents' micro-batches, those on the critical path, far more than the short ones); the
micro-batch level (:mod:`.microbatch_dst`) then gives every micro-batch of a pipeline its own.

Stage times: a micro-batch's predicted seconds at the rank's budget, minus its head term
(:func:`~sparsebalance.batching.schedule.head_seconds`, priced once at the base budget: a latency
model's head depends on tokens only), spread over the stages by their layers (``stage_layers``,
the split the planner and the trainer use; empty = even), the head on the last stage, each
stage's share times its scale; backward = ratio x forward. With the defaults (scales 1, ratio
2) exactly what the simulator's :func:`~sparsebalance.simulate.pipeline.pipeline_record` prices
(up to rounding); a training run passes the scales and ratio it measured
(:mod:`sparsebalance.engine.stage_calibration`).

Cost per probe: one ``predict_many`` call per width class of micro-batches (all of them padded
to one width when none holds more than :data:`MERGE_WIDTH` documents: usually one call) and one
makespan pass over every pipeline (:meth:`~sparsebalance.batching.pipeline.PipelineShape.joined`:
one numpy step per dependency level, whatever the pipelines' micro-batch counts; issue 54).
"""

from __future__ import annotations

import numpy as np

from ..batching.pipeline import PipelineShape
from ..batching.schedule import head_seconds
from .plan_workload import PlanWorkload, _Group


class PipelineWorkload:
    """The ranks of a :class:`PlanWorkload` as pipelines priced by ``shape`` (the schedule, the
    split, the stage scales, the backward ratio and ZB-H1's weight share; ``PlanConfig.pipeline``):
    :meth:`seconds` is each rank's makespan with its micro-batches in plan (= run) order.

    Its micro-batches are ``E`` flat entries, group by group of :attr:`PlanWorkload.groups`, rank
    by rank, in plan order (:class:`~.microbatch_dst.MicroBatchPrices` prices them one budget
    each): :meth:`entry_seconds`."""

    def __init__(self, work: PlanWorkload, shape: PipelineShape) -> None:
        if int(shape.layers.sum()) != work.cost_model.num_layers:
            raise ValueError(
                f"a pipeline of stages {shape.layers.tolist()} for a model of {work.cost_model.num_layers} layers"
            )
        self.work = work
        self.num_ranks = work.num_ranks
        self.knob = work.knob
        self.cost_model = work.cost_model
        self.max_lengths = work.max_lengths
        self.shape = shape
        none = np.zeros(0, dtype=np.int64)
        self.pipelines = np.concatenate([none, *(g.ranks for g in work.groups)])
        """``(n,)`` the ranks with micro-batches, in entry order."""
        counts = np.concatenate([none, *(np.full(g.ranks.size, g.lengths.shape[1]) for g in work.groups)])
        self.schedule = shape.joined(counts)
        """Every pipeline's makespan from ``(E,)`` (or ``(E, C)``) entry seconds in one pass."""
        self.entry_rank = self.pipelines[self.schedule.entry_pipeline]
        """``(E,)`` each micro-batch's rank."""
        self._classes = _width_classes(work)
        self._entry_memo: dict[float, np.ndarray] = {}
        self._memo: dict[float, np.ndarray] = {}
        base = self.entry_seconds(np.full(self.entry_rank.size, float(work.knob.base)))
        self._heads, start = [], 0  # per group (n, M): seconds on the last stage only
        for g in work.groups:
            n, m, _ = g.lengths.shape
            dens = work.knob.density(g.lengths, g.d0, float(work.knob.base))
            self._heads.append(
                head_seconds(work.cost_model, g.lengths, dens, base[start : start + n * m].reshape(n, m))
            )
            start += n * m
        self.head = np.concatenate([np.zeros(0), *(h.reshape(-1) for h in self._heads)])
        """``(E,)`` each micro-batch's head seconds (:attr:`heads`, flat)."""

    @property
    def heads(self) -> list[np.ndarray]:
        """Per group of :attr:`PlanWorkload.groups`, ``(n, M)`` seconds of each micro-batch on
        the last stage only (the head, priced at the base budget)."""
        return self._heads

    @property
    def has_coverage(self) -> bool:
        return self.work.has_coverage

    @property
    def weights(self) -> np.ndarray:
        """``(R,)`` sum of length² over each rank's documents."""
        return self.work.weights

    def entry_seconds(self, values: np.ndarray, active: np.ndarray | None = None) -> np.ndarray:
        """``(E,)`` each micro-batch's predicted seconds at its own budget ``values`` ``(E,)``
        (``active`` bool ``(E,)``: only those, the others read 0): exactly ``predict_many`` of
        its rank's group. Every micro-batch at one budget is priced once (the base's are
        shared by both levels and the skew guard)."""
        key = float(values[0]) if active is None and values.size and np.all(values == values[0]) else None
        if key in self._entry_memo:
            return self._entry_memo[key].copy()
        out = np.zeros(values.size)
        for g, entries in self._classes:
            sel = None if active is None else active[entries]
            if sel is not None and not sel.any():
                continue
            rows = slice(None) if sel is None else sel
            dens = self.knob.density(g.lengths[rows], g.d0[rows], values[entries[rows]][:, None, None])
            out[entries[rows]] = g.predict(sel, dens)[:, 0]
        if key is not None:
            self._entry_memo[key] = out.copy()
        return out

    def seconds(self, values: np.ndarray, active: np.ndarray | None = None) -> np.ndarray:
        """``(R,)`` each rank's makespan at ``values[r]``; ranks outside ``active`` (and
        ranks without micro-batches) read 0."""
        uniform = (active is None or active.all()) and values.size and np.all(values == values[0])
        key = float(values[0]) if uniform else None
        if key in self._memo:
            return self._memo[key].copy()
        on = None if active is None else active[self.entry_rank]
        times = self.entry_seconds(values[self.entry_rank], on)
        # an unpriced pipeline runs zeros (its makespan 0), not a negative stage (0 - its head)
        out = np.zeros(self.num_ranks)
        out[self.pipelines] = self.schedule(times, self.head if on is None else np.where(on, self.head, 0.0))
        if key is not None:
            self._memo[key] = out.copy()
        return out

    def makespans(self, times: np.ndarray, head: np.ndarray | None = None) -> np.ndarray:
        """``(R,)`` (or ``(R, C)``) each pipeline's makespan from ``(E,)`` (``(E, C)``) entry
        seconds and their heads (None: :attr:`head`, at the base budget); 0 without
        micro-batches."""
        out = np.zeros((self.num_ranks, *times.shape[1:]))
        out[self.pipelines] = self.schedule(times, self.head if head is None else head)
        return out

    def coverage(self, values: np.ndarray, active: np.ndarray | None = None) -> np.ndarray:
        return self.work.coverage(values, active)

    def mean_density(self, values: np.ndarray) -> np.ndarray:
        return self.work.mean_density(values)

    def attention_seconds(self, values: np.ndarray) -> np.ndarray:
        return self.work.attention_seconds(values)


MERGE_WIDTH = 7
"""Micro-batches of at most this many documents are priced as one class (padded to the widest):
a row's sum of fewer than 8 numbers is numpy's plain loop, so trailing zeros leave every
micro-batch's seconds bit for bit unchanged. Wider ones keep their rank's width (a pairwise sum
depends on it), a class per width."""


def _width_classes(work: PlanWorkload) -> list[tuple[_Group, np.ndarray]]:
    """``work.groups``' micro-batches as classes of one width: ``(group, entries)``, the group's
    "ranks" single micro-batches ``(n_e, 1, K)`` (one prediction row each), ``entries`` their
    flat indices (:class:`PipelineWorkload`'s order)."""
    merge: dict[int, list] = {}
    start = 0
    for g in work.groups:
        n, m, k = g.lengths.shape
        merge.setdefault(0 if k <= MERGE_WIDTH else k, []).append((g, np.arange(start, start + n * m)))
        start += n * m
    out = []
    for same in merge.values():
        width = max(g.lengths.shape[2] for g, _ in same)

        def flat(x: np.ndarray, fill: float, width: int = width) -> np.ndarray:
            rows = x.reshape(-1, x.shape[2])
            return np.pad(rows, ((0, 0), (0, width - rows.shape[1])), constant_values=fill)

        lengths = np.concatenate([flat(g.lengths, 0) for g, _ in same])[:, None, :]
        d0 = np.concatenate([flat(g.d0, 1.0) for g, _ in same])[:, None, :]
        entries = np.concatenate([e for _, e in same])
        out.append((_Group(entries.tolist(), lengths, d0, work.cost_model), entries))
    return out
