"""SAB for pipelines (``PlanConfig.pipeline_stages`` P > 1): pack each data-parallel rank's
documents into micro-batches, and order them, so that its pipeline's makespan is short, and even
the ranks' makespans instead of their totals.

Why: a rank of P stages runs its M micro-batches through a 1F1B pipeline (:mod:`.schedule`; or
interleaved 1F1B, or ZB-H1, below); a slow micro-batch stalls every later stage, so the makespan
is about ``(sum of micro-batch times + (P - 1) x the slowest) / P`` and depends on the order too
(the best and worst order of four micro-batches differ by up to ~1.4x). Rank totals are the wrong
thing to even: a rank holding one long document has a long critical path at the same total.

Pricing (the planner's, a surrogate of the cost model): a micro-batch's time is the micro-batch
overhead plus its items' ``doc_seconds`` (additive, as SAB's rank-level search), spread over the
stages by their layer share (``PlanConfig.stage_layers``, :func:`~.schedule.resolve_layers`;
the LM head's small term spread with it), each share times its stage's scale, backward = ratio x
forward (``PlanConfig.stage_scales`` and ``backward_ratio``: 1 and 2 until a training run has
measured its stages); the makespan is the exact one of the schedule that runs: 1F1B
(:func:`~.schedule.makespans`); with ``PlanConfig.pipeline_virtual`` V > 1 interleaved 1F1B
(:mod:`.interleaved`: the split is then per virtual stage, each rank's scale on its V chunks);
with ``PlanConfig.pipeline_schedule`` ``"zb-h1"`` zero bubble (:mod:`.zero_bubble`: each stage's
backward split into B and W, W ``PlanConfig.weight_share`` of it). So the order search and the
exchanges below price the schedule that runs.

Per rank (:func:`pack_rank`): LPT on item cost into micro-batches (:func:`~.strategies.
pack_balanced`), then the order of least makespan (every order up to :data:`EXHAUSTIVE_ORDER`
micro-batches, else best swaps from the ascending order). Across ranks
(:func:`pipeline_search`): from SAB's rank-total assignment, moves and swaps of items between
the rank of the longest makespan and the ``neighbors`` shortest, each candidate re-packed and
priced exactly in its best order up to :data:`EXHAUSTIVE_ORDER` micro-batches, above in the
ascending order, an upper bound of its searched makespan (all of one exchange step's candidates
in one vectorised call); an exchange is made when it lowers the larger of the two makespans below
the current maximum, and only the two ranks it changes are order-searched.

Cost per exchange step with ranks of n items: ``n^2`` candidates (at most :data:`MAX_PAIRS`
swaps), two Python LPT packs each, one :func:`~.schedule.makespans` call per micro-batch count.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..workload import CostModel
from . import interleaved, schedule, zero_bubble
from .interleaved import check_virtual
from .levels import JoinedLevels, Levels, join_levels, solve_joined
from .plan import Items, flatten_packs, padded_packs, predict_packs
from .schedule import BACKWARD_RATIO, head_seconds, layered_makespans, resolve_layers
from .strategies import RankItems, RankPacks, Regime, pack_balanced_ranks
from .zero_bubble import check_schedule
from .zero_bubble import layered_makespans as zb_layered_makespans

EXHAUSTIVE_ORDER = 6
"""Up to this many micro-batches per rank every order is priced (720 at 6); above, best swaps."""
ORDER_SEARCH_MAX = 32
"""Above this many micro-batches per rank no order is searched: the ascending order (where the
swaps start; ~3 % longer makespans than theirs on random times at 24-32). A swap round prices
M^2 / 2 orders of M micro-batches, and the exchange search does so for every candidate of every
exchange: at 89 micro-batches (``simulate --pp 2 --capacity 256``) that was gigabytes per call.
:func:`~.assign.sab_pipeline_packs` then skips the exchange search too, and says so."""
CHUNK_ELEMENTS = 1 << 21
"""Most micro-batch stage times one round of the order search prices at once (pipelines x orders
x M x P: 16 MB per float array); more pipelines are searched in chunks."""
MAX_PAIRS = 256
"""Most swap candidates per (heavy, light) rank pair (the heavy rank's largest items first)."""


def check_weight_share(value: float, flag: str = "weight_share") -> None:
    """Refuse, in one line naming ``flag``, a zero-bubble W share outside [0, 1) (W is a part of
    the backward; B, the rest, cannot be empty) or not a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"{flag} (W's share of a stage's backward, zb-h1) must be a number in [0, 1), got {value!r}")


@dataclass(frozen=True)
class PipelineShape:
    """How the planner prices a rank's micro-batches as a pipeline: 1F1B, interleaved 1F1B
    (:attr:`virtual` > 1) or ZB-H1 (:attr:`weight_share` given)."""

    layers: np.ndarray
    """``(P,)`` layers per stage (:func:`~.schedule.resolve_layers`)."""
    ratio: float = BACKWARD_RATIO
    """Backward seconds per forward second (``PlanConfig.backward_ratio``)."""
    scales: np.ndarray | None = None
    """``(P,)`` multiplies each stage's share of a micro-batch (``PlanConfig.stage_scales``, a
    run's measured stage scales); None: 1."""
    virtual: int = 1
    """V chunks per rank (``PlanConfig.pipeline_virtual``): priced as interleaved 1F1B
    (:mod:`.interleaved`), :attr:`layers` then per virtual stage ``(P V,)``; 1: plain 1F1B."""
    weight_share: float | None = None
    """Zero bubble (``PlanConfig.pipeline_schedule`` ``"zb-h1"``, V = 1): priced as ZB-H1
    (:mod:`.zero_bubble`), W this share of each stage's backward (``PlanConfig.weight_share``);
    None: 1F1B."""

    @classmethod
    def of(
        cls,
        num_layers: int,
        num_stages: int,
        split: tuple[int, ...] = (),
        ratio: float = BACKWARD_RATIO,
        scales: tuple[float, ...] = (),
        virtual: int = 1,
        weight_share: float | None = None,
    ) -> PipelineShape:
        """``split``: layers per (virtual) stage (``PlanConfig.stage_layers``, P V entries); empty =
        the even split. ``scales``: per stage (``PlanConfig.stage_scales``); empty = 1.
        ``weight_share``: ZB-H1's W share of a backward, in [0, 1) (V = 1 only); None: 1F1B."""
        if scales and len(scales) != num_stages:
            raise ValueError(f"stage_scales {tuple(scales)}: need one scale per stage ({num_stages})")
        check_virtual(num_stages, virtual, num_layers)
        if weight_share is not None:
            check_schedule("zb-h1", num_stages, virtual)
            check_weight_share(weight_share)
        layers = resolve_layers(num_layers, num_stages * virtual, split)
        scaled = np.asarray(scales, dtype=np.float64) if scales else None
        return cls(layers, ratio, scaled, virtual, None if weight_share is None else float(weight_share))

    @property
    def num_stages(self) -> int:
        """P, the pipeline's ranks."""
        return int(self.layers.size) // self.virtual

    def __eq__(self, other: object) -> bool:
        """Prices alike: the same schedule, split, backward ratio, weight share and stage scales
        (None = 1)."""
        if not isinstance(other, PipelineShape):
            return NotImplemented
        ones = np.ones(self.num_stages)
        mine = ones if self.scales is None else self.scales
        theirs = np.ones(other.num_stages) if other.scales is None else other.scales
        same = np.array_equal(self.layers, other.layers) and self.ratio == other.ratio and self.virtual == other.virtual
        return same and self.weight_share == other.weight_share and np.array_equal(mine, theirs)

    __hash__ = None  # arrays inside: not hashable

    def makespans(self, times: np.ndarray, head: np.ndarray | float = 0.0) -> np.ndarray:
        """``(n,)`` makespans of n pipelines of micro-batch times ``(n, M)``, in that order;
        ``head``: what of each micro-batch runs on the last stage only
        (:func:`~.schedule.layered_makespans`)."""
        if self.weight_share is not None:
            return zb_layered_makespans(times, head, self.layers, self.ratio, self.scales, self.weight_share)
        return layered_makespans(times, head, self.layers, self.ratio, self.scales, self.virtual)

    def levels(self, num_micro_batches: int) -> Levels:
        """The schedule's dependency levels for M micro-batches (:mod:`.levels`)."""
        return _schedule_levels(self.weight_share is not None, self.num_stages, self.virtual, num_micro_batches)

    def joined(self, counts) -> JoinedMakespans:
        """:class:`JoinedMakespans` of pipelines of ``counts`` micro-batches each."""
        return JoinedMakespans(self, counts)

    def durations(self, times: np.ndarray, head: np.ndarray) -> np.ndarray:
        """``(kinds, E, S V, C)`` each op's seconds (forward, backward and, ZB-H1, weight) from
        micro-batch seconds ``times`` ``(E, C)`` and their ``head`` (the same shape): what
        :meth:`makespans` prices, element for element the same operations (:func:`~.schedule.
        scaled_stages`, :func:`~.schedule.split_forward_backward`, :func:`~.zero_bubble.
        split_backward`)."""
        ratio, share = self.ratio, self.weight_share
        if not (np.isfinite(ratio) and ratio >= 0):
            raise ValueError(f"backward ratio must be finite and >= 0, got {ratio}")
        if share is not None and not 0.0 <= share < 1.0:
            raise ValueError(f"weight_share must be in [0, 1), got {share}")
        out = np.empty((2 if share is None else 3, times.shape[0], self.layers.size, times.shape[1]))
        forward = out[0]
        per_layer = (times - head) / float(self.layers.sum())
        np.multiply(per_layer[:, None, :], self.layers.astype(np.float64)[None, :, None], out=forward)
        forward[:, -1, :] += head
        if self.scales is not None:
            forward *= np.tile(np.asarray(self.scales, dtype=np.float64), self.virtual)[None, :, None]
        forward /= 1.0 + ratio
        np.multiply(forward, ratio, out=out[1])
        if share is not None:
            np.multiply(out[1], share, out=out[2])
            out[1] *= 1.0 - share
        if not (np.all(np.isfinite(out)) and (out >= 0).all()):
            raise ValueError("forward and backward seconds must be finite and >= 0")
        return out


def _schedule_levels(zero_bubble_h1: bool, num_stages: int, virtual: int, num_micro_batches: int) -> Levels:
    if zero_bubble_h1:
        return zero_bubble._levels(num_stages, num_micro_batches)
    if virtual > 1:
        return interleaved._levels(num_stages, virtual, num_micro_batches)
    return schedule._levels(num_stages, num_micro_batches)


@lru_cache(maxsize=16)
def _joined(zero_bubble_h1: bool, num_stages: int, virtual: int, counts: tuple[int, ...]) -> JoinedLevels:
    """A plan's pipelines joined (its counts often recur from step to step; a few kept: a program
    of thousands of pipelines holds megabytes)."""
    levels = {m: _schedule_levels(zero_bubble_h1, num_stages, virtual, m) for m in set(counts)}
    return join_levels([levels[m] for m in counts], counts, num_stages * virtual)


class JoinedMakespans:
    """The makespans of n pipelines of one :class:`PipelineShape` and any micro-batch counts
    ``counts`` ``(n,)`` (each >= 1) in one pass (:func:`~.levels.join_levels`; compiled once per
    counts): bit for bit :meth:`PipelineShape.makespans` of each. Their micro-batches are flat
    entries, pipeline by pipeline (``E = sum(counts)``)."""

    def __init__(self, shape: PipelineShape, counts) -> None:
        self.shape = shape
        self.counts = np.asarray(counts, dtype=np.int64).reshape(-1)
        if (self.counts < 1).any():
            raise ValueError(f"a pipeline needs at least one micro-batch, got counts {self.counts.tolist()}")
        self.starts = np.cumsum(self.counts) - self.counts
        """``(n,)`` each pipeline's first entry."""
        self.entry_pipeline = np.repeat(np.arange(self.counts.size), self.counts)
        """``(E,)`` each entry's pipeline."""
        key = tuple(self.counts.tolist())
        self._levels = _joined(shape.weight_share is not None, shape.num_stages, shape.virtual, key) if key else None

    def __call__(self, times: np.ndarray, head: np.ndarray | float = 0.0) -> np.ndarray:
        """``(n,)`` makespans from ``(E,)`` micro-batch seconds ``times`` (``(E, C)``: ``(n, C)``,
        C variants at once) and ``head``, broadcastable to them (``(E,)`` against ``(E, C)``
        too): what of each runs on the last stage only."""
        t = np.asarray(times, dtype=np.float64)
        h = np.asarray(head, dtype=np.float64)
        one = t.ndim == 1
        if one:
            t = t[:, None]
        if h.ndim == 1:
            h = h[:, None]
        if t.ndim != 2 or t.shape[0] != self.entry_pipeline.size:
            raise ValueError(f"times must be (E,) or (E, C) with E = {self.entry_pipeline.size}, got {np.shape(times)}")
        if self._levels is None:
            spans = np.zeros((0, t.shape[1]))
        else:
            durations = self.shape.durations(t, np.broadcast_to(h, t.shape))
            spans = solve_joined(self._levels, durations.reshape(-1, t.shape[1]))
        return spans[:, 0] if one else spans


@lru_cache(maxsize=16)
def _permutations(m: int) -> np.ndarray:
    return np.array(list(itertools.permutations(range(m))), dtype=np.int64).reshape(-1, m)


def best_orders(times: np.ndarray, shape: PipelineShape) -> tuple[np.ndarray, np.ndarray]:
    """The order of least makespan for each of n pipelines: ``times`` ``(n, M)`` -> (orders
    int ``(n, M)``, makespans ``(n,)``). Ties: the first order in lexicographic order (M <=
    :data:`EXHAUSTIVE_ORDER`) or the first swap found; above :data:`ORDER_SEARCH_MAX`, the
    ascending order unsearched. Deterministic. The pipelines are searched a few at a time
    (:data:`CHUNK_ELEMENTS`), so memory stays bounded whatever n is."""
    times = np.asarray(times, dtype=np.float64)
    n, m = times.shape
    if m <= 1:
        return np.zeros((n, m), dtype=np.int64), shape.makespans(times) if m else np.zeros(n)
    swaps = m * (m - 1) // 2 if m <= ORDER_SEARCH_MAX else 1  # orders priced per pipeline and round
    orders = math.factorial(m) if m <= EXHAUSTIVE_ORDER else swaps
    rows = max(1, CHUNK_ELEMENTS // (orders * m * shape.layers.size))
    if n > rows:  # pipelines are independent: the same answer, chunk by chunk
        parts = [_best_orders(times[lo : lo + rows], shape) for lo in range(0, n, rows)]
        return np.concatenate([o for o, _ in parts]), np.concatenate([s for _, s in parts])
    return _best_orders(times, shape)


def _best_orders(times: np.ndarray, shape: PipelineShape) -> tuple[np.ndarray, np.ndarray]:
    n, m = times.shape
    if m <= EXHAUSTIVE_ORDER:
        perms = _permutations(m)
        spans = shape.makespans(times[:, perms].reshape(-1, m)).reshape(n, perms.shape[0])
        best = np.argmin(spans, axis=1)
        return perms[best], spans[np.arange(n), best]
    order = np.argsort(times, axis=1, kind="stable")
    span = shape.makespans(np.take_along_axis(times, order, axis=1))
    if m > ORDER_SEARCH_MAX:
        return order, span
    pairs = np.array(list(itertools.combinations(range(m), 2)), dtype=np.int64)
    live = np.arange(n)  # a pipeline no swap improved keeps its order: not searched again
    for _ in range(m):  # best-improvement swaps, at most M rounds
        mine = order[live]
        cand = np.repeat(mine[:, None, :], pairs.shape[0], axis=1)  # (n', S, M)
        a, b = pairs[:, 0], pairs[:, 1]
        cand[:, np.arange(pairs.shape[0]), a], cand[:, np.arange(pairs.shape[0]), b] = mine[:, b], mine[:, a]
        priced = np.take_along_axis(times[live, None, :], cand, axis=2).reshape(-1, m)
        spans = shape.makespans(priced).reshape(live.size, -1)
        best = np.argmin(spans, axis=1)
        lowest = spans[np.arange(live.size), best]
        better = lowest < span[live] * (1 - 1e-12)
        if not better.any():
            break
        order[live[better]], span[live[better]] = cand[better, best[better]], lowest[better]
        live = live[better]
    return order, span


def _mb_times(packs: list[list[int]], costs: list[float], c0: float) -> list[float]:
    return [c0 + sum(costs[i] for i in mb) for mb in packs]


def rank_makespans(
    ranks: list[list[int]],
    cost: np.ndarray,
    tokens: np.ndarray,
    regime: Regime,
    shape: PipelineShape,
    search: bool = True,
) -> tuple[list[list[list[int]]], np.ndarray]:
    """Each rank's items packed (LPT) and ordered for the least makespan: (packs ``rank ->
    micro-batch -> item``, makespans ``(n,)``); an empty rank has no micro-batch and 0 s.
    ``search=False``: ranks of more than :data:`EXHAUSTIVE_ORDER` micro-batches keep the
    ascending order, where the swap search starts (a makespan no shorter than the searched one:
    what the exchange search prices its candidates with, :func:`pipeline_search`)."""
    costs = cost.tolist()
    packs = pack_balanced_ranks(ranks, cost, tokens, regime)  # pack_balanced of each, vectorised
    spans = np.zeros(len(ranks))
    by_count: dict[int, list[int]] = {}
    for r, p in enumerate(packs):
        if p:
            by_count.setdefault(len(p), []).append(r)
    for m, rows in by_count.items():
        times = np.array([_mb_times(packs[r], costs, regime.overhead) for r in rows]).reshape(len(rows), m)
        if search or m <= EXHAUSTIVE_ORDER:
            orders, spans[rows] = best_orders(times, shape)
        else:
            orders = np.argsort(times, axis=1, kind="stable")
            spans[rows] = shape.makespans(np.take_along_axis(times, orders, axis=1))
        for r, order in zip(rows, orders.tolist(), strict=True):
            packs[r] = [packs[r][j] for j in order]
    return packs, spans


def pack_rank(items: list[int], cost: np.ndarray, tokens: np.ndarray, regime: Regime, shape: PipelineShape):
    """One rank: ``(micro-batches in run order, makespan)``."""
    packs, spans = rank_makespans([items], cost, tokens, regime, shape)
    return packs[0], float(spans[0])


def _candidates(items_h: list[int], items_l: list[int], costs: list[float]) -> list[tuple[int, int]]:
    """Exchanges ``(i, j)`` from the heavy rank to the light one: moves (j = -1) of every item of
    h, and swaps of h's item i with a cheaper item j of l (at most :data:`MAX_PAIRS`, h's largest
    items first)."""
    out = [(i, -1) for i in items_h]
    heavy = sorted(items_h, key=lambda i: (-costs[i], i))
    light = sorted(items_l, key=lambda j: (costs[j], j))
    for i in heavy:
        for j in light:
            if costs[j] >= costs[i] or len(out) >= len(items_h) + MAX_PAIRS:
                break
            out.append((i, j))
    return out


def _exchanged(items_h: list[int], items_l: list[int], i: int, j: int) -> tuple[list[int], list[int]]:
    h = [x for x in items_h if x != i] + ([j] if j >= 0 else [])
    l = [x for x in items_l if x != j] + [i]
    return h, l


def pipeline_search(
    ranks: RankItems,
    cost: np.ndarray,
    tokens: np.ndarray,
    regime: Regime,
    shape: PipelineShape,
    max_iters: int,
    neighbors: int = 4,
) -> tuple[RankPacks, np.ndarray, int]:
    """Lower the longest rank makespan by moves and swaps (see the module docstring).

    Returns (packs ``rank -> micro-batch -> item`` in run order, makespans ``(R,)``, exchanges
    made). The maximum never increases; stops when the longest rank cannot be improved against
    any of its ``neighbors`` lightest ranks, or after ``max_iters`` exchanges. Deterministic
    (ties by rank index, then candidate order)."""
    ranks = [list(r) for r in ranks]
    costs = cost.tolist()
    packs, spans = rank_makespans(ranks, cost, tokens, regime, shape)
    done = 0
    while done < max_iters:
        h = int(np.argmax(spans))
        light = [int(x) for x in np.argsort(spans, kind="stable") if x != h][:neighbors]
        made = False
        for l in light:
            if spans[l] >= spans[h]:
                break
            cands = _candidates(ranks[h], ranks[l], costs)
            pairs = [_exchanged(ranks[h], ranks[l], i, j) for i, j in cands]
            limit = spans[h] * (1 - 1e-12)
            # the light sides first: a candidate whose light side reaches the limit cannot be made,
            # so its heavy side is not priced (inf: never the least below the limit; issue 54)
            # Candidates are priced in the ascending order (no order search: above EXHAUSTIVE_ORDER
            # micro-batches that search was nearly all of PP 8's planning, issue 54): an upper
            # bound of the searched makespan, so one below the limit stays below it once searched;
            # only the exchange made is searched.
            _, light_spans = rank_makespans([pair[1] for pair in pairs], cost, tokens, regime, shape, search=False)
            heavy_spans = np.full(len(pairs), np.inf)
            keep = np.flatnonzero(light_spans < limit).tolist()
            if keep:
                heavy_spans[keep] = rank_makespans([pairs[k][0] for k in keep], cost, tokens, regime, shape, False)[1]
            worst = np.maximum(heavy_spans, light_spans)
            best = int(np.argmin(worst)) if worst.size else -1
            if best < 0 or not worst[best] < limit:
                continue
            ranks[h], ranks[l] = pairs[best]
            (packs[h], packs[l]), (spans[h], spans[l]) = rank_makespans(list(pairs[best]), cost, tokens, regime, shape)
            made = True
            break
        if not made:
            break
        done += 1
    return packs, spans, done


def pack_makespans(
    times: np.ndarray, mb_rank: np.ndarray, num_ranks: int, shape: PipelineShape, head: np.ndarray | float = 0.0
) -> np.ndarray:
    """``(R,)`` makespans of a plan's ranks from its micro-batch times ``(B,)`` in plan (= run)
    order and their ranks ``(B,)`` (non-decreasing); ``head`` ``(B,)`` seconds of each run on the
    last stage only (0: all spread by layers). A rank without micro-batches takes 0 s."""
    times = np.asarray(times, dtype=np.float64)
    head = np.broadcast_to(np.asarray(head, dtype=np.float64), times.shape)
    out = np.zeros(num_ranks)
    counts = np.bincount(mb_rank, minlength=num_ranks)
    starts = np.cumsum(counts) - counts
    for m in sorted(set(counts.tolist()) - {0}):
        rows = np.flatnonzero(counts == m)
        idx = starts[rows][:, None] + np.arange(m)[None, :]
        out[rows] = shape.makespans(times[idx], head[idx])
    return out


def least_makespan(
    candidates: list[tuple[str, RankPacks, int]], items: Items, cost_model: CostModel, shape: PipelineShape
):
    """Of candidate plans ``(name, packs, exchanges made)``, the one of least predicted makespan
    (ties: the earlier), each priced as the simulator prices it: ``predict_many`` per micro-batch
    in run order, the head term (:func:`~.schedule.head_seconds`) on the last stage. Returns
    ``(packs, flat, times, extra)`` as the planner's strategies do."""
    best = None
    for name, packs, made in candidates:
        flat = flatten_packs(packs)
        times = predict_packs(flat, items, cost_model)
        lengths, dens = padded_packs(flat, items)
        head = head_seconds(cost_model, lengths, dens, times[0])
        span = float(pack_makespans(times[0], flat.mb_rank, flat.num_ranks, shape, head).max())
        if best is None or span < best[0] * (1 - 1e-12):
            best = (span, packs, flat, times, {"local_search_moves": made, "candidate": name, "makespan": span})
    return best[1:]
