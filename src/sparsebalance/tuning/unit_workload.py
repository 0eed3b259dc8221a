"""DST over context-parallel units: the workers of a hybrid plan, priced at per-worker budgets.

A CP unit's ranks share one budget (one layout per document), so DST cannot give them different
budgets. Workers: the connected groups of ranks that CP units join (ranks of overlapping unit
windows are merged; they are contiguous ranges), and every rank in no CP unit on its own. A
worker's time at a budget is the finish time of its slowest rank: CP units run first in slot order,
each starting when all its ranks are free (its seconds from the
:class:`~sparsebalance.latency.context.ContextCost` at the unit's density
``knob.density(L, d0, v)``),
then each rank's whole-document micro-batches (a :class:`PlanWorkload`). The tuner cuts and raises
workers exactly as it does ranks: :class:`UnitWorkload` has :class:`PlanWorkload`'s interface
(``num_ranks`` is the number of workers), so :meth:`DSTTuner.decide_arrays
<sparsebalance.tuning.dst.DSTTuner.decide_arrays>` runs unchanged.

:func:`decide_units` turns the tuner's per-worker decision into the trainer's per-rank
:class:`~sparsebalance.tuning.StepDecision`.

Cost per pricing: one ``PlanWorkload.seconds`` over the ranks, one vectorised ``unit_seconds``
over the U units and a Python pass over them in slot order (O(U) slices).
"""

from __future__ import annotations

import numpy as np

from .knob import Knob
from .plan_workload import PlanWorkload
from .records import RankDecision, StepDecision


class UnitWorkload:
    """Workers of a hybrid plan (see the module docstring).

    Args:
        num_ranks: R.
        unit_lengths / unit_d0: ``(U,)`` tokens and base-budget density of each CP unit's
            document.
        unit_degree / unit_start: ``(U,)`` k and first rank (the unit runs on ``start .. start +
            k - 1``), in slot order.
        mb_rank / mb_sizes / lengths / d0: the whole-document micro-batches as flat arrays (see
            :meth:`PlanWorkload.from_flat`).
        cost_model: a ``ContextCost``; knob: the budget's density response; coverage: an
            optional coverage model (see :class:`PlanWorkload`).
    """

    def __init__(
        self,
        num_ranks: int,
        unit_lengths,
        unit_d0,
        unit_degree,
        unit_start,
        mb_rank,
        mb_sizes,
        lengths,
        d0,
        cost_model,
        knob: Knob,
        coverage=None,
    ) -> None:
        self.cost_model = cost_model
        self.knob = knob
        self.coverage_model = coverage
        self.num_rank_slots = num_ranks
        self.dp = PlanWorkload.from_flat(num_ranks, mb_rank, mb_sizes, lengths, d0, cost_model, knob, coverage)
        self.u_len = np.asarray(unit_lengths, dtype=np.int64)
        self.u_d0 = np.asarray(unit_d0, dtype=np.float64)
        self.u_k = np.asarray(unit_degree, dtype=np.int64)
        self.u_start = np.asarray(unit_start, dtype=np.int64)
        # Workers: merge the unit windows [start, start + k) into contiguous rank ranges.
        joined = np.zeros(num_ranks, dtype=bool)  # rank r belongs to the worker of rank r - 1
        for s, k in zip(self.u_start.tolist(), self.u_k.tolist(), strict=True):
            joined[s + 1 : s + k] = True
        self.worker_start = np.flatnonzero(~joined)
        self.worker_of = np.cumsum(~joined) - 1  # (R,)
        self.num_ranks = int(self.worker_start.size)  # the tuner's "ranks" are workers
        self.unit_worker = self.worker_of[self.u_start]
        self._weight = np.bincount(self.worker_of, self.dp.weights, self.num_ranks) + np.bincount(
            self.unit_worker, self.u_len.astype(np.float64) ** 2, self.num_ranks
        )
        self.max_lengths = np.zeros(self.num_ranks, dtype=np.int64)
        np.maximum.at(self.max_lengths, self.worker_of, self.dp.max_lengths)
        np.maximum.at(self.max_lengths, self.unit_worker, self.u_len)
        self._memo: dict[float, np.ndarray] = {}

    # ------------------------------------------------------------------ pricing
    def _unit_density(self, values: np.ndarray) -> np.ndarray:
        """``(U,)`` each unit's density at its worker's value (``values`` ``(W,)``)."""
        return self.knob.density(self.u_len, self.u_d0, values[self.unit_worker])

    def rank_seconds(self, values: np.ndarray) -> np.ndarray:
        """``(R,)`` finish time of every rank with worker w at ``values[w]`` (``(W,)``)."""
        values = np.asarray(values, dtype=np.float64)
        g_rank = values[self.worker_of]
        ready = np.zeros(self.num_rank_slots)
        if self.u_len.size:
            dens = self._unit_density(values)
            secs, _ = self.cost_model.unit_seconds(self.u_len, dens, self.u_k)
            for s, k, t in zip(self.u_start.tolist(), self.u_k.tolist(), secs.tolist(), strict=True):
                ready[s : s + k] = ready[s : s + k].max() + t
        return ready + self.dp.seconds(g_rank)

    def seconds(self, values: np.ndarray, active: np.ndarray | None = None) -> np.ndarray:
        """``(W,)`` each worker's time (its slowest rank) at ``values`` ``(W,)``; workers outside
        ``active`` (bool ``(W,)``) read 0, like :meth:`PlanWorkload.seconds`."""
        key = float(values[0]) if values.size and np.all(values == values[0]) else None
        if key is not None and key in self._memo:
            out = self._memo[key].copy()
        else:
            out = np.maximum.reduceat(self.rank_seconds(values), self.worker_start)
            if key is not None:
                self._memo[key] = out.copy()
        if active is not None:
            out = np.where(active, out, 0.0)
        return out

    @property
    def has_coverage(self) -> bool:
        return self.coverage_model is not None

    def coverage(self, values: np.ndarray, active: np.ndarray | None = None) -> np.ndarray:
        """``(W,)`` each worker's coverage at ``values`` (its documents', weighted by tokens)."""
        values = np.asarray(values, dtype=np.float64)
        g_rank = values[self.worker_of]
        tokens = np.bincount(self.worker_of, self.dp.tokens, self.num_ranks)
        num = np.bincount(self.worker_of, self.dp.coverage(g_rank) * self.dp.tokens, self.num_ranks)
        if self.u_len.size:
            cov = self.coverage_model.document_coverage(self.u_len, self.u_d0, values[self.unit_worker])
            num += np.bincount(self.unit_worker, cov * self.u_len, self.num_ranks)
            tokens += np.bincount(self.unit_worker, self.u_len.astype(float), self.num_ranks)
        out = np.where(tokens > 0, num / np.where(tokens > 0, tokens, 1.0), 1.0)
        return out if active is None else np.where(active, out, 1.0)

    def attention_seconds(self, values: np.ndarray) -> np.ndarray:
        """``(W,)`` predicted attention seconds (all layers, all the worker's ranks)."""
        values = np.asarray(values, dtype=np.float64)
        g_rank = values[self.worker_of]
        out = np.bincount(self.worker_of, self.dp.attention_seconds(g_rank), self.num_ranks)
        if self.u_len.size:
            dens = self._unit_density(values)
            attn = self.cost_model.num_layers * np.asarray(
                self.cost_model.layer_attention_seconds(self.u_len, dens), dtype=np.float64
            )
            out += np.bincount(self.unit_worker, attn, self.num_ranks)
        return out

    def mean_density(self, values: np.ndarray) -> np.ndarray:
        """``(W,)`` length²-weighted mean density (1.0 for an empty worker)."""
        values = np.asarray(values, dtype=np.float64)
        g_rank = values[self.worker_of]
        num = np.bincount(self.worker_of, self.dp.weights * self.dp.mean_density(g_rank), self.num_ranks)
        if self.u_len.size:
            dens = self._unit_density(values)
            num += np.bincount(self.unit_worker, self.u_len.astype(np.float64) ** 2 * dens, self.num_ranks)
        w = self._weight
        return np.where(w > 0, num / np.where(w > 0, w, 1.0), 1.0)

    @property
    def weights(self) -> np.ndarray:
        """``(W,)`` sum of length² over each worker's documents."""
        return self._weight

    @classmethod
    def from_plan(cls, plan, cost_model, knob: Knob, coverage=None) -> UnitWorkload:
        """The workload of a hybrid :class:`~sparsebalance.batching.Plan` (its ``units`` each
        hold one document, as ``sab-cp`` builds them; ``rank_units[r][j] < 0`` marks rank r's
        whole-document micro-batches)."""
        units = plan.units
        if any(len(u.lengths) != 1 for u in units):
            raise ValueError("UnitWorkload prices CP units of one document each")
        mb_rank, sizes, lengths, d0 = [], [], [], []
        for r, (mbs, idx) in enumerate(zip(plan.ranks, plan.rank_units, strict=True)):
            for mb, u in zip(mbs, idx, strict=True):
                if u < 0:
                    mb_rank.append(r)
                    sizes.append(len(mb.lengths))
                    lengths.extend(mb.lengths)
                    d0.extend(mb.densities)
        return cls(
            plan.num_ranks,
            [u.lengths[0] for u in units],
            [u.densities[0] for u in units],
            [u.degree for u in units],
            [u.ranks[0] for u in units],
            np.array(mb_rank, dtype=np.int64),
            np.array(sizes, dtype=np.int64),
            np.array(lengths, dtype=np.int64),
            np.array(d0, dtype=np.float64),
            cost_model,
            knob,
            coverage,
        )


def decide_units(tuner, plan, cost_model) -> StepDecision:
    """DST's :class:`StepDecision` for a hybrid plan, one :class:`RankDecision` per rank: the
    ranks of a worker (ranks joined by CP units) share its budget and role; a rank's times are
    its own finish times (:meth:`UnitWorkload.rank_seconds`); a worker's density and attention
    seconds are split evenly over its ranks (so the step's budget sums count them once)."""
    work = UnitWorkload.from_plan(plan, cost_model, tuner.knob)
    a = tuner.decide_arrays(work)
    base = np.full(work.num_ranks, float(tuner.knob.base))
    before, after = work.rank_seconds(base), work.rank_seconds(a.budgets)
    size = np.bincount(work.worker_of, minlength=work.num_ranks).astype(np.float64)
    ranks = []
    for r, w in enumerate(work.worker_of.tolist()):
        ranks.append(
            RankDecision(
                r,
                a.targets.roles[w],
                float(a.budgets[w]),
                float(after[r]),
                float(before[r]),
                float(after[r]),
                float(a.density_before[w]),
                float(a.density_after[w]),
                float(a.attention_before[w] / size[w]),
                float(a.attention_after[w] / size[w]),
            )
        )
    return tuner.assemble(a.targets, ranks)
