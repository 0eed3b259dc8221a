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

Cost per probe: the wrapped workload's ``predict_many`` calls plus one vectorised makespan pass
(one numpy step per dependency level, :mod:`~sparsebalance.batching.levels`) per micro-batch
count M, whatever the ranks' documents per micro-batch.
"""

from __future__ import annotations

import numpy as np

from ..batching.pipeline import PipelineShape
from ..batching.schedule import head_seconds
from .plan_workload import PlanWorkload, _Group


class PipelineWorkload:
    """The ranks of a :class:`PlanWorkload` as pipelines priced by ``shape`` (the schedule, the
    split, the stage scales, the backward ratio and ZB-H1's weight share; ``PlanConfig.pipeline``):
    :meth:`seconds` is each rank's makespan with its micro-batches in plan (= run) order."""

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
        base = float(work.knob.base)
        self._heads = []  # per group (n, M): seconds on the last stage only
        for g in work.groups:
            dens = work.knob.density(g.lengths, g.d0, base)
            self._heads.append(head_seconds(work.cost_model, g.lengths, dens, g.predict(None, dens)))
        self._pricing = _merged_groups(work, self._heads)
        self._memo: dict[float, np.ndarray] = {}

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

    def seconds(self, values: np.ndarray, active: np.ndarray | None = None) -> np.ndarray:
        """``(R,)`` each rank's makespan at ``values[r]``; ranks outside ``active`` (and
        ranks without micro-batches) read 0."""
        uniform = (active is None or active.all()) and values.size and np.all(values == values[0])
        key = float(values[0]) if uniform else None
        if key in self._memo:
            return self._memo[key].copy()
        parts = []
        for g, head in self._pricing:
            sel = np.ones(g.ranks.size, dtype=bool) if active is None else active[g.ranks]
            if not sel.any():
                continue
            dens = self.knob.density(g.lengths[sel], g.d0[sel], values[g.ranks[sel]][:, None, None])
            parts.append((g.ranks[sel], g.predict(None if active is None else sel, dens), head[sel]))
        out = np.zeros(self.num_ranks)
        merged_makespans(self.shape, parts, out)
        if key is not None:
            self._memo[key] = out.copy()
        return out

    def coverage(self, values: np.ndarray, active: np.ndarray | None = None) -> np.ndarray:
        return self.work.coverage(values, active)

    def mean_density(self, values: np.ndarray) -> np.ndarray:
        return self.work.mean_density(values)

    def attention_seconds(self, values: np.ndarray) -> np.ndarray:
        return self.work.attention_seconds(values)


def merged_makespans(shape: PipelineShape, parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]], out: np.ndarray):
    """Write into ``out`` ``(R,)`` the makespans of ``parts``: ``(ranks (n,), times (n, M), heads
    (n, M))`` per group of ranks, one makespan pass per micro-batch count M, however many
    groups share it (groups differ in documents per micro-batch K, which a makespan does not
    read; a pass costs the same for 2 pipelines or 200: issue 54). Rows are independent, so the
    makespans are those of a pass per group, bit for bit."""
    by_count: dict[int, list] = {}
    for part in parts:
        by_count.setdefault(part[1].shape[1], []).append(part)
    for same in by_count.values():
        if len(same) == 1:
            ranks, times, heads = same[0]
        else:
            ranks, times, heads = (np.concatenate(x) for x in zip(*same, strict=True))
        out[ranks] = shape.makespans(times, heads)


MERGE_WIDTH = 7
"""Groups of ranks with the same micro-batch count and at most this many documents per
micro-batch are priced as one (padded to the widest): a row's sum of fewer than 8 numbers is
numpy's plain loop, so trailing zeros leave every micro-batch's seconds bit for bit unchanged."""


def _merged_groups(work: PlanWorkload, heads: list[np.ndarray]) -> list[tuple[_Group, np.ndarray]]:
    """``work.groups`` with their heads, those of one micro-batch count and at most
    :data:`MERGE_WIDTH` documents per micro-batch merged into one group (padded to the widest):
    a probe of :meth:`PipelineWorkload.seconds` then prices each micro-batch count once, not once
    per width (issue 54)."""
    out, merge = [], {}
    for g, head in zip(work.groups, heads, strict=True):
        _, m, k = g.lengths.shape
        if k > MERGE_WIDTH:
            out.append((g, head))
        else:
            merge.setdefault(m, []).append((g, head))
    for same in merge.values():
        if len(same) == 1:
            out.append(same[0])
            continue
        width = max(g.lengths.shape[2] for g, _ in same)
        lengths = np.concatenate(
            [np.pad(g.lengths, ((0, 0), (0, 0), (0, width - g.lengths.shape[2]))) for g, _ in same]
        )
        d0 = np.concatenate(
            [np.pad(g.d0, ((0, 0), (0, 0), (0, width - g.d0.shape[2])), constant_values=1.0) for g, _ in same]
        )
        ranks = np.concatenate([g.ranks for g, _ in same]).tolist()
        out.append((_Group(ranks, lengths, d0, work.cost_model), np.concatenate([h for _, h in same])))
    return out
