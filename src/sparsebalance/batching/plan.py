"""``Plan``: the planner's output — rank -> micro-batches -> samples, with predicted times and
quality metrics — and how those times come from a :class:`~sparsebalance.workload.CostModel`.

Times: every non-empty micro-batch is predicted in one vectorised ``cost_model.predict_many``
call (padded ``(num_micro_batches, max_docs)`` lengths and densities); a rank's time is the sum of
its micro-batches (they run back to back before the gradient sync); the step time is the maximum.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

import numpy as np

from ..workload import CostModel, MicroBatch
from .units import PLACEMENT_WHOLE, Unit


@dataclass(frozen=True)
class Items:
    """What the strategies place: samples, or chunks of over-long samples. All arrays ``(n,)``."""

    sample_id: np.ndarray
    offset: np.ndarray
    """First token of the item inside its sample (0 unless the sample was split)."""
    tokens: np.ndarray
    density: np.ndarray
    cost: np.ndarray
    """``cost_model.doc_seconds(tokens, density)``."""
    padded: bool = False
    """Price every micro-batch as run without packing (``PlanConfig.pad_micro_batches``): each
    document padded to the micro-batch's longest, see :func:`padded_packs`."""


@dataclass(frozen=True)
class PlanMetrics:
    """Plan quality under the cost model (seconds unless noted)."""

    max_time: float
    """Predicted step time: the slowest rank."""
    mean_time: float
    min_time: float
    lower_bound: float
    """``max(sum of document times / R + fewest micro-batch overheads per rank, largest single
    item)``: no plan of these items can be faster under the additive model (document seconds plus
    a fixed overhead per micro-batch). Loose by the extra overheads when M > 1."""
    efficiency: float
    """Balance efficiency ``mean_time / max_time`` (1.0 is perfect)."""
    gap_to_bound: float
    """``max_time / lower_bound - 1``."""
    microbatch_balance: float
    """Mean over ranks with >= 2 micro-batches of (mean / max micro-batch time); 1.0 if none."""
    capacity_waste: float
    """``1 - tokens / (num_micro_batches * cap)``, cap = ``C``, or the largest micro-batch's token
    count when micro-batches are counted (the padding a fixed-shape batch would need)."""
    num_samples: int
    num_tokens: int
    """Tokens actually planned (after truncation / skipping)."""
    num_microbatches: int
    num_overlong: int
    """Samples longer than ``C``, whatever was done with them."""
    num_split_chunks: int
    truncated_tokens: int
    skipped_ids: tuple[int, ...]
    local_search_moves: int = 0
    candidate: str = ""
    """For ``sab``: ``cost`` (its own plan) or ``tokens`` (the fallback was predicted faster)."""
    plan_seconds: float = 0.0
    """Wall time spent planning (not part of :meth:`Plan.hash`)."""
    num_split_documents: int = 0
    """Documents (or ``--overlong`` chunks) run on a context-parallel unit of k > 1 ranks."""
    cp_degrees: tuple[int, ...] = ()
    """The CP degree k of every split document, largest first."""
    makespan: float = 0.0
    """With pipelines (``PlanConfig.pipeline_stages`` > 1, ``sab``): the slowest rank's predicted
    1F1B makespan, micro-batches in plan order (:mod:`.pipeline`); 0 otherwise."""
    comm_seconds: float = 0.0
    """Predicted exposed communication (ring transfers, selection all-gather) of the rank that
    has the most of it."""
    order_search_skipped: int = 0
    """With pipelines: the most micro-batches a rank had when there were too many to search
    their order (:data:`~.pipeline.ORDER_SEARCH_MAX`; ascending predicted time instead); 0: searched."""


@dataclass(frozen=True)
class Plan:
    """Samples -> ranks -> micro-batches, with predicted times. Indexing: ``plan.ranks[r][m]``."""

    strategy: str
    ranks: tuple[tuple[MicroBatch, ...], ...]
    offsets: tuple[tuple[tuple[int, ...], ...], ...]
    """Same nesting as ``ranks``: each entry's first token inside its sample (non-zero for the
    second and later chunks of a split sample)."""
    microbatch_times: tuple[tuple[float, ...], ...]
    rank_times: tuple[float, ...]
    metrics: PlanMetrics = field(compare=False)
    units: tuple[Unit, ...] = ()
    """The context-parallel units (k > 1) in slot order (see :mod:`.units`); empty for plans
    without any. :meth:`execution` adds the one-rank micro-batches as units."""
    rank_units: tuple[tuple[int, ...], ...] = ()
    """Same nesting as ``ranks``: the index in ``units`` of each entry of ``ranks[r]``, -1 for a
    one-rank micro-batch; empty when ``units`` is."""

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    def canonical(self) -> list | dict:
        """The assignment alone, as nested lists ``[rank][mb] -> [[id, offset, tokens], ...]``;
        a plan with CP units adds them (``{"ranks": ..., "units": [...]}``), so a plan whose
        units all have k = 1 hashes exactly as the data-parallel plan it equals."""
        ranks = [
            [
                [[i, o, n] for i, o, n in zip(mb.sample_ids, offs, mb.lengths, strict=True)]
                for mb, offs in zip(rank, rank_offs, strict=True)
            ]
            for rank, rank_offs in zip(self.ranks, self.offsets, strict=True)
        ]
        cp = [u.canonical() for u in self.units]
        return {"ranks": ranks, "units": cp} if cp else ranks

    def execution(self) -> tuple[tuple[Unit, ...], tuple[tuple[int, ...], ...]]:
        """``(units, rank_units)``: what a trainer runs — rank r runs ``units[j]`` for j in
        ``rank_units[r]``, in order. CP units keep their slots ``0 .. U-1``; every one-rank
        micro-batch becomes a unit with the next slot, rank by rank (see :mod:`.units`)."""
        units = list(self.units)
        rank_units = []
        for r, (rank, offs, ts, idx) in enumerate(
            zip(
                self.ranks,
                self.offsets,
                self.microbatch_times,
                self.rank_units or [(-1,) * len(rank) for rank in self.ranks],
                strict=True,
            )
        ):
            order = []
            for mb, o, t, u in zip(rank, offs, ts, idx, strict=True):
                if u < 0:
                    u = len(units)
                    units.append(
                        Unit(u, (r,), PLACEMENT_WHOLE, "none", 1, mb.sample_ids, o, mb.lengths, mb.densities, t)
                    )
                order.append(u)
            rank_units.append(tuple(order))
        return tuple(units), tuple(rank_units)

    def hash(self) -> str:
        """16 hex digits of SHA-256 over the assignment (not the times): equal on every rank that
        derived the same plan, so the trainer can all-gather it to check agreement."""
        blob = json.dumps(self.canonical(), separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def placements(self) -> dict[int, list[tuple[int, int, int, int]]]:
        """``sample id -> [(rank, micro-batch, offset, tokens), ...]`` (one entry per chunk)."""
        out: dict[int, list[tuple[int, int, int, int]]] = {}
        for r, (rank, rank_offs) in enumerate(zip(self.ranks, self.offsets, strict=True)):
            for m, (mb, offs) in enumerate(zip(rank, rank_offs, strict=True)):
                for i, o, n in zip(mb.sample_ids, offs, mb.lengths, strict=True):
                    out.setdefault(i, []).append((r, m, o, n))
        return out

    def summary(self) -> dict:
        """Metrics plus the hash, JSON-ready."""
        d = asdict(self.metrics)
        d["skipped_ids"] = list(d["skipped_ids"])
        d["cp_degrees"] = list(d["cp_degrees"])
        return {"strategy": self.strategy, "hash": self.hash(), **d}

    def to_dict(self) -> dict:
        """Everything, JSON-ready (the assignment as in :meth:`canonical`; hybrid plans add
        ``units`` and ``rank_units``)."""
        out = {
            **self.summary(),
            "assignment": self.canonical(),
            "microbatch_times": [list(t) for t in self.microbatch_times],
            "rank_times": list(self.rank_times),
        }
        if self.units:
            units, rank_units = self.execution()
            out["units"] = [u.to_dict() for u in units]
            out["rank_units"] = [list(o) for o in rank_units]
        return out


@dataclass(frozen=True)
class FlatPacks:
    """Packs (rank -> micro-batch -> item index) as flat arrays in plan order, empty micro-batches
    dropped: what vectorised pricing needs without one Python object per micro-batch."""

    num_ranks: int
    item: np.ndarray
    """``(P,)`` item index of every placed item, rank by rank, micro-batch by micro-batch."""
    mb_sizes: np.ndarray
    """``(B,)`` items per non-empty micro-batch."""
    mb_rank: np.ndarray
    """``(B,)`` rank of each micro-batch (non-decreasing)."""


def flatten_packs(packs: list[list[list[int]]]) -> FlatPacks:
    """:class:`FlatPacks` of ``packs``. O(P) (three list comprehensions)."""
    sizes = [len(mb) for rank in packs for mb in rank if mb]
    mb_rank = [r for r, rank in enumerate(packs) for mb in rank if mb]
    item = [i for rank in packs for mb in rank for i in mb]
    return FlatPacks(
        len(packs),
        np.array(item, dtype=np.int64),
        np.array(sizes, dtype=np.int64),
        np.array(mb_rank, dtype=np.int64),
    )


def padded_packs(flat: FlatPacks, items: Items) -> tuple[np.ndarray, np.ndarray]:
    """``(B, max_docs)`` lengths (0 = empty slot) and densities (1.0 there) of every non-empty
    micro-batch, plan order: what ``predict_many`` reads.

    With ``items.padded`` every document of a micro-batch is priced as its longest one (length
    and density: the documents share the planner's base budget, so the longest one's density is
    what that budget keeps of the padded length), the micro-batch as a ``(K, S)`` batch without
    packing runs it."""
    sizes = flat.mb_sizes
    row = np.repeat(np.arange(sizes.size), sizes)
    col = np.arange(row.size) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    width = int(sizes.max(initial=0))
    lengths = np.zeros((sizes.size, width), dtype=np.int64)
    dens = np.ones((sizes.size, width), dtype=np.float64)
    tokens, density = items.tokens[flat.item], items.density[flat.item]
    if items.padded and row.size:
        longest = longest_in_rows(tokens, sizes)
        tokens, density = tokens[longest][row], density[longest][row]
    lengths[row, col] = tokens
    dens[row, col] = density
    return lengths, dens


def longest_in_rows(values: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """``(B,)`` the index into ``values`` of the largest of each consecutive row of ``sizes``
    (each >= 1) entries; ties: the first."""
    starts = np.cumsum(sizes) - sizes
    row = np.repeat(np.arange(sizes.size), sizes)
    # stable sort by (row, -value): each row's first entry is its largest
    order = np.lexsort((-np.asarray(values, dtype=np.float64), row))
    return order[starts]


def predict_packs(flat: FlatPacks, items: Items, cost_model: CostModel):
    """Predicted seconds of every non-empty micro-batch (``(B,)``, plan order) and of every rank
    (``(R,)``: its micro-batches summed in order, as a Python ``sum`` would).

    One ``predict_many`` call on ``(B, max_docs)`` padded arrays: O(total items) numpy work.
    """
    times, rank_times = np.zeros(0), np.zeros(flat.num_ranks)
    if flat.mb_sizes.size:
        sizes = flat.mb_sizes
        lengths, dens = padded_packs(flat, items)
        times = np.asarray(cost_model.predict_many(lengths, dens), dtype=np.float64)
        # Rank sums column by column: the same left-to-right additions as sum() over a rank.
        counts = np.bincount(flat.mb_rank, minlength=flat.num_ranks)
        pos = np.arange(sizes.size) - np.repeat(np.cumsum(counts) - counts, counts)
        per_rank = np.zeros((flat.num_ranks, int(counts.max())))
        per_rank[flat.mb_rank, pos] = times
        for j in range(per_rank.shape[1]):
            rank_times += per_rank[:, j]
    return times, rank_times


def time_metrics(rank_times: np.ndarray, lower_bound: float, balance: list[float]) -> dict:
    """The :class:`PlanMetrics` fields that follow from the predicted rank times ``(R,)``, the
    step-time lower bound and the per-rank micro-batch balances (shared by every plan builder)."""
    mx, mean = float(rank_times.max()), float(rank_times.mean())
    return {
        "max_time": mx,
        "mean_time": mean,
        "min_time": float(rank_times.min()),
        "lower_bound": lower_bound,
        "efficiency": mean / mx if mx > 0 else 1.0,
        "gap_to_bound": mx / lower_bound - 1.0 if lower_bound > 0 else 0.0,
        "microbatch_balance": float(np.mean(balance)) if balance else 1.0,
    }


def build_plan(
    strategy: str,
    packs: list[list[list[int]]],
    items: Items,
    times: tuple[np.ndarray, np.ndarray],
    lower_bound: float,
    capacity: int | None,
    overlong: dict,
    extra: dict,
) -> Plan:
    """Assemble the :class:`Plan` and its metrics; empty micro-batches are dropped. ``times``:
    :func:`predict_packs` of ``packs``."""
    flat_times, rank_times = times
    # Python lists once: per-element numpy indexing would dominate for thousands of micro-batches.
    ids, toks, dens, first = (a.tolist() for a in (items.sample_id, items.tokens, items.density, items.offset))
    mb_times = iter(flat_times.tolist())
    ranks, offsets, kept_times, balance = [], [], [], []
    for rank in packs:
        mbs, offs, ts = [], [], []
        for mb in rank:
            if not mb:
                continue
            t = next(mb_times)
            mbs.append(
                MicroBatch(
                    tuple([ids[i] for i in mb]),
                    tuple([toks[i] for i in mb]),
                    tuple([dens[i] for i in mb]),
                )
            )
            offs.append(tuple([first[i] for i in mb]))
            ts.append(t)
        if len(ts) >= 2:
            balance.append(sum(ts) / len(ts) / max(ts))
        ranks.append(tuple(mbs))
        offsets.append(tuple(offs))
        kept_times.append(tuple(ts))
    num_mb = sum(len(r) for r in ranks)
    num_tokens = int(items.tokens.sum())
    cap = capacity if capacity is not None else max((mb.num_tokens for r in ranks for mb in r), default=0)
    metrics = PlanMetrics(
        **time_metrics(rank_times, lower_bound, balance),
        capacity_waste=1.0 - num_tokens / (num_mb * cap) if num_mb and cap else 0.0,
        num_samples=len(set(items.sample_id.tolist())),
        num_tokens=num_tokens,
        num_microbatches=num_mb,
        **overlong,
        **extra,
    )
    return Plan(
        strategy,
        tuple(ranks),
        tuple(offsets),
        tuple(kept_times),
        tuple(rank_times.tolist()),
        metrics,
    )
