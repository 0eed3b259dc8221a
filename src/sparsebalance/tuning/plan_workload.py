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
    """Ranks sharing one padded shape: ``lengths``/``d0`` ``(n, M, K)``, ``ranks`` ``(n,)``."""

    def __init__(self, ranks: list[int], lengths: np.ndarray, d0: np.ndarray) -> None:
        self.ranks = np.asarray(ranks, dtype=np.int64)
        self.lengths = lengths
        self.d0 = d0


class PlanWorkload:
    """All ranks' micro-batches, priced per rank at per-rank gammas.

    ``seconds(gammas)`` equals ``[RankWorkload(plan[r]).seconds(gammas[r]) for r in range(R)]``
    exactly; ranks without micro-batches cost 0.
    """

    def __init__(
        self, plan: Sequence[Sequence[MicroBatch]], cost_model: CostModel, curve: DensityCurve
    ) -> None:
        self.num_ranks = len(plan)
        self.cost_model = cost_model
        self.curve = curve
        by_shape: dict[tuple[int, int], list[int]] = {}
        for r, mbs in enumerate(plan):
            if mbs:
                k = max(len(mb.lengths) for mb in mbs)
                by_shape.setdefault((len(mbs), k), []).append(r)
        self.groups: list[_Group] = []
        # Prices at one gamma for every rank, kept: the tuners of several ablations (modes,
        # anchors) on one plan all start from the times at gamma0 and gamma_min.
        self._memo: dict[tuple[str, float], np.ndarray] = {}
        # Per-rank length**2 weights and (rank, document) pairs for densities and attention.
        self._weight = np.zeros(self.num_ranks)
        for (m, k), ranks in sorted(by_shape.items()):
            lengths = np.zeros((len(ranks), m, k), dtype=np.int64)
            d0 = np.ones((len(ranks), m, k), dtype=np.float64)
            for i, r in enumerate(ranks):
                for j, mb in enumerate(plan[r]):
                    lengths[i, j, : len(mb.lengths)] = mb.lengths
                    d0[i, j, : len(mb.densities)] = mb.densities
            group = _Group(ranks, lengths, d0)
            self._weight[group.ranks] = _row_sums(lengths.astype(np.float64) ** 2)
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
            lengths, d0 = g.lengths[sel], g.d0[sel]
            n, m, k = lengths.shape
            dens = self.curve.density(d0, gammas[ranks][:, None, None])
            t = self.cost_model.predict_many(lengths.reshape(n * m, k), dens.reshape(n * m, k))
            out[ranks] = np.asarray(t, dtype=np.float64).reshape(n, m).sum(axis=-1)
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
