"""Whole-plan DST pricing: every rank of a plan priced at its own budget in a few vectorised calls.

:meth:`DSTTuner.decide <sparsebalance.tuning.dst.DSTTuner.decide>` runs on the whole plan (the
trainer before the step, the simulator for thousands of virtual ranks). Pricing rank by rank
(:class:`~sparsebalance.tuning.dst.RankWorkload`) costs one ``predict_many`` call per rank and
bisection probe: about 25 R calls per step. Here ranks are grouped by their padded shape
``(M, K)`` (micro-batches, most documents in one), so each probe is one ``predict_many`` call per
group over all the ranks still bisecting.

Results are bit-for-bit those of ``RankWorkload``: a rank's rows keep its own padding ``K`` and its
micro-batch times are summed along a row of length ``M``, the same reductions numpy performs for a
single rank. The search is the same rule, run for all ranks at once (ranks stop independently).

Coverage (optional): with a ``coverage`` model (``document_coverage(lengths, d0, values)``,
elementwise, in [0, 1]; the simulator's :mod:`~sparsebalance.simulate.sparsity`) a rank's
coverage at a budget is its documents' coverage weighted by tokens, what DST's coverage bound
reads when it decides before any forward.

Complexity per probe: O(total documents of the active ranks) numpy work, O(number of groups)
Python calls; building is O(total micro-batches) Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from ..workload import CostModel, MicroBatch, PreparableCost, PreparedCost
from .knob import Knob


class StepWorkload(Protocol):
    """What :meth:`DSTTuner.decide_arrays <sparsebalance.tuning.dst.DSTTuner.decide_arrays>`
    prices: W workers (ranks, or ranks joined by CP units) at per-worker knob values ``(W,)``.
    :class:`PlanWorkload` and :class:`~.unit_workload.UnitWorkload` implement it."""

    num_ranks: int
    """W, the workers."""
    knob: Knob
    max_lengths: np.ndarray
    """``(W,)`` each worker's longest document (0 for an empty one)."""

    @property
    def has_coverage(self) -> bool:
        """Whether :meth:`coverage` is available (a coverage model was given)."""
        ...

    def seconds(self, values: np.ndarray, active: np.ndarray | None = None) -> np.ndarray:
        """``(W,)`` predicted seconds at ``values``; workers outside ``active`` read 0."""
        ...

    def coverage(self, values: np.ndarray, active: np.ndarray | None = None) -> np.ndarray:
        """``(W,)`` gate coverage at ``values``; workers outside ``active`` read 1."""
        ...

    def mean_density(self, values: np.ndarray) -> np.ndarray:
        """``(W,)`` length²-weighted mean density at ``values``."""
        ...

    def attention_seconds(self, values: np.ndarray) -> np.ndarray:
        """``(W,)`` predicted attention seconds (all layers) at ``values``."""
        ...


class _Group:
    """Ranks sharing one padded shape: ``lengths``/``d0`` ``(n, M, K)``, ``ranks`` ``(n,)``.

    With a cost model whose ``prepare(lengths)`` returns a :class:`PreparedCost`
    (:meth:`LatencyModel.prepare <sparsebalance.latency.LatencyModel.prepare>`), the length half
    of every prediction is done once per group and per set of priced ranks (a bisection prices
    the same set at ~23 budgets).
    """

    def __init__(self, ranks: list[int], lengths: np.ndarray, d0: np.ndarray, cost_model: CostModel) -> None:
        self.ranks = np.asarray(ranks, dtype=np.int64)
        self.lengths = lengths
        self.d0 = d0
        self.cost_model = cost_model
        n, m, k = lengths.shape
        prepared = None
        if isinstance(cost_model, PreparableCost):  # an optional capability, declared by type
            prepared = cost_model.prepare(lengths.reshape(n * m, k))
        self._prepared = prepared
        self._subsets: dict[bytes, PreparedCost] = {}

    def predict(self, sel: np.ndarray | slice | None, dens: np.ndarray) -> np.ndarray:
        """``(n', M)`` micro-batch seconds of the selected ranks (``sel`` bool ``(n,)``, None =
        all) at ``dens`` ``(n', M, K)``; exactly ``cost_model.predict_many`` on those rows."""
        lengths = self.lengths if sel is None else self.lengths[sel]
        n, m, k = lengths.shape
        if self._prepared is None:
            t = self.cost_model.predict_many(lengths.reshape(n * m, k), dens.reshape(n * m, k))
        else:
            t = self._subset(sel).predict(dens.reshape(n * m, k))
        return np.asarray(t, dtype=np.float64).reshape(n, m)

    def _subset(self, sel: np.ndarray | None) -> PreparedCost:
        assert self._prepared is not None
        if sel is None or sel.all():
            return self._prepared
        key = sel.tobytes()
        if key not in self._subsets:
            if len(self._subsets) >= 4:  # a bisection reuses one or two sets; keep a few
                self._subsets.clear()
            rows = np.flatnonzero(np.repeat(sel, self.lengths.shape[1]))
            self._subsets[key] = self._prepared.take(rows)
        return self._subsets[key]


class PlanWorkload:
    """All ranks' micro-batches, priced per rank at per-rank budgets (knob values).

    ``seconds(values)`` equals ``[RankWorkload(plan[r]).seconds(values[r]) for r in range(R)]``
    exactly; ranks without micro-batches cost 0.
    """

    def __init__(
        self,
        plan: Sequence[Sequence[MicroBatch]],
        cost_model: CostModel,
        knob: Knob,
        coverage=None,
    ) -> None:
        mb_rank = [r for r, mbs in enumerate(plan) for _ in mbs]
        sizes = [len(mb.lengths) for mbs in plan for mb in mbs]
        lengths = [n for mbs in plan for mb in mbs for n in mb.lengths]
        d0 = [d for mbs in plan for mb in mbs for d in mb.densities]
        self._build(
            len(plan),
            np.array(mb_rank, dtype=np.int64),
            np.array(sizes, dtype=np.int64),
            np.array(lengths, dtype=np.int64),
            np.array(d0, dtype=np.float64),
            cost_model,
            knob,
            coverage,
        )

    @classmethod
    def from_flat(
        cls,
        num_ranks: int,
        mb_rank: np.ndarray,
        mb_sizes: np.ndarray,
        lengths: np.ndarray,
        d0: np.ndarray,
        cost_model: CostModel,
        knob: Knob,
        coverage=None,
    ) -> PlanWorkload:
        """The same workload from flat arrays in plan order (no ``MicroBatch`` objects):
        ``mb_rank`` ``(B,)`` non-decreasing rank of each micro-batch, ``mb_sizes`` ``(B,)`` its
        document count, ``lengths`` / ``d0`` ``(D,)`` its documents' tokens and densities."""
        self = cls.__new__(cls)
        self._build(num_ranks, mb_rank, mb_sizes, lengths, d0, cost_model, knob, coverage)
        return self

    def _build(self, num_ranks, mb_rank, mb_sizes, lengths, d0, cost_model, knob, coverage):
        self.num_ranks = num_ranks
        self.cost_model = cost_model
        self.knob = knob
        self.coverage_model = coverage
        # Prices at one budget for every rank, kept: the tuners of several ablations (modes,
        # anchors) on one plan all start from the times at the base budget and the floor.
        self._memo: dict[tuple[str, float], np.ndarray] = {}
        self.groups: list[_Group] = []
        self._weight = np.zeros(num_ranks)
        self.tokens = np.zeros(num_ranks)
        """``(R,)`` tokens of each rank's documents."""
        self.max_lengths = np.zeros(num_ranks, dtype=np.int64)
        """``(R,)`` each rank's longest document (0 for an empty rank)."""
        # Each document's rank, micro-batch (inside its rank) and slot (inside its micro-batch).
        num_mb = np.bincount(mb_rank, minlength=num_ranks)
        width = np.zeros(num_ranks, dtype=np.int64)
        np.maximum.at(width, mb_rank, mb_sizes)
        mb_pos = np.arange(mb_rank.size) - np.repeat(np.cumsum(num_mb) - num_mb, num_mb)
        doc_mb = np.repeat(np.arange(mb_rank.size), mb_sizes)
        doc_pos = np.arange(doc_mb.size) - np.repeat(np.cumsum(mb_sizes) - mb_sizes, mb_sizes)
        doc_rank = mb_rank[doc_mb]
        # Ranks grouped by padded shape (M, K), shapes in increasing order, ranks increasing.
        busy = np.flatnonzero(num_mb > 0)
        shapes, group_of = np.unique(np.stack([num_mb[busy], width[busy]], axis=1), axis=0, return_inverse=True)
        rank_group = np.full(num_ranks, -1, dtype=np.int64)
        rank_group[busy] = group_of.reshape(-1)
        slot = np.zeros(num_ranks, dtype=np.int64)  # a rank's index inside its group
        for gi, (m, k) in enumerate(shapes.tolist()):
            ranks = busy[group_of.reshape(-1) == gi]
            slot[ranks] = np.arange(ranks.size)
            docs = rank_group[doc_rank] == gi
            at = (slot[doc_rank[docs]], mb_pos[doc_mb[docs]], doc_pos[docs])
            g_lengths = np.zeros((ranks.size, m, k), dtype=np.int64)
            g_d0 = np.ones((ranks.size, m, k), dtype=np.float64)
            g_lengths[at] = lengths[docs]
            g_d0[at] = d0[docs]
            group = _Group(ranks.tolist(), g_lengths, g_d0, cost_model)
            self._weight[group.ranks] = _row_sums(g_lengths.astype(np.float64) ** 2)
            self.tokens[group.ranks] = _row_sums(g_lengths.astype(np.float64))
            self.max_lengths[group.ranks] = g_lengths.reshape(ranks.size, -1).max(axis=1, initial=0)
            self.groups.append(group)

    def _density(self, g: _Group, values: np.ndarray, sel=slice(None)) -> np.ndarray:
        """``(n', M, K)`` densities of group ``g``'s (selected) ranks at their values."""
        return self.knob.density(g.lengths[sel], g.d0[sel], values[g.ranks[sel]][:, None, None])

    def seconds(self, values: np.ndarray, active: np.ndarray | None = None) -> np.ndarray:
        """``(R,)`` predicted seconds of each rank at ``values[r]`` (``(R,)``); with ``active``
        (bool ``(R,)``) only those ranks are priced and the others are left at 0."""
        key = self._key("seconds", values) if active is None or active.all() else None
        if key in self._memo:
            return self._memo[key].copy()
        out = np.zeros(self.num_ranks)
        for g in self.groups:
            sel = slice(None) if active is None else active[g.ranks]
            ranks = g.ranks[sel]
            if ranks.size == 0:
                continue
            dens = self._density(g, values, sel)
            out[ranks] = g.predict(None if active is None else sel, dens).sum(axis=-1)
        return self._remember(key, out)

    @property
    def has_coverage(self) -> bool:
        return self.coverage_model is not None

    def coverage(self, values: np.ndarray, active: np.ndarray | None = None) -> np.ndarray:
        """``(R,)`` each rank's coverage at ``values[r]``: its documents' coverage (the coverage
        model's) weighted by tokens; 1.0 for empty or inactive ranks."""
        if self.coverage_model is None:
            raise ValueError("this workload has no coverage model")
        out = np.ones(self.num_ranks)
        for g in self.groups:
            sel = slice(None) if active is None else active[g.ranks]
            ranks = g.ranks[sel]
            if ranks.size == 0:
                continue
            lengths = g.lengths[sel]
            cov = self.coverage_model.document_coverage(lengths, g.d0[sel], values[ranks][:, None, None])
            num = _row_sums(np.where(lengths > 0, cov, 0.0) * lengths)
            tokens = self.tokens[ranks]
            out[ranks] = np.where(tokens > 0, num / np.where(tokens > 0, tokens, 1.0), 1.0)
        return out

    def attention_seconds(self, values: np.ndarray) -> np.ndarray:
        """``(R,)`` predicted attention seconds (all layers) at ``values[r]``."""
        key = self._key("attention", values)
        if key in self._memo:
            return self._memo[key].copy()
        out = np.zeros(self.num_ranks)
        for g in self.groups:
            valid = g.lengths > 0
            dens = self._density(g, values)
            per_doc = np.zeros(g.lengths.shape)
            per_doc[valid] = self.cost_model.layer_attention_seconds(g.lengths[valid], dens[valid])
            # Summed as one row of M * K per rank: the reduction RankWorkload performs.
            out[g.ranks] = self.cost_model.num_layers * _row_sums(per_doc)
        return self._remember(key, out)

    def mean_density(self, values: np.ndarray) -> np.ndarray:
        """``(R,)`` length²-weighted mean density at ``values[r]`` (1.0 for an empty rank)."""
        key = self._key("density", values)
        if key in self._memo:
            return self._memo[key].copy()
        out = np.ones(self.num_ranks)
        for g in self.groups:
            w = g.lengths.astype(np.float64) ** 2
            dens = self._density(g, values)
            total = self._weight[g.ranks]
            num = _row_sums(w * dens)
            out[g.ranks] = np.where(total > 0, num / np.where(total > 0, total, 1.0), 1.0)
        return self._remember(key, out)

    @staticmethod
    def _key(kind: str, values: np.ndarray) -> tuple[str, float] | None:
        """A memo key when every rank has the same budget (the only case worth keeping)."""
        if values.size and np.all(values == values[0]):
            return (kind, float(values[0]))
        return None

    def _remember(self, key: tuple[str, float] | None, out: np.ndarray) -> np.ndarray:
        if key is not None:
            self._memo[key] = out.copy()
        return out

    @property
    def weights(self) -> np.ndarray:
        """``(R,)`` sum of length² over each rank's documents (the density weights)."""
        return self._weight


def _row_sums(x: np.ndarray) -> np.ndarray:
    """``(n, M, K) -> (n,)``: each rank's entries summed as one contiguous row, like ``np.sum``
    of that rank's ``(M, K)`` array (so results match :class:`RankWorkload` bit for bit)."""
    return np.ascontiguousarray(x).reshape(x.shape[0], -1).sum(axis=-1)
