"""Assemble a hybrid (``sab-cp``) :class:`~sparsebalance.batching.plan.Plan` from a
:class:`~sparsebalance.batching.context.CPResult`: the units, each rank's order, and the metrics.

Per rank: its CP units (slots ``0 .. U-1`` in placement order), then its whole-document
micro-batches. ``plan.units`` holds the CP units only; ``plan.rank_units[r][j]`` is the index of
the CP unit behind ``plan.ranks[r][j]`` (whose documents are the whole documents: each rank of a CP
unit shards them itself), or -1 for a one-rank micro-batch; ``plan.microbatch_times[r][j]`` is
its seconds on that rank. :meth:`Plan.execution` gives every entry as a :class:`Unit`. A rank's
time also counts the waits before its CP units (all ranks of a unit start together), so
``rank_times[r]`` can exceed the sum of its micro-batch times.
"""

from __future__ import annotations

import numpy as np

from ..latency.context import ring_kind
from ..workload import MicroBatch
from .context import CPResult
from .plan import Items, Plan, PlanMetrics, time_metrics
from .units import PLACEMENT_STRIPED, Unit


def build_cp_plan(
    strategy: str,
    res: CPResult,
    items: Items,
    cost,
    capacity: int | None,
    overlong: dict,
    extra: dict,
) -> Plan:
    """The :class:`Plan` of a CP result (see the module docstring)."""
    cols = tuple(a.tolist() for a in (items.sample_id, items.tokens, items.density, items.offset))
    units, rank_units, rank_comm = _cp_units(res, cols, cost)
    ranks_out, offsets, times, balance, rank_tokens = _rank_schedules(res, cols, units, rank_units)
    rank_times = res.rank_times
    cap = capacity if capacity is not None else max(rank_tokens, default=0)
    cu = res.units
    metrics = PlanMetrics(
        **time_metrics(rank_times, res.lower_bound, balance),
        capacity_waste=(1.0 - sum(rank_tokens) / (len(rank_tokens) * cap)) if cap else 0.0,
        num_samples=len(set(cols[0])),
        num_tokens=int(items.tokens.sum()),
        num_microbatches=len(units) + int(res.flat.mb_sizes.size),
        **overlong,
        **extra,
        num_split_documents=int(cu.item.size),
        cp_degrees=tuple(sorted(cu.degree.tolist(), reverse=True)),
        comm_seconds=float(rank_comm.max()) if res.ready.size else 0.0,
    )
    return Plan(
        strategy,
        tuple(ranks_out),
        tuple(offsets),
        tuple(times),
        tuple(rank_times.tolist()),
        metrics,
        tuple(units),
        tuple(tuple(o) for o in rank_units),
    )


def _cp_units(res: CPResult, cols: tuple[list, ...], cost) -> tuple[list[Unit], list[list[int]], np.ndarray]:
    """The CP units of ``res`` (one split document each, in slot order), each rank's unit slots and
    each rank's ring seconds. ``cols``: the items' ids, tokens, densities and offsets as lists."""
    ids, toks, dens, first = cols
    num_ranks = res.ready.size
    units: list[Unit] = []
    rank_units: list[list[int]] = [[] for _ in range(num_ranks)]
    rank_comm = np.zeros(num_ranks)
    cu = res.units
    for slot, (i, k, r0, secs, comm) in enumerate(
        zip(
            cu.item.tolist(),
            cu.degree.tolist(),
            cu.start_rank.tolist(),
            cu.seconds.tolist(),
            cu.comm.tolist(),
            strict=True,
        )
    ):
        kind, inner = ring_kind(k, cost.links, cost.ring)
        ranks = tuple(range(r0, r0 + k))
        units.append(
            Unit(
                slot, ranks, PLACEMENT_STRIPED, kind, inner, (ids[i],), (first[i],), (toks[i],), (dens[i],), secs, comm
            )
        )
        for r in ranks:
            rank_units[r].append(slot)
        rank_comm[r0 : r0 + k] += comm
    return units, rank_units, rank_comm


def _rank_schedules(res: CPResult, cols: tuple[list, ...], units: list[Unit], rank_units: list[list[int]]) -> tuple:
    """Per rank, its CP units then its data-parallel micro-batches (appending ``-1`` to
    ``rank_units`` for each of the latter): the ranks' entries, offsets and times, the balance of
    every rank with two or more micro-batches, and every micro-batch's tokens per rank."""
    ids, toks, dens, first = cols
    mb_times = iter(res.dp_times[0].tolist())
    ranks_out, offsets, times, balance, rank_tokens = [], [], [], [], []
    for r, rank in enumerate(res.packs):
        mbs = [units[u] for u in rank_units[r]]
        entries = [MicroBatch(u.sample_ids, u.lengths, u.densities) for u in mbs]
        offs = [u.offsets for u in mbs]
        ts = [u.seconds for u in mbs]
        rank_tokens.extend(-(-u.num_tokens // u.degree) for u in mbs)
        for mb in rank:
            if not mb:
                continue
            rank_units[r].append(-1)
            entries.append(
                MicroBatch(
                    tuple([ids[i] for i in mb]),
                    tuple([toks[i] for i in mb]),
                    tuple([dens[i] for i in mb]),
                )
            )
            offs.append(tuple([first[i] for i in mb]))
            ts.append(next(mb_times))
            rank_tokens.append(sum(entries[-1].lengths))
        if len(ts) >= 2:
            balance.append(sum(ts) / len(ts) / max(ts))
        ranks_out.append(tuple(entries))
        offsets.append(tuple(offs))
        times.append(tuple(ts))
    return ranks_out, offsets, times, balance, rank_tokens
