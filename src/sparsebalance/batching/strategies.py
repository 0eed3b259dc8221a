"""Assignment algorithms behind the planner strategies, on plain arrays of *items* (a sample, or a
chunk of a split sample): ranks first, then micro-batches inside each rank.

Two micro-batch regimes share every function:

- fixed count ``M`` per rank (no token bound): a rank holding ``n`` items runs ``min(n, M)``
  micro-batches;
- token capacity ``C`` per micro-batch: a rank holding ``t`` tokens runs at least ``ceil(t / C)``
  micro-batches (what the rank-level search assumes; the packer may need a few more).

Rank-level load in the search is additive: ``sum(item cost) + overhead * num_micro_batches``.
Everything is deterministic: stable sorts, ties broken by item index and rank index.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

RankItems = list[list[int]]  # rank -> item indices
RankPacks = list[list[list[int]]]  # rank -> micro-batch -> item indices


@dataclass(frozen=True)
class Regime:
    """Micro-batch regime: exactly one of ``micro_batches`` and ``capacity`` is set."""

    micro_batches: int | None
    capacity: int | None
    overhead: float
    """Seconds per (non-empty) micro-batch."""

    def num_mb(self, count: int, tokens: int) -> int:
        if count == 0:
            return 0
        if self.capacity is None:
            return min(count, self.micro_batches)
        return -(-tokens // self.capacity)

    def num_mb_vec(self, count: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        if self.capacity is None:
            return np.minimum(count, self.micro_batches)
        return np.where(count > 0, -(-tokens // self.capacity), 0)


def descending(key: np.ndarray) -> np.ndarray:
    """Item order by decreasing key, ties by increasing index (stable)."""
    return np.argsort(-key, kind="stable")


def shard_contiguous(order: np.ndarray, num_ranks: int) -> RankItems:
    """Items in ``order`` cut into ``num_ranks`` contiguous shards of equal count (±1). O(N)."""
    return _split_even(order.tolist(), num_ranks)


def _split_even(items: list, parts: int) -> list[list]:
    """``np.array_split`` on a list: the first ``len % parts`` parts hold one item more."""
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for p in range(parts):
        stop = start + size + (p < extra)
        out.append(items[start:stop])
        start = stop
    return out


def lpt_ranks(
    key: np.ndarray,
    num_ranks: int,
    regime: Regime | None = None,
    tokens: np.ndarray | None = None,
    base: list[float] | None = None,
) -> RankItems:
    """Longest-processing-time greedy: items by decreasing ``key``, each to the least-loaded rank.

    With ``regime`` (and ``tokens``) a rank's load also counts its micro-batch overheads; ``base``
    ``(R,)`` is load a rank already carries (its context-parallel units), 0 by default. LPT is
    within 4/3 of the optimal maximum. O(N log N + N log R).
    """
    ranks: RankItems = [[] for _ in range(num_ranks)]
    base = [0.0] * num_ranks if base is None else [float(b) for b in base]
    heap = [(base[r], r) for r in range(num_ranks)]
    heapq.heapify(heap)  # a no-op order for equal loads
    order = descending(key).tolist()
    keys = key.tolist()  # Python floats: numpy scalar indexing would dominate the loop
    # heap[0] then heapreplace: one sift instead of a pop and a push. Entries are distinct by
    # rank, so the minimum taken at every step (and the result) is the same as pop + push.
    if regime is None or regime.overhead == 0.0:
        for i in order:
            load, r = heap[0]
            ranks[r].append(i)
            heapq.heapreplace(heap, (load + keys[i], r))
        return ranks
    toks_of = tokens.tolist()
    sums, toks = list(base), [0] * num_ranks
    c0, m, cap = regime.overhead, regime.micro_batches, regime.capacity
    for i in order:
        r = heap[0][1]
        rank = ranks[r]
        rank.append(i)
        sums[r] += keys[i]
        toks[r] += toks_of[i]
        # regime.num_mb inlined (the count is >= 1 here)
        nmb = min(len(rank), m) if cap is None else -(-toks[r] // cap)
        heapq.heapreplace(heap, (sums[r] + c0 * nmb, r))
    return ranks


def local_search(
    ranks: RankItems,
    cost: np.ndarray,
    tokens: np.ndarray,
    regime: Regime,
    max_iters: int,
    neighbors: int = 4,
    base: list[float] | None = None,
) -> tuple[RankItems, int]:
    """Lower the maximum rank load by moves and swaps between the heaviest rank and the
    ``neighbors`` lightest ones. Returns the new assignment and the number of exchanges made.
    ``base`` ``(R,)``: fixed load per rank that no exchange moves (context-parallel units).

    Per step, for the heaviest rank h and each light rank l in turn: the best single move of an
    item h -> l (O(n_h)) and the best swap (for each item of h, the two items of l whose cost is
    nearest ``c_i - gap / 2``, by binary search: O(n_l log n_l + n_h log n_l)); the first light
    rank with an exchange that lowers ``max(load_h, load_l)`` below ``load_h`` gets it. Loads sit
    in two lazily invalidated heaps (O(log R) per update). Stops when the heaviest rank cannot be
    improved, or after ``max_iters`` exchanges. The maximum never increases.

    Plain Python on purpose: ranks hold few items, where numpy's per-call cost would dominate.
    """
    ranks = [list(r) for r in ranks]
    costs, toks_of = cost.tolist(), tokens.tolist()
    c0, nmb = regime.overhead, _micro_batch_counter(regime)
    num_ranks = len(ranks)
    fixed = [0.0] * num_ranks if base is None else [float(b) for b in base]
    sums = [fixed[r] + sum(costs[i] for i in rk) for r, rk in enumerate(ranks)]
    toks = [sum(toks_of[i] for i in rk) for rk in ranks]
    load = [sums[r] + c0 * nmb(len(ranks[r]), toks[r]) for r in range(num_ranks)]
    version = [0] * num_ranks
    heavy = [(-load[r], r, 0) for r in range(num_ranks)]
    light = [(load[r], r, 0) for r in range(num_ranks)]
    heapq.heapify(heavy)
    heapq.heapify(light)
    done = 0
    while done < max_iters:
        h = _heaviest(heavy, version)
        cur = load[h]
        best = None
        for _, l, _ in _lightest(light, version, neighbors):
            if l == h or load[l] >= cur:
                continue
            best = _best_exchange(ranks[h], ranks[l], h, l, costs, toks_of, sums, toks, cur, load[l], c0, nmb)
            if best is not None:
                break
        if best is None:
            break
        i, j, l = best
        _exchange(ranks, h, l, i, j)
        for r in (h, l):
            sums[r] = fixed[r] + sum(costs[x] for x in ranks[r])
            toks[r] = sum(toks_of[x] for x in ranks[r])
            load[r] = sums[r] + c0 * nmb(len(ranks[r]), toks[r])
            version[r] += 1
            heapq.heappush(heavy, (-load[r], r, version[r]))
            heapq.heappush(light, (load[r], r, version[r]))
        done += 1
    return ranks, done


def _micro_batch_counter(regime: Regime):
    """``nmb(count, tokens)``: the micro-batches of a rank holding ``count`` items of ``tokens``
    tokens in all (:meth:`Regime.num_mb`), as a closure over plain locals: the exchange search
    calls it for every candidate item."""
    m, cap = regime.micro_batches, regime.capacity

    def nmb(count: int, tok: int) -> int:
        if count == 0:
            return 0
        return min(count, m) if cap is None else -(-tok // cap)

    return nmb


def _heaviest(heavy: list[tuple], version: list[int]) -> int:
    """The heaviest rank: stale entries (an older ``version`` of their rank) popped off the top."""
    while heavy[0][2] != version[heavy[0][1]]:
        heapq.heappop(heavy)
    return heavy[0][1]


def _lightest(light: list[tuple], version: list[int], neighbors: int) -> list[tuple]:
    """The ``neighbors`` lightest valid entries ``(load, rank, version)``, lightest first; stale
    ones are dropped, the valid ones stay in the heap."""
    lights = []
    while light and len(lights) < neighbors:
        entry = heapq.heappop(light)
        if entry[2] == version[entry[1]]:
            lights.append(entry)
    for entry in lights:
        heapq.heappush(light, entry)
    return lights


def _best_exchange(items_h, items_l, h, l, costs, toks_of, sums, toks, cur, cur_l, c0, nmb):
    """Best move (j = -1) or swap between ranks h and l as ``(i, j, l)``, or None if nothing
    lowers ``max(load_h, load_l)`` below ``cur`` (by more than a relative 1e-12)."""
    n_h, n_l = len(items_h), len(items_l)
    best_val, best = cur * (1 - 1e-12), None
    for i in items_h:
        c, t = costs[i], toks_of[i]
        val = max(sums[h] - c + c0 * nmb(n_h - 1, toks[h] - t), sums[l] + c + c0 * nmb(n_l + 1, toks[l] + t))
        if val < best_val:
            best_val, best = val, (i, -1, l)
    if not n_l:
        return best
    srt = sorted(items_l, key=lambda j: (costs[j], j))
    cl_sorted = [costs[j] for j in srt]
    half_gap = (cur - cur_l) / 2
    for i in items_h:
        c, t = costs[i], toks_of[i]
        pos = bisect.bisect_left(cl_sorted, c - half_gap)
        for p in (pos - 1, pos):
            if 0 <= p < n_l:
                j = srt[p]
                d_c, d_t = c - costs[j], toks_of[j] - t
                val = max(sums[h] - d_c + c0 * nmb(n_h, toks[h] + d_t), sums[l] + d_c + c0 * nmb(n_l, toks[l] - d_t))
                if val < best_val:
                    best_val, best = val, (i, j, l)
    return best


def _exchange(ranks: RankItems, h: int, l: int, i: int, j: int) -> None:
    ranks[h].remove(i)
    ranks[l].append(i)
    if j >= 0:
        ranks[l].remove(j)
        ranks[h].append(j)


def pack_in_order(items: list[int], tokens: np.ndarray, regime: Regime) -> list[list[int]]:
    """Naive packing in the given order: ``M`` contiguous groups of equal count, or next-fit into
    micro-batches of ``C`` tokens. O(n)."""
    if not items:
        return []
    if regime.capacity is None:
        return _split_even(list(items), min(len(items), regime.micro_batches))
    packs, room = [[]], regime.capacity
    for i, t in zip(items, tokens[items].tolist(), strict=True):
        if t > room:
            packs.append([])
            room = regime.capacity
        packs[-1].append(i)
        room -= t
    return packs


def length_buckets(tokens: np.ndarray, num_ranks: int, regime: Regime) -> RankPacks:
    """Length-based batching (the SparseBalance paper's LBB baseline): items sorted by length
    (longest first, ties by index), cut into consecutive micro-batches (``R x M`` groups of equal
    count, or next-fit into ``C`` tokens), dealt to ranks in snake order (0 .. R-1, then R-1 .. 0,
    ...: each rank gets one bucket of every R consecutive ones, the heavy end alternating). The
    paper does not say how its buckets meet data-parallel ranks; the snake deal is the stronger
    baseline of the simple ones (round-robin gives rank 0 the heaviest bucket of every round).
    Similar lengths share a micro-batch; ranks are not balanced beyond the deal. O(N log N)."""
    order = descending(tokens.astype(np.float64)).tolist()
    if regime.capacity is None:
        buckets = _split_even(order, min(len(order), num_ranks * regime.micro_batches))
    else:
        buckets = pack_in_order(order, tokens, regime)
    packs: RankPacks = [[] for _ in range(num_ranks)]
    for j, bucket in enumerate(buckets):
        lap, pos = divmod(j, num_ranks)
        packs[pos if lap % 2 == 0 else num_ranks - 1 - pos].append(bucket)
    return packs


def pack_balanced_ranks(ranks: RankItems, key: np.ndarray, tokens: np.ndarray, regime: Regime) -> RankPacks:
    """:func:`pack_balanced` of every rank. With a fixed ``M`` the per-rank LPTs run together,
    one numpy round per item position (the j-th largest item of every rank at once), with the
    same order, tie-breaks and float additions as the per-rank heaps. O(N log N) numpy."""
    if regime.capacity is not None or not ranks:
        return [pack_balanced(rank, key, tokens, regime) for rank in ranks]
    counts = np.array([len(rank) for rank in ranks], dtype=np.int64)
    if counts.sum() == 0:
        return [[] for _ in ranks]
    item = np.fromiter((i for rank in ranks for i in rank), dtype=np.int64, count=counts.sum())
    rank_of = np.repeat(np.arange(len(ranks)), counts)
    k = key[item]
    # Per rank: decreasing key, ties by item index (pack_balanced's sort).
    srt = np.lexsort((item, -k, rank_of))
    item, rank_of, k = item[srt], rank_of[srt], k[srt]
    pos = np.arange(item.size) - np.repeat(np.cumsum(counts) - counts, counts)
    m = regime.micro_batches
    bins = np.minimum(counts, m)
    loads = np.where(np.arange(m)[None, :] < bins[:, None], 0.0, np.inf)  # (R, M)
    bin_of = np.empty(item.size, dtype=np.int64)
    for j in range(int(counts.max())):
        at = np.flatnonzero(pos == j)  # the j-th item of every rank holding more than j
        rows = rank_of[at]
        b = np.argmin(loads[rows], axis=1)  # least-loaded bin, ties by lower index (the heap's)
        loads[rows, b] += k[at]
        bin_of[at] = b
    # Items per (rank, bin) in placement order, as nested lists.
    order = np.lexsort((pos, bin_of, rank_of))
    flat_items = item[order].tolist()
    sizes = np.bincount(rank_of * m + bin_of, minlength=len(ranks) * m).tolist()
    packs, start = [], 0
    for r, nb in enumerate(bins.tolist()):
        rank_packs = []
        for b in range(nb):
            stop = start + sizes[r * m + b]
            rank_packs.append(flat_items[start:stop])
            start = stop
        packs.append(rank_packs)
    return packs


def pack_balanced(items: list[int], key: np.ndarray, tokens: np.ndarray, regime: Regime) -> list[list[int]]:
    """Split one rank's items into micro-batches with even ``key`` loads.

    Fixed ``M``: LPT into ``min(n, M)`` micro-batches. Capacity ``C``: best-fit decreasing on
    tokens fixes the number of micro-batches ``k`` (near the minimum), then items by decreasing
    key go to the least-loaded micro-batch with room (a heap; full ones are skipped); if no
    micro-batch has room for an item, the best-fit packing is kept. O(n log n) typical, O(n k)
    worst case. Plain Python: ranks hold few items, where numpy's per-call cost would dominate.
    """
    if not items:
        return []
    keys = key[items].tolist()
    order = sorted(range(len(items)), key=lambda j: (-keys[j], items[j]))
    if regime.capacity is None:
        k = min(len(items), regime.micro_batches)
        packs = [[] for _ in range(k)]
        heap = [(0.0, b) for b in range(k)]
        for j in order:
            load, b = heapq.heappop(heap)
            packs[b].append(items[j])
            heapq.heappush(heap, (load + keys[j], b))
        return packs
    packs = best_fit_decreasing(items, tokens, regime.capacity)
    k = len(packs)
    if k == 1:
        return packs
    toks = tokens[items].tolist()
    room = [regime.capacity] * k
    balanced = [[] for _ in range(k)]
    heap = [(0.0, b) for b in range(k)]
    for j in order:
        t, skipped = toks[j], []
        while heap and room[heap[0][1]] < t:
            skipped.append(heapq.heappop(heap))
        if not heap:
            return packs
        load, b = heapq.heappop(heap)
        balanced[b].append(items[j])
        room[b] -= t
        heapq.heappush(heap, (load + keys[j], b))
        for entry in skipped:
            heapq.heappush(heap, entry)
    return balanced


def best_fit_decreasing(items: list[int], tokens: np.ndarray, capacity: int) -> list[list[int]]:
    """Bin packing by tokens: items by decreasing size, each into the fullest micro-batch that
    still has room (ties: the oldest). Uses at most 11/9 OPT + 1 micro-batches. O(n log n + n k)
    (the sorted insertions move at most k entries)."""
    toks = tokens[items].tolist()
    packs: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (room, pack index)
    for j in sorted(range(len(items)), key=lambda j: (-toks[j], items[j])):
        t = toks[j]
        pos = bisect.bisect_left(free, (t, -1))
        if pos == len(free):
            packs.append([items[j]])
            b, room = len(packs) - 1, capacity - t
        else:
            room, b = free.pop(pos)
            packs[b].append(items[j])
            room -= t
        bisect.insort(free, (room, b))
    return packs


def flops_key(tokens: np.ndarray, linear_coef: float) -> np.ndarray:
    """``c * L + L^2`` (dense attention FLOPs plus the token-proportional rest, up to a factor);
    ``c = inf`` (a cost model without a quadratic part) means plain ``L``."""
    t = tokens.astype(np.float64)
    return t if math.isinf(linear_coef) else linear_coef * t + t * t


def flops_linear_coef(shapes: Mapping[str, int]) -> float:
    """``c`` of the ``flops`` key from the model's shapes (the keys of ``ModelShapes.to_dict()``,
    as a latency profile's fingerprint holds them): the multiply-adds per token of the
    token-linear layers (q, k, v, o projections, the gated MLP and the LM head, spread over the
    layers) over the attention multiply-adds per (query, key) pair (``q.k`` and ``p.v``: two per
    head dimension per head). Every pair of the ``L^2`` term counts, as verl and slime count them
    (a causal mask halves the pairs, the same factor for every document). A 7B Llama shape gives
    about 25,200 (24,700 without the LM head; verl hard-codes 24,576 = 6 x 4096)."""
    h, d = int(shapes["hidden_size"]), int(shapes["head_dim"])
    heads, kv_heads = int(shapes["num_heads"]), int(shapes["num_kv_heads"])
    projections = h * d * (2 * heads + 2 * kv_heads)
    mlp = 3 * h * int(shapes["intermediate_size"])
    head = h * int(shapes["vocab_size"]) / int(shapes["num_layers"])
    return (projections + mlp + head) / (2 * heads * d)


def fit_linear_coef(doc_seconds_dense) -> float:
    """``c`` such that ``c L + L^2`` is proportional to a cost model's dense document time, fitted
    at L = 1024 and 8192 (``doc_seconds_dense(lengths) -> seconds``); ``inf`` when the model has
    no quadratic part. Used for a cost model without model shapes (see :func:`flops_linear_coef`):
    under a measured or analytic profile the fit degenerates (the key becomes plain ``L``)."""
    lens = np.array([1024.0, 8192.0])
    f = np.asarray(doc_seconds_dense(lens), dtype=np.float64) / lens  # a + b L
    b = (f[1] - f[0]) / (lens[1] - lens[0])
    a = f[0] - b * lens[0]
    if not b > 0:
        return math.inf
    return max(0.0, a / b)
