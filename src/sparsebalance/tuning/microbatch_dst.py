"""DST inside a pipeline: one budget per micro-batch, so the critical micro-batch is cut and the
others are raised into the slack.

In a 1F1B pipeline of P stages the makespan is about ``(sum of micro-batch times + (P - 1) x the
slowest) / P`` (exactly: :mod:`sparsebalance.batching.schedule`; interleaved 1F1B and ZB-H1 are
priced exactly too, through ``PipelineWorkload.shape``). Shortening the slowest
micro-batch shortens it ~P times more than shortening another one, and raising a short
micro-batch's budget costs ~1/P of its extra time. One budget per pipeline cannot use that; this
level, run after the rank level of :meth:`DSTTuner.decide_arrays
<sparsebalance.tuning.dst.DSTTuner.decide_arrays>` (which gives pipeline r one budget ``v_r`` and
its makespan ``S_r``), can:

1. ``t0[r, m]``: micro-batch seconds at the base budget. ``floor[r, m]``: the smallest budget within
   the coverage bound of the micro-batch's own documents (``C_m(base) - C_m(v) <= p``, tokens
   weighted; the knob's floor without a coverage model, the base with p = 0). ``hi[r, m]``: the
   knob's upper bound for its longest document (the base with ``mode="down"``).
2. The anchor is a makespan: ``B_r`` is pipeline r's makespan with its micro-batches evened at the
   base budget (each one the mean of its micro-batches' stage times: the same total, no critical
   micro-batch), or its makespan at the base if that is shorter (an order that puts short
   micro-batches at the fill and the drain, SAB's, can beat even ones), ``T = anchor(B)`` (the
   config's min / mean / median / max).
3. Targets: a pipeline whose base makespan exceeds ``(1 + tolerance) T`` aims at that; the others
   at the raise target (``T``, or the step after those cuts with ``raise_to="step"``; never below
   their base makespan; ``down``: their base makespan). Every target is capped at ``S_r``.
4. Water level: ``tau_r`` is the highest level whose exact makespan (of the schedule that runs),
   with micro-batch m running ``min(tau_r, t_m(hi))``, meets the target (a bisection on makespans alone, no
   cost-model call). Micro-batches above the level are cut to it, those below raised to it (the
   paper's rule with a micro-batch anchor, the level, set by a makespan): even micro-batch times
   are the least makespan for a total, so the level spends the target on as much attention as it
   allows. A cut stops at its coverage floor: that micro-batch runs ``t_m(floor)`` and the
   pipeline misses its target (as a rank does at the rank level), the others keep the level.
5. Never slower than one budget: where the floors push a pipeline's makespan above ``S_r``, its
   target becomes the makespan of the cuts alone (the micro-batches above the level cut to it or
   to their floor, the others at the base; at most ``S_r``), and its level is the highest whose
   makespan with the floors (``clip(tau, t_m(floor), t_m(hi))``) is within that: the short
   micro-batches are raised only into what the cuts freed.
6. Budgets: each micro-batch gets the largest budget in ``[floor, hi]`` whose time is within the
   level (one vectorised search over every micro-batch; its floor where the floor is above it),
   and the makespans are priced again exactly. A pipeline keeps ``v_r`` for every micro-batch
   (as before this level) unless its budgets per micro-batch give it a strictly shorter
   makespan: not where every micro-batch at its floor is above ``S_r`` (a per-micro-batch
   coverage bound is stricter than the rank's token-weighted one), nor where the target is
   ``S_r`` itself (evening would only move attention between micro-batches: from the long
   documents to the short ones, not a clear gain).
7. Skew (``DSTConfig.skew_margin`` m > 1; :class:`~.skew.PipelineSkew`, fitted by the rank
   level): a pipeline that keeps budgets per micro-batch, some above its one budget ``v_r``, must
   pass the rank level's check, at every attention/rest skew in ``[1/m, m]`` no slower than the
   slowest pipeline the rank level did not raise; one that fails has its budgets capped at the
   largest cap in ``[v_r, max]`` that passes (its cuts kept), then step 6's rule is read again.

Cost per step: ~25 vectorised ``predict_many`` calls over all micro-batches (three prices, the
coverage floors' and the final search's probes) and ~10 makespan passes (one numpy step per
dependency level of the schedule each, :mod:`~sparsebalance.batching.levels`), every pipeline in
the same pass whatever its micro-batch count: the water level's bisection prices its next steps'
every possible midpoint in one pass.
The skew check: one makespan pass on the prices above; where it fails, ~3-5 probes of one pricing
and one pass each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .config import DSTConfig
from .knob import search_many
from .pipeline_workload import PipelineWorkload
from .skew import PipelineSkew

LEVEL_RTOL = 1e-7
"""The water level's bisection stops at this relative width (about 24 steps, ~4 makespan passes)."""
TREE_DEPTH = 8
"""Most bisection steps of the water level priced in one makespan pass (255 levels per pipeline)."""
TREE_ROWS = 4096
"""Most pipelines x levels priced in one pass (fewer steps per pass for many pipelines)."""
FASTER_RTOL = 1e-6
"""Budgets per micro-batch replace the pipeline's one budget only if its makespan is shorter by
more than this (relative)."""


@dataclass(frozen=True)
class MicroBatchDecision:
    """:func:`decide_microbatches`: budgets per micro-batch and their effect per rank (pipeline)."""

    budgets: tuple[np.ndarray, ...]
    """``R`` float64 ``(M_r,)``: each rank's budget per micro-batch, in plan order."""
    mean_budgets: np.ndarray
    """``(R,)`` each rank's mean over its micro-batches (its one budget without any)."""
    times_after: np.ndarray
    """``(R,)`` predicted makespans at ``budgets``."""
    density_after: np.ndarray
    """``(R,)`` length²-weighted mean density at ``budgets``."""
    attention_after: np.ndarray
    """``(R,)`` predicted attention seconds (all layers) at ``budgets``."""
    anchor_seconds: float
    """``T``: the anchor of the pipelines' evened makespans at the base budget."""
    kept: np.ndarray
    """``(R,)`` bool: the pipeline kept the rank level's one budget for every micro-batch (the
    micro-batch level was not faster there; its numbers are the rank level's)."""


class MicroBatchPrices:
    """The micro-batches of a :class:`PipelineWorkload`, flat (group by group, rank by rank, in
    plan order: ``E`` entries, :meth:`PipelineWorkload.entry_seconds`'), priced at one budget each."""

    def __init__(self, pipe: PipelineWorkload) -> None:
        self.pipe = pipe
        self.knob = pipe.knob
        self.groups = pipe.work.groups
        sizes = [g.lengths.shape[0] * g.lengths.shape[1] for g in self.groups]
        self.bounds = np.cumsum([0, *sizes]).tolist()
        self.size = self.bounds[-1]
        empty = np.zeros(0, dtype=np.int64)
        self.max_lengths = np.concatenate([empty, *(g.lengths.max(axis=-1).reshape(-1) for g in self.groups)])
        """``(E,)`` each micro-batch's longest document."""
        self.rank_of = pipe.entry_rank
        """``(E,)`` each micro-batch's rank."""

    def split(self, flat: np.ndarray) -> list[np.ndarray]:
        """``(E, ...)`` -> one ``(n, M, ...)`` view per group."""
        return [
            flat[a:b].reshape(*g.lengths.shape[:2], *flat.shape[1:])
            for g, a, b in zip(self.groups, self.bounds[:-1], self.bounds[1:], strict=True)
        ]

    def _each(self, values: np.ndarray, active: np.ndarray | None):
        """``[(group, rank selection or None, rows, (n', M) values, output view)]`` for every
        group with an active entry, and the ``(E,)`` zeros the views write into."""
        out = np.zeros(self.size)
        acts = [None] * len(self.groups) if active is None else self.split(active)
        todo = []
        for g, v, o, a in zip(self.groups, self.split(values), self.split(out), acts, strict=True):
            sel = None if a is None else a.any(axis=1)
            if sel is None or sel.any():
                rows = slice(None) if sel is None else sel
                todo.append((g, sel, rows, v[rows], o))
        return todo, out

    def seconds(self, values: np.ndarray, active: np.ndarray | None = None) -> np.ndarray:
        """``(E,)`` micro-batch seconds at ``values`` (with ``active``: every micro-batch of a
        rank with an active one; the others read 0). Every micro-batch at one budget is priced
        once (the base: the skew guard and this level)."""
        if active is not None:
            ranks = np.zeros(self.pipe.num_ranks, dtype=bool)
            ranks[self.rank_of[active]] = True
            active = ranks[self.rank_of]
        return self.pipe.entry_seconds(values, active)

    def coverage(self, values: np.ndarray, active: np.ndarray | None = None) -> np.ndarray:
        """``(E,)`` each micro-batch's gate coverage at ``values``: its documents' (the
        workload's coverage model) weighted by tokens; 1.0 for an empty or inactive one."""
        model = self.pipe.work.coverage_model
        if model is None:
            raise ValueError("this workload has no coverage model")
        todo, out = self._each(values, active)
        for g, _, rows, v, o in todo:
            lengths = g.lengths[rows]
            cov = model.document_coverage(lengths, g.d0[rows], v[..., None])
            num = (np.where(lengths > 0, cov, 0.0) * lengths).sum(axis=-1)
            tokens = lengths.sum(axis=-1).astype(np.float64)
            o[rows] = np.where(tokens > 0, num / np.where(tokens > 0, tokens, 1.0), 1.0)
        return out if active is None else np.where(active, out, 1.0)

    def attention_seconds(self, values: np.ndarray) -> np.ndarray:
        """``(E,)`` each micro-batch's predicted attention seconds (all layers) at ``values``."""
        cost, out = self.pipe.work.cost_model, np.zeros(self.size)
        for g, v, o in zip(self.groups, self.split(values), self.split(out), strict=True):
            valid = g.lengths > 0  # padded slots are not documents (a cost model may reject 0)
            per_doc = np.zeros(g.lengths.shape)
            dens = self.knob.density(g.lengths, g.d0, v[..., None])
            per_doc[valid] = cost.layer_attention_seconds(g.lengths[valid], dens[valid])
            o[...] = cost.num_layers * per_doc.sum(axis=-1)
        return out

    def rank_sums(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(R,)`` length²-weighted mean density and attention seconds (all layers) of each rank
        at per-micro-batch ``values`` (1.0 and 0 for a rank without micro-batches)."""
        work = self.pipe.work
        density, attention = np.ones(work.num_ranks), np.zeros(work.num_ranks)
        for g, v in zip(self.groups, self.split(values), strict=True):
            n = g.ranks.size
            dens = self.knob.density(g.lengths, g.d0, v[..., None])
            total = work.weights[g.ranks]
            num = (g.lengths.astype(np.float64) ** 2 * dens).reshape(n, -1).sum(axis=-1)
            density[g.ranks] = np.where(total > 0, num / np.where(total > 0, total, 1.0), 1.0)
            valid = g.lengths > 0
            per_doc = np.zeros(g.lengths.shape)
            per_doc[valid] = work.cost_model.layer_attention_seconds(g.lengths[valid], dens[valid])
            attention[g.ranks] = work.cost_model.num_layers * per_doc.reshape(n, -1).sum(axis=-1)
        return density, attention

    def makespans(self, seconds: np.ndarray) -> np.ndarray:
        """``(R,)`` each pipeline's makespan from ``(E,)`` micro-batch seconds (heads at
        the base budget, as :class:`PipelineWorkload` prices them); 0 without micro-batches."""
        return self.pipe.makespans(seconds)


def microbatch_floors(prices: MicroBatchPrices, config: DSTConfig) -> np.ndarray:
    """``(E,)`` the smallest budget each micro-batch may be cut to: within the coverage bound
    ``C_m(base) - C_m(v) <= p`` of its own documents when the workload has a coverage model, the
    knob's floor without one (the layer controller then bounds each layer), the base with p = 0."""
    knob, p, n = prices.knob, config.p, prices.size
    base, lo = np.full(n, float(knob.base)), np.full(n, float(knob.lo))
    if p == 0:
        return base
    if p >= 1 or not prices.pipe.has_coverage:
        return lo
    c_base = prices.coverage(base)

    def g(v, sel):
        return prices.coverage(v, sel) - (c_base - p)

    return search_many(knob, g, lo, base, np.ones(n, dtype=bool), largest=False)


@dataclass(frozen=True)
class RankLevel:
    """The rank level's decision (one budget per pipeline), ``(R,)`` each: the starting point."""

    values: np.ndarray
    times: np.ndarray
    """``S_r``: predicted makespans at ``values``."""
    density: np.ndarray
    attention: np.ndarray
    skew: PipelineSkew | None = None
    """The rank level's skew guard (its reference fitted; :mod:`.skew`), which the micro-batch
    level's raises must pass too; None: no guard (``skew_margin`` 1)."""


def decide_microbatches(
    pipe: PipelineWorkload, config: DSTConfig, anchor: Callable[[np.ndarray], float], rank: RankLevel
) -> MicroBatchDecision:
    """Budgets per micro-batch of every pipeline (the module docstring's rule) from the ``rank``
    level's decision; ``anchor``: the config's anchor function. ``config.mode`` must not be off."""
    assert config.mode != "off", "mode off keeps the base budget: no micro-batch level"
    prices = MicroBatchPrices(pipe) if rank.skew is None else rank.skew.prices
    assert prices.pipe is pipe, "the skew guard prices another pipeline workload"
    knob = pipe.knob
    base = np.full(prices.size, float(knob.base))
    floor = microbatch_floors(prices, config)
    hi = base if config.mode == "down" else np.maximum(knob.upper(prices.max_lengths), base)
    t0, tf, th = prices.seconds(base), prices.seconds(floor), prices.seconds(hi)
    span_base, span_floor = prices.makespans(t0), prices.makespans(tf)
    t_anchor = float(anchor(np.minimum(_even_makespans(prices, t0), span_base)))
    target = np.minimum(_targets(config, t_anchor, span_base, span_floor), rank.times)
    level = _levels(prices, np.zeros(prices.size), th, target)  # cuts as deep as the target asks
    over = prices.makespans(np.clip(level, tf, th)) > rank.times  # the floors stopped the cuts
    if over.any():  # the cuts alone (the others at the base), then raises within that makespan
        cut_only = prices.makespans(np.clip(np.minimum(level, t0), tf, th))
        capped = _levels(prices, tf, th, np.minimum(rank.times, cut_only))
        level = np.where(over[prices.rank_of], capped, level)
    level = np.where(np.abs(level - t0) <= LEVEL_RTOL * 10 * t0, np.maximum(level, t0), level)  # the base: kept
    # the largest budget within each micro-batch's level; at its floor where even that is above
    active, lo = tf <= level, np.where(level >= t0, base, floor)  # at or above the base: raised or kept
    values = np.where(active, search_many(knob, lambda v, s: prices.seconds(v, s) - level, lo, hi, active), floor)
    seconds = prices.seconds(values)
    times = prices.makespans(seconds)
    if rank.skew is not None:  # raises above the one budget stay below the rank level's reference
        faster = times < rank.times * (1.0 - FASTER_RTOL)  # the others keep their one budget below
        guarded = rank.skew.safe_microbatches(knob, values, seconds, rank.values, faster)
        if guarded is not values:
            values, times = guarded, prices.makespans(prices.seconds(guarded))
    density, attention = prices.rank_sums(values)
    # kept: one budget per pipeline where the micro-batch level is not faster (then it would
    # only move attention between micro-batches at the same makespan, not a clear gain)
    kept = ~(times < rank.times * (1.0 - FASTER_RTOL))
    values = np.where(kept[prices.rank_of], rank.values[prices.rank_of], values)
    per_rank = [np.zeros(0)] * pipe.num_ranks
    means = rank.values.astype(np.float64).copy()
    for g, v in zip(prices.groups, prices.split(values), strict=True):
        for i, r in enumerate(g.ranks.tolist()):
            per_rank[r] = v[i].copy()
            means[r] = rank.values[r] if kept[r] else float(v[i].mean())
    return MicroBatchDecision(
        budgets=tuple(per_rank),
        mean_budgets=means,
        times_after=np.where(kept, rank.times, times),
        density_after=np.where(kept, rank.density, density),
        attention_after=np.where(kept, rank.attention, attention),
        anchor_seconds=t_anchor,
        kept=kept,
    )


def _even_makespans(prices: MicroBatchPrices, t0: np.ndarray) -> np.ndarray:
    """``(R,)`` each pipeline's makespan with its micro-batches evened at ``(E,)`` times ``t0``
    (each one their mean, heads too)."""
    times, heads = [np.zeros(0)], [np.zeros(0)]
    for head, a0 in zip(prices.pipe.heads, prices.split(t0), strict=True):
        times.append(np.broadcast_to(a0.mean(axis=1, keepdims=True), a0.shape).reshape(-1))
        heads.append(np.broadcast_to(head.mean(axis=1, keepdims=True), a0.shape).reshape(-1))
    pipe, out = prices.pipe, np.zeros(prices.pipe.num_ranks)
    out[pipe.pipelines] = pipe.schedule(np.concatenate(times), np.concatenate(heads))
    return out


def _targets(config: DSTConfig, t_anchor: float, span_base: np.ndarray, span_floor: np.ndarray) -> np.ndarray:
    """``(R,)`` each pipeline's makespan target before the caps (step 3 of the module docstring)."""
    threshold = (1.0 + config.tolerance) * t_anchor
    cut = span_base > threshold
    if config.mode == "down":
        return np.where(cut, threshold, span_base)
    post_cut = float(np.where(cut, np.maximum(threshold, span_floor), span_base).max(initial=0.0))
    raise_to = t_anchor if config.raise_to == "anchor" else post_cut
    return np.where(cut, threshold, np.maximum(raise_to, span_base))


def _levels(prices: MicroBatchPrices, lower: np.ndarray, upper: np.ndarray, target: np.ndarray) -> np.ndarray:
    """``(E,)`` each micro-batch's pipeline's :func:`_water_level` for ``(R,)`` targets, between
    ``(E,)`` lower and upper micro-batch times (every pipeline searched at once: each one's
    search is its own)."""
    pipe = prices.pipe
    if prices.size == 0:
        return np.zeros(0)
    tau = _water_level(lower, upper, pipe.head, target[pipe.pipelines], pipe.schedule)
    return tau[pipe.schedule.entry_pipeline]


def _water_level(tf: np.ndarray, th: np.ndarray, head: np.ndarray, target: np.ndarray, schedule) -> np.ndarray:
    """``(n,)`` each pipeline's highest level ``tau`` whose makespan with micro-batch times
    ``clip(tau, tf, th)`` (``(E,)``: each micro-batch's lowest and highest time, its
    ``head``) is within ``target`` ``(n,)`` (``>=`` the makespan at ``tf``): a bisection to
    :data:`LEVEL_RTOL`. ``schedule``: the pipelines' :class:`~sparsebalance.batching.pipeline.
    JoinedMakespans` (entries pipeline by pipeline).

    The bisection's next ``depth`` midpoints of every possible path (a tree of ``2^depth - 1``
    levels per pipeline) are priced in one makespan pass, then walked exactly as one at a time:
    the same levels in ~4 passes instead of ~25 (issue 54)."""
    n, of = target.size, schedule.entry_pipeline
    depth = max(1, min(TREE_DEPTH, int(np.log2(TREE_ROWS / n + 1))))
    a, b = np.minimum.reduceat(tf, schedule.starts), np.maximum.reduceat(th, schedule.starts)  # span(a): feasible
    steps, first = 0, True
    while steps < 200:  # a safeguard; the tolerance stops it after ~24 steps
        tree = _midpoints(a, b, depth)
        taus = np.concatenate([b[:, None], tree], axis=1) if first else tree
        times = np.clip(taus[of], tf[:, None], th[:, None])  # (E, C)
        heads = np.broadcast_to(head[:, None], times.shape)
        # a midpoint off the bisection's path may price a micro-batch below its head term (a
        # negative stage): such a node is never read, and the ones on the path are unchanged
        times = np.maximum(times, heads)
        ok = schedule(times, heads) <= target[:, None]
        if first:  # the top is within the target: the level is the top
            a, ok, first = np.where(ok[:, 0], b, a), ok[:, 1:], False
        node = np.zeros(n, dtype=np.int64)
        for j in range(depth):
            open_ = b - a > LEVEL_RTOL * np.abs(b)
            if not open_.any():
                return a
            steps += 1
            mid = 0.5 * (a + b)
            good = ok[np.arange(n), (1 << j) - 1 + node]
            a, b = np.where(open_ & good, mid, a), np.where(open_ & ~good, mid, b)
            node = 2 * node + good
    return a


def _midpoints(a: np.ndarray, b: np.ndarray, depth: int) -> np.ndarray:
    """``(n, 2^depth - 1)`` the midpoints a bisection of ``[a, b]`` may probe in its next
    ``depth`` steps, level by level (node ``i`` of level ``j`` at ``2^j - 1 + i``; its children
    ``2 i`` (the midpoint failed: ``[lo, mid]``) and ``2 i + 1`` (``[mid, hi]``)), each computed
    as the bisection computes it."""
    lo, hi, out = a[:, None], b[:, None], []
    for _ in range(depth):
        mid = 0.5 * (lo + hi)
        out.append(mid)
        lo, hi = np.stack([lo, mid], axis=2).reshape(a.size, -1), np.stack([mid, hi], axis=2).reshape(a.size, -1)
    return np.concatenate(out, axis=1)
