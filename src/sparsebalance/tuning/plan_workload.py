"""Whole-plan DST pricing: every rank of a plan priced at its own gamma in a few vectorised calls.

:meth:`DSTTuner.decide <sparsebalance.tuning.dst.DSTTuner.decide>` runs on the whole plan (the
trainer before the step, the simulator for thousands of virtual ranks). Pricing rank by rank
(:class:`~sparsebalance.tuning.dst.RankWorkload`) costs one ``predict_many`` call per rank and
bisection probe: about 25 R calls per step. Here ranks are grouped by their padded shape
``(M, K)`` (micro-batches, most documents in one), so each probe is one ``predict_many`` call per
group over all the ranks still bisecting.

Results are bit-for-bit those of ``RankWorkload``: a rank's rows keep its own padding ``K`` and its
micro-batch times are summed along a row of length ``M``, the same reductions numpy performs for a
single rank. The bisection is the same rule, run for all ranks at once (ranks stop independently).

Complexity per probe: O(total documents of the active ranks) numpy work, O(number of groups)
Python calls; building is O(total micro-batches) Python.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..workload import CostModel, MicroBatch
from .curve import DensityCurve


class _Group:
    """Ranks sharing one padded shape: ``lengths``/``d0`` ``(n, M, K)``, ``ranks`` ``(n,)``.

    With a cost model that has ``prepare(lengths)`` (:meth:`LatencyModel.prepare
    <sparsebalance.latency.LatencyModel.prepare>`), the length half of every prediction is done
    once per group and per set of priced ranks (a bisection prices the same set at ~23 gammas).
    """

    def __init__(self, ranks: list[int], lengths: np.ndarray, d0: np.ndarray, cost_model) -> None:
        self.ranks = np.asarray(ranks, dtype=np.int64)
        self.lengths = lengths
        self.d0 = d0
        self.cost_model = cost_model
        n, m, k = lengths.shape
        prepare = getattr(cost_model, "prepare", None)
        self._prepared = None if prepare is None else prepare(lengths.reshape(n * m, k))
        self._subsets: dict[bytes, object] = {}

    def predict(self, sel: np.ndarray | None, dens: np.ndarray) -> np.ndarray:
        """``(n', M)`` micro-batch seconds of the selected ranks (``sel`` bool ``(n,)``, None =
        all) at ``dens`` ``(n', M, K)``; exactly ``cost_model.predict_many`` on those rows."""
        lengths = self.lengths if sel is None else self.lengths[sel]
        n, m, k = lengths.shape
        if self._prepared is None:
            t = self.cost_model.predict_many(lengths.reshape(n * m, k), dens.reshape(n * m, k))
        else:
            t = self._subset(sel).predict(dens.reshape(n * m, k))
        return np.asarray(t, dtype=np.float64).reshape(n, m)

    def _subset(self, sel: np.ndarray | None):
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
    """All ranks' micro-batches, priced per rank at per-rank gammas.

    ``seconds(gammas)`` equals ``[RankWorkload(plan[r]).seconds(gammas[r]) for r in range(R)]``
    exactly; ranks without micro-batches cost 0.
    """

    def __init__(
        self, plan: Sequence[Sequence[MicroBatch]], cost_model: CostModel, curve: DensityCurve
    ) -> None:
        mb_rank = [r for r, mbs in enumerate(plan) for _ in mbs]
        sizes = [len(mb.lengths) for mbs in plan for mb in mbs]
        lengths = [n for mbs in plan for mb in mbs for n in mb.lengths]
        d0 = [d for mbs in plan for mb in mbs for d in mb.densities]
        self._build(
            len(plan), np.array(mb_rank, dtype=np.int64), np.array(sizes, dtype=np.int64),
            np.array(lengths, dtype=np.int64), np.array(d0, dtype=np.float64), cost_model, curve,
        )  # fmt: skip

    @classmethod
    def from_flat(
        cls,
        num_ranks: int,
        mb_rank: np.ndarray,
        mb_sizes: np.ndarray,
        lengths: np.ndarray,
        d0: np.ndarray,
        cost_model: CostModel,
        curve: DensityCurve,
    ) -> PlanWorkload:
        """The same workload from flat arrays in plan order (no ``MicroBatch`` objects):
        ``mb_rank`` ``(B,)`` non-decreasing rank of each micro-batch, ``mb_sizes`` ``(B,)`` its
        document count, ``lengths`` / ``d0`` ``(D,)`` its documents' tokens and densities."""
        self = cls.__new__(cls)
        self._build(num_ranks, mb_rank, mb_sizes, lengths, d0, cost_model, curve)
        return self

    def _build(self, num_ranks, mb_rank, mb_sizes, lengths, d0, cost_model, curve) -> None:
        self.num_ranks = num_ranks
        self.cost_model = cost_model
        self.curve = curve
        # Prices at one gamma for every rank, kept: the tuners of several ablations (modes,
        # anchors) on one plan all start from the times at gamma0 and gamma_min.
        self._memo: dict[tuple[str, float], np.ndarray] = {}
        self.groups: list[_Group] = []
        self._weight = np.zeros(num_ranks)
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
        shapes, group_of = np.unique(
            np.stack([num_mb[busy], width[busy]], axis=1), axis=0, return_inverse=True
        )
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
            self.groups.append(group)

    def seconds(self, gammas: np.ndarray, active: np.ndarray | None = None) -> np.ndarray:
        """``(R,)`` predicted seconds of each rank at ``gammas[r]`` (``(R,)``); with ``active``
        (bool ``(R,)``) only those ranks are priced and the others are left at 0."""
        key = self._key("seconds", gammas) if active is None or active.all() else None
        if key in self._memo:
            return self._memo[key].copy()
        out = np.zeros(self.num_ranks)
        for g in self.groups:
            sel = slice(None) if active is None else active[g.ranks]
            ranks = g.ranks[sel]
            if ranks.size == 0:
                continue
            dens = self.curve.density(g.d0[sel], gammas[ranks][:, None, None])
            out[ranks] = g.predict(None if active is None else sel, dens).sum(axis=-1)
        return self._remember(key, out)

    def attention_seconds(self, gammas: np.ndarray) -> np.ndarray:
        """``(R,)`` predicted attention seconds (all layers) at ``gammas[r]``."""
        key = self._key("attention", gammas)
        if key in self._memo:
            return self._memo[key].copy()
        out = np.zeros(self.num_ranks)
        for g in self.groups:
            valid = g.lengths > 0
            dens = self.curve.density(g.d0, gammas[g.ranks][:, None, None])
            per_doc = np.zeros(g.lengths.shape)
            per_doc[valid] = self.cost_model.layer_attention_seconds(g.lengths[valid], dens[valid])
            # Summed as one row of M * K per rank: the reduction RankWorkload performs.
            out[g.ranks] = self.cost_model.num_layers * _row_sums(per_doc)
        return self._remember(key, out)

    def mean_density(self, gammas: np.ndarray) -> np.ndarray:
        """``(R,)`` length²-weighted mean density at ``gammas[r]`` (1.0 for an empty rank)."""
        key = self._key("density", gammas)
        if key in self._memo:
            return self._memo[key].copy()
        out = np.ones(self.num_ranks)
        for g in self.groups:
            w = g.lengths.astype(np.float64) ** 2
            dens = self.curve.density(g.d0, gammas[g.ranks][:, None, None])
            total = self._weight[g.ranks]
            num = _row_sums(w * dens)
            out[g.ranks] = np.where(total > 0, num / np.where(total > 0, total, 1.0), 1.0)
        return self._remember(key, out)

    @staticmethod
    def _key(kind: str, gammas: np.ndarray) -> tuple[str, float] | None:
        """A memo key when every rank has the same gamma (the only case worth keeping)."""
        if gammas.size and np.all(gammas == gammas[0]):
            return (kind, float(gammas[0]))
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


def largest_feasible_many(
    work: PlanWorkload,
    lo: np.ndarray,
    hi: np.ndarray,
    limit: np.ndarray,
    active: np.ndarray,
    tol: float,
) -> np.ndarray:
    """Per active rank, the largest gamma in ``[lo, hi]`` with predicted seconds ``<= limit``
    (the vectorised ``_largest_feasible`` of :mod:`.dst`: same probes, same result). Inactive
    ranks get ``lo``. All arrays ``(R,)``; ``f(lo) <= limit`` is the caller's precondition."""
    lo, hi = lo.astype(np.float64).copy(), hi.astype(np.float64).copy()
    result = lo.copy()
    if not active.any():
        return result
    at_hi = work.seconds(hi, active) <= limit
    done = active & at_hi
    result[done] = hi[done]
    searching = active & ~at_hi
    while True:
        searching &= hi - lo > tol
        if not searching.any():
            break
        mid = 0.5 * (lo + hi)
        ok = work.seconds(mid, searching) <= limit
        lo = np.where(searching & ok, mid, lo)
        hi = np.where(searching & ~ok, mid, hi)
    bisected = active & ~at_hi
    result[bisected] = lo[bisected]
    return result
