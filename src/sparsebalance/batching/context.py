"""``sab-cp``: the hybrid data x context parallel planner (a moldable-task schedule).

Why a strategy and not a ``--cp`` flag on every strategy: only a cost-aware planner can price the
trade-off (ranks spent on a document against time saved); the baselines stay whole-document
references. ``sab-cp`` = whole-document ``sab`` plus per-document context parallelism, and it is
never slower than ``sab`` under the same cost model (it times both and keeps the faster).

Input: items (documents; ``--overlong`` applies only above ``R x C`` tokens), a
:class:`~sparsebalance.latency.context.ContextCost` ``t(L, d, k)`` (per-rank seconds of one
document on a unit of k ranks), R ranks, capacity C (or M micro-batches per rank).

1. Memory: document i needs ``k >= kmin_i = ceil(L_i / C)`` (1 without C), or more where the
   cost model carries a memory bound (``--capacity auto``: the memory model's own minimum, which
   also counts the ring's buffer and the whole document's layout metadata).
2. Candidates: documents with ``kmin > 1`` or whose whole time exceeds half the mean rank load
   (smaller ones are never worth splitting: they fill gaps). Their times ``t(i, k)`` are tabled
   for every k (any k, not only powers of two) up to what the longest one needs to reach the
   mean rank load (x 1.5, + 2), and up to R for the bound of the 32 longest.
3. Lower bound: ``max(sum_i area_i / R, max_i min_k t(i, k))`` with ``area_i = min_k k t(i, k)``
   over feasible k (rank-seconds no plan can avoid; a whole document's area is its SAB cost).
4. Target scan: for a target step time T, document i runs on the smallest feasible k with
   ``t(i, k) <= T`` (the least area that meets T: raising k stops once communication makes it
   useless, at the argmin of ``t``); documents left at k = 1 stay whole. The step time of T
   is estimated as ``max(slowest CP unit, (CP rank-seconds + whole-document work) / R, largest
   whole document)``; T runs over a geometric grid from the lower bound to the no-split time.
5. The best target is built for real: CP units are placed longest first on the contiguous window
   of k ranks that frees earliest (in-node windows for k <= G, node-aligned for multiples of G;
   ties: the lowest rank); whole documents go to ranks by LPT on predicted
   seconds on top of each rank's CP load, refined by ``sab``'s local search (CP load fixed), and
   packed into micro-batches (ranks may run different numbers). Each rank runs its CP units
   first, in slot order, then its micro-batches. The plan of all-whole documents is ``sab``
   itself; the fastest predicted plan wins (``metrics.candidate``: ``cp`` or ``sab``).

Complexity: O(N log N) for ``sab``, O(n_c R) for the table (n_c candidates, ``<= 2R``),
O(S n_c) for the scan (S targets), and for the best target a placement (O(U R k)
numpy, U CP units) and an LPT + local-search build.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .plan import FlatPacks, Items, flatten_packs, predict_packs
from .strategies import Regime, local_search, lpt_ranks, pack_balanced_ranks

_SCAN = 16  # targets in the geometric scan


@dataclass(frozen=True)
class CPUnits:
    """Placed CP units (k > 1), in slot order; arrays ``(U,)``."""

    item: np.ndarray
    """Item index of the unit's document."""
    degree: np.ndarray
    start_rank: np.ndarray
    """The unit runs on ranks ``start_rank .. start_rank + degree - 1``."""
    start: np.ndarray
    """Predicted start (seconds since the step began)."""
    seconds: np.ndarray
    """Per-rank seconds of the unit."""
    comm: np.ndarray
    """Per-rank exposed communication seconds."""

    @staticmethod
    def empty() -> CPUnits:
        z = np.zeros(0, dtype=np.int64)
        return CPUnits(z, z, z, np.zeros(0), np.zeros(0), np.zeros(0))


@dataclass(frozen=True)
class CPResult:
    """The ``sab-cp`` decision before a :class:`~sparsebalance.batching.plan.Plan` is built."""

    units: CPUnits
    ready: np.ndarray
    """``(R,)`` when each rank's CP units end (its micro-batches start then)."""
    packs: list[list[list[int]]]
    """rank -> micro-batch -> item index of the whole documents."""
    flat: FlatPacks
    dp_times: tuple[np.ndarray, np.ndarray]
    """:func:`predict_packs` of ``packs``: ``(B,)`` and ``(R,)`` seconds."""
    rank_times: np.ndarray
    """``(R,)`` predicted finish time of each rank (CP units, waits, micro-batches)."""
    lower_bound: float
    local_search_moves: int = 0


def allowed_starts(k: int, num_ranks: int, per_node: int) -> np.ndarray:
    """First ranks of the windows a k-rank unit may use: inside one node when ``k <= G`` (at
    multiples of k from the node's first rank, and flush with its last rank), node-aligned when k
    is a multiple of G, anywhere otherwise. Increasing."""
    if k <= per_node:
        inside = sorted({*range(0, per_node - k + 1, k), per_node - k})
        nodes = np.arange(0, num_ranks - per_node + 1, per_node)
        s = (nodes[:, None] + np.asarray(inside)[None, :]).reshape(-1)
        tail = num_ranks % per_node  # a last, partial node
        if tail >= k:
            base = num_ranks - tail
            s = np.concatenate([s, base + np.arange(0, tail - k + 1, k)])
        return np.unique(s)
    if k % per_node == 0:
        return np.arange(0, num_ranks - k + 1, per_node)
    return np.arange(num_ranks - k + 1)


def place_units(degree, seconds, num_ranks: int, per_node: int, aligned: bool = False):
    """Greedy contiguous placement of rigid units, longest first: each goes to the allowed window
    that frees earliest (ties: lowest rank). ``aligned``: a k-rank unit only on the groups
    ``[jk, (j + 1) k)`` (a fixed ``(dp, cp)`` mesh).

    Args: ``degree`` int ``(U,)``, ``seconds`` ``(U,)``. Returns ``(order (U,), start_rank (U,),
    start (U,), ready (R,))``: units in placement (= slot) order and their windows. O(U S k)
    numpy (S allowed windows per degree, about R / k), three numpy calls per unit.
    """
    order = np.lexsort((np.arange(degree.size), -degree, -seconds))
    ready = np.zeros(num_ranks)
    start_rank = np.zeros(degree.size, dtype=np.int64)
    start = np.zeros(degree.size)
    windows: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    secs = seconds.tolist()
    degs = degree.tolist()
    for u in order.tolist():
        k = degs[u]
        if k not in windows:
            s = np.arange(0, num_ranks - k + 1, k) if aligned else allowed_starts(k, num_ranks, per_node)
            windows[k] = (s, s[:, None] + np.arange(k)[None, :])
        s, idx = windows[k]
        top = ready[idx].max(axis=1)
        best = int(top.argmin())  # the first minimum: the lowest rank
        r0, t0 = int(s[best]), float(top[best])
        ready[r0 : r0 + k] = t0 + secs[u]
        start_rank[u], start[u] = r0, t0
    return order, start_rank[order], start[order], ready


def plan_cp(
    items: Items,
    regime: Regime,
    cost,
    num_ranks: int,
    iters: int,
    neighbors: int,
    sab_time: float,
    fixed: int | None = None,
) -> CPResult | None:
    """The best CP plan found (see the module docstring), or None when no document gains from
    a split and none needs one (``sab`` is then the plan). ``sab_time``: the ``sab`` plan's
    predicted step time (the scan's upper end). ``fixed``: the only CP degree allowed (``--cp
    K``: units of exactly K ranks on aligned groups; items are at most K x C tokens)."""
    r, cap = num_ranks, regime.capacity
    kmin = cost.min_degree(items.tokens, cap, r)  # ceil(L / C), or the memory model's minimum
    whole = items.cost + regime.overhead
    mean_load = float(items.cost.sum()) / r
    cand = _candidates(kmin, whole, mean_load, r)
    if cand.size == 0 or (r == 1 and not (kmin > 1).any()):
        return None
    t, comm, feasible, t_feas, ks = _tables(items, cost, cand, kmin, whole, mean_load, r, fixed)
    bound = _lower_bound(
        items, cost, cand, kmin, whole, t, t_feas, feasible, r, ks, exact_beyond=ks.size < r and fixed is None
    )
    forced = bool((kmin > 1).any())
    builds = [_scan(t_feas, feasible, cand, items, regime, r, bound, sab_time if not forced else 0.0)]
    if forced:  # the memory-minimum plan: the whole-document reference when C forces splits
        builds.append(np.maximum(kmin[cand], 1) if fixed is None else np.where(kmin[cand] > 1, fixed, 1))
    per_node, aligned = cost.links.ranks_per_node, fixed is not None
    best: CPResult | None = None
    tried = set()
    for deg in builds:
        key = deg.tobytes()
        if key in tried:
            continue
        tried.add(key)
        res = _build(deg, t_feas, comm, cand, items, regime, r, per_node, iters, neighbors, bound, cost, aligned)
        if res is not None and (best is None or res.rank_times.max() < best.rank_times.max()):
            best = res
    return best


def _tables(items: Items, cost, cand, kmin, whole, mean_load: float, r: int, fixed: int | None):
    """The candidates' times and ring seconds ``(num_cand, kcap)`` at k = 1 .. kcap, which k are
    feasible (at least the memory minimum; with ``fixed``, 1 or exactly it), the times with the
    infeasible ones at inf, and the ks ``(kcap,)``."""
    # Degrees tabled for the scan: up to what the longest document needs to reach the mean load
    # (the scan's targets are >= it), with room for the ring's imbalance and communication.
    kcap = int(min(r, max(int(kmin.max()), int(np.ceil(1.5 * whole.max() / mean_load)) + 2)))
    if fixed is not None:
        kcap = fixed
    ks = np.arange(1, kcap + 1)
    t, comm = cost.table(items.tokens[cand], items.density[cand], ks)
    feasible = ks[None, :] >= kmin[cand][:, None]
    if fixed is not None:  # whole (k = 1) or exactly K
        feasible &= ((ks == 1) | (ks == fixed))[None, :]
    return t, comm, feasible, np.where(feasible, t, np.inf), ks


def _candidates(kmin: np.ndarray, whole: np.ndarray, mean_load: float, r: int) -> np.ndarray:
    """The items a split may help: those that need one (``kmin > 1``) and those whose whole cost
    exceeds half the mean rank load (at most the 2R heaviest of them), in index order."""
    cand = np.flatnonzero((kmin > 1) | (whole > 0.5 * mean_load))
    if cand.size > 2 * r:  # at most 2R documents can each exceed half the mean load
        keep = np.argsort(-whole[cand], kind="stable")[: 2 * r]
        cand = np.union1d(cand[np.sort(keep)], np.flatnonzero(kmin > 1))
    return cand


def _lower_bound(items: Items, cost, cand, kmin, whole, t, t_feas, feasible, r: int, ks, exact_beyond: bool) -> float:
    """A lower bound on the step time: the mean rank load with every candidate at its smallest
    area (k x t; whole documents share an overhead), or the slowest candidate at its best k.
    ``exact_beyond``: the table stops below R (and no degree is fixed), so the 32 heaviest
    candidates' best times are looked up over every k <= R."""
    # The bound's max term needs the best time over every k <= R: exact for the longest
    # candidates (min_k t grows with the document), the tabled range for the rest.
    best_t = t_feas.min(axis=1)
    if exact_beyond:
        top = np.argsort(-whole[cand], kind="stable")[:32]
        t_all, _ = cost.table(items.tokens[cand[top]], items.density[cand[top]], np.arange(1, r + 1))
        ok = np.arange(1, r + 1)[None, :] >= kmin[cand[top]][:, None]
        best_t[top] = np.minimum(best_t[top], np.where(ok, t_all, np.inf).min(axis=1))
    area = np.where(feasible, t * ks[None, :], np.inf)
    area[:, 0] = np.where(kmin[cand] == 1, items.cost[cand], np.inf)  # whole: shares an overhead
    other = float(items.cost.sum() - items.cost[cand].sum())
    return max((other + float(area.min(axis=1).sum())) / r, float(best_t.max()))


def _scan(t_feas, feasible, cand, items: Items, regime: Regime, r: int, bound: float, sab_time: float) -> np.ndarray:
    """The candidates' degrees of the best-estimated target of a geometric scan from ``bound``
    to the slowest candidate at its smallest feasible k (or ``sab_time``, when larger)."""
    rows = np.arange(cand.size)
    at_min = t_feas[rows, np.argmax(feasible, axis=1)]  # each at its smallest feasible k
    hi = max(float(at_min.max()), sab_time, bound * (1 + 1e-9))
    targets = bound * (hi / bound) ** (np.arange(_SCAN) / (_SCAN - 1))
    scored = []
    for target in targets.tolist():
        deg = _degrees(t_feas, target)
        scored.append((_estimate(deg, t_feas, cand, items, regime, r), target, deg))
    scored.sort(key=lambda x: (x[0], x[1]))
    return scored[0][2]


def _degrees(t_feas: np.ndarray, target: float) -> np.ndarray:
    """Per candidate, the smallest feasible k with ``t <= target``, else the fastest k."""
    ok = t_feas <= target
    first = np.argmax(ok, axis=1)
    fastest = np.argmin(t_feas, axis=1)
    return np.where(ok.any(axis=1), first, fastest) + 1


def _split_sets(deg, t_feas, cand):
    split = deg > 1
    rows = np.flatnonzero(split)
    return rows, cand[rows], deg[rows], t_feas[rows, deg[rows] - 1]


def _estimate(deg, t_feas, cand, items, regime, r):
    """Step time of a degree choice without placing it: the slowest CP unit, the mean load
    (CP rank-seconds + whole documents + their overheads over R), the largest whole document."""
    rows, idx, k, secs = _split_sets(deg, t_feas, cand)
    if rows.size and k.max() > r:
        return np.inf
    dp = np.ones(items.tokens.size, dtype=bool)
    dp[idx] = False
    n_dp = int(dp.sum())
    mbs = -(-int(items.tokens[dp].sum()) // regime.capacity) if regime.capacity is not None else min(n_dp, r)
    biggest = float(items.cost[dp].max()) + regime.overhead if n_dp else 0.0
    area = float((k * secs).sum()) + float(items.cost[dp].sum()) + regime.overhead * mbs
    return max(float(secs.max()) if secs.size else 0.0, area / r, biggest)


def _build(deg, t_feas, comm, cand, items: Items, regime, r, per_node, iters, neighbors, bound, cost, aligned=False):
    rows, idx, k, secs = _split_sets(deg, t_feas, cand)
    if rows.size and k.max() > r:
        return None
    order, start_rank, start, ready = place_units(k, secs, r, per_node, aligned)
    units = CPUnits(
        idx[order],
        k[order],
        start_rank,
        start,
        secs[order],
        comm[rows, k - 1][order],
    )
    dp = np.ones(items.tokens.size, dtype=bool)
    dp[idx] = False
    dp_items = np.flatnonzero(dp)
    base = ready.tolist()
    ranks = lpt_ranks(items.cost[dp_items], r, regime, items.tokens[dp_items], base=base)
    ranks = [[int(dp_items[j]) for j in rk] for rk in ranks]
    ranks, moves = local_search(ranks, items.cost, items.tokens, regime, iters, neighbors, base)
    packs = pack_balanced_ranks(ranks, items.cost, items.tokens, regime)
    flat = flatten_packs(packs)
    dp_times = predict_packs(flat, items, cost)
    return CPResult(units, ready, packs, flat, dp_times, ready + dp_times[1], bound, moves)
