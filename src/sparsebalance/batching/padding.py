"""Micro-batches padded to their longest document (``PlanConfig.pad_micro_batches``): what
``sab`` adds to its candidates when micro-batches are run without packing.

A framework that does not pack (Megatron-LM without ``cu_seqlens``, the SparseBalance paper's
micro-batch 2) runs a micro-batch of K documents as a ``(K, S)`` batch, S its longest document:
every document costs what the longest does (:func:`~.plan.padded_packs` prices it so when
``Items.padded``). Balancing by additive document cost then puts long and short documents
together and pays the padding; grouping similar lengths saves it. So with padding, ``sab``
also prices two length-grouped plans and keeps the least predicted one:

- ``sorted``: its own rank assignment, each rank's documents sorted by length (longest first,
  ties by index) and cut into consecutive micro-batches (LongAlign's sorted batching per rank);
- ``lbb``: the length buckets of :func:`~.strategies.length_buckets` (the paper's LBB).

With pipelines each rank's micro-batches of both are put in the order of least makespan of the
schedule that runs (:func:`~.pipeline.best_orders` on their padded times). The rank assignment itself is still
balanced by unpadded document cost (a heuristic: the candidates are then priced padded). Under
padding ``sab`` often keeps LBB's own plan (the simulator's ``candidates`` say how often), so it
is never predicted slower than LBB, by construction. The trainer packs (THD, no padding):
this is the simulator's model of frameworks that do not, not a training mode.
"""

from __future__ import annotations

import numpy as np

from ..workload import CostModel
from .pipeline import PipelineShape, best_orders
from .plan import Items, flatten_packs, predict_packs
from .strategies import RankItems, RankPacks, Regime, length_buckets, pack_in_order


def padded_candidates(
    ranks: RankItems,
    items: Items,
    regime: Regime,
    cost_model: CostModel,
    shape: PipelineShape | None,
    moves: int = 0,
) -> list[tuple[str, RankPacks, int]]:
    """``[("sorted", packs, moves), ("lbb", packs, 0)]`` for ``ranks`` (sab's rank assignment of
    ``items``, made with ``moves`` local-search exchanges), each rank's micro-batches in the order
    of least makespan when ``shape`` is given."""
    tokens = items.tokens
    by_length = [sorted(rank, key=lambda i: (-int(tokens[i]), i)) for rank in ranks]
    sorted_packs = [pack_in_order(rank, tokens, regime) for rank in by_length]
    lbb = length_buckets(tokens, len(ranks), regime)
    out = [("sorted", sorted_packs, moves), ("lbb", lbb, 0)]
    if shape is None:
        return out
    return [(name, _in_best_order(packs, items, cost_model, shape), made) for name, packs, made in out]


def _in_best_order(packs: RankPacks, items: Items, cost_model: CostModel, shape: PipelineShape) -> RankPacks:
    """Each rank's non-empty micro-batches reordered for the least makespan of their predicted
    (padded) times, the head term spread over the stages as the search's surrogate does (the
    final choice, :func:`~.pipeline.least_makespan`, prices it on the last stage)."""
    packs = [[mb for mb in rank if mb] for rank in packs]
    times = predict_packs(flatten_packs(packs), items, cost_model)[0].tolist()
    per_rank, start = [], 0
    for rank in packs:
        per_rank.append(times[start : start + len(rank)])
        start += len(rank)
    by_count: dict[int, list[int]] = {}
    for r, rank in enumerate(packs):
        if len(rank) > 1:
            by_count.setdefault(len(rank), []).append(r)
    for m, rows in by_count.items():
        orders, _ = best_orders(np.array([per_rank[r] for r in rows]).reshape(len(rows), m), shape)
        for r, order in zip(rows, orders.tolist(), strict=True):
            packs[r] = [packs[r][j] for j in order]
    return packs


def least_rank_time(best, candidates: list[tuple[str, RankPacks, int]], items: Items, cost_model: CostModel):
    """Without pipelines: of ``best`` (``(packs, flat, times, extra)``) and the candidates, the
    one of least predicted slowest rank (ties: ``best``, then the earlier candidate)."""
    for name, packs, made in candidates:
        flat = flatten_packs(packs)
        times = predict_packs(flat, items, cost_model)
        if times[1].max() < best[2][1].max() * (1 - 1e-12):
            best = (packs, flat, times, {"local_search_moves": made, "candidate": name})
    return best
