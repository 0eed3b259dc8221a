"""The whole-document strategies' assignment (:data:`~.planner.STRATEGIES` but ``sab-cp``): items
-> ``rank -> micro-batch -> item`` packs, with their predicted times for ``sab``.

:func:`baseline_packs` deals ``sequential``, ``sorted``, ``lbb``, ``tokens`` and ``flops``;
:func:`sab_packs` is SAB on rank totals and :func:`sab_pipeline_packs` SAB for pipelines
(:mod:`.pipeline`); both add the length-grouped plans of :mod:`.padding` when micro-batches are
padded. The planner (:mod:`.planner`) validates, builds the items and the :class:`~.plan.Plan`;
``config`` is its :class:`~.planner.PlanConfig` (not imported: the planner imports this module).
"""

from __future__ import annotations

import numpy as np

from ..latency.context import ContextCost
from ..latency.model import LatencyModel
from .padding import least_rank_time, padded_candidates
from .pipeline import ORDER_SEARCH_MAX, least_makespan, pipeline_search
from .plan import Items, flatten_packs, predict_packs
from .strategies import (
    Regime,
    fit_linear_coef,
    flops_key,
    flops_linear_coef,
    length_buckets,
    local_search,
    lpt_ranks,
    pack_balanced_ranks,
    pack_in_order,
    shard_contiguous,
)


def rank_key(strategy: str, items: Items, cost_model, config) -> np.ndarray:
    if strategy == "tokens":
        return items.tokens.astype(np.float64)
    if strategy == "flops":
        coef = config.flops_linear_coef
        shapes = model_shapes(cost_model)
        if coef is None and shapes is not None:
            coef = flops_linear_coef(shapes)
        elif coef is None:
            coef = fit_linear_coef(lambda l: cost_model.doc_seconds(l, np.ones_like(l)))
        return flops_key(items.tokens, coef)
    return items.cost


def model_shapes(cost_model) -> dict | None:
    """The model shapes behind a cost model: a ``LatencyModel``'s profile fingerprint (also
    under a ``ContextCost``'s ``base``); None for a synthetic cost model."""
    model = cost_model.base if isinstance(cost_model, ContextCost) else cost_model
    if not isinstance(model, LatencyModel):
        return None
    return model.profile.fingerprint.get("shapes")


def baseline_packs(strategy, items: Items, regime: Regime, cost_model, config) -> list:
    """``sequential``, ``sorted``, ``lbb``, ``tokens`` and ``flops``: rank -> micro-batch ->
    item."""
    r = config.world_size
    if strategy == "lbb":
        return length_buckets(items.tokens, r, regime)
    if strategy in ("sequential", "sorted"):
        order = np.arange(len(items.tokens))
        if strategy == "sorted":
            order = np.argsort(items.tokens, kind="stable")
        return [pack_in_order(rank, items.tokens, regime) for rank in shard_contiguous(order, r)]
    key = rank_key(strategy, items, cost_model, config)
    return pack_balanced_ranks(lpt_ranks(key, r), key, items.tokens, regime)


def sab_packs(items: Items, regime: Regime, cost_model, config):
    """LPT on predicted seconds, refined by the local search, packed and timed; kept only if its
    predicted step time beats the plain ``tokens`` plan (the fallback that makes ``sab <= tokens``
    hold whatever the cost model's non-additive parts do). With padded micro-batches the plans of
    :func:`~.padding.padded_candidates` are priced too, and the least predicted one kept."""
    r = config.world_size
    iters = 4 * r + 64 if config.local_search_iters is None else config.local_search_iters
    tokens_packs = baseline_packs("tokens", items, regime, cost_model, config)
    tokens_flat = flatten_packs(tokens_packs)
    tokens_times = predict_packs(tokens_flat, items, cost_model)
    ranks = lpt_ranks(items.cost, r, regime, items.tokens)
    ranks, moves = local_search(ranks, items.cost, items.tokens, regime, iters, config.neighbors)
    packs = pack_balanced_ranks(ranks, items.cost, items.tokens, regime)
    flat = flatten_packs(packs)
    times = predict_packs(flat, items, cost_model)
    best = (packs, flat, times, {"local_search_moves": moves, "candidate": "cost"})
    if not times[1].max() < tokens_times[1].max() * (1 - 1e-12):
        best = (tokens_packs, tokens_flat, tokens_times, {"local_search_moves": 0, "candidate": "tokens"})
    if items.padded:
        return least_rank_time(
            best, padded_candidates(ranks, items, regime, cost_model, None, moves), items, cost_model
        )
    return best


def sab_pipeline_packs(items: Items, regime: Regime, cost_model, config):
    """``sab`` for P > 1 pipeline stages: from the rank-total ``sab`` plan, the makespan search
    of :func:`~.pipeline.pipeline_search`; of the three plans (pipeline, rank-total, ``tokens``)
    the one of least predicted makespan is kept (ties: in that order), each priced by
    ``predict_many`` per micro-batch in its run order, so ``sab`` with pipelines is never
    predicted slower than without. Above :data:`~.pipeline.ORDER_SEARCH_MAX` micro-batches on a
    rank the makespan search is skipped (its cost grows with their cube): the rank-total plan in
    ascending predicted time is the first candidate instead, and ``extra["order_search_skipped"]``
    holds the most micro-batches a rank had."""
    r = config.world_size
    iters = 4 * r + 64 if config.local_search_iters is None else config.local_search_iters
    shape = config.pipeline(cost_model.num_layers)
    tokens_packs = baseline_packs("tokens", items, regime, cost_model, config)
    ranks = lpt_ranks(items.cost, r, regime, items.tokens)
    ranks, moves = local_search(ranks, items.cost, items.tokens, regime, iters, config.neighbors)
    cost_packs = pack_balanced_ranks(ranks, items.cost, items.tokens, regime)
    most = max(len(p) for p in cost_packs)
    if most > ORDER_SEARCH_MAX:  # the makespan search is cubic in micro-batches per rank: skipped
        ascending = [sorted(p, key=lambda mb: float(items.cost[mb].sum())) for p in cost_packs]
        candidates = [("ascending", ascending, moves), ("cost", cost_packs, moves), ("tokens", tokens_packs, 0)]
    else:
        pipe_packs, _, made = pipeline_search(ranks, items.cost, items.tokens, regime, shape, iters, config.neighbors)
        candidates = [("pipeline", pipe_packs, moves + made), ("cost", cost_packs, moves), ("tokens", tokens_packs, 0)]
    if items.padded:
        candidates += padded_candidates(ranks, items, regime, cost_model, shape, moves)
    packs, flat, times, extra = least_makespan(candidates, items, cost_model, shape)
    if most > ORDER_SEARCH_MAX:
        extra["order_search_skipped"] = most  # said by the simulator and the trainer
    return packs, flat, times, extra
