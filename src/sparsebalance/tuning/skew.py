"""Raises that stay safe when the latency model's split between attention and the rest is off.

DST raises a worker below the anchor to the largest budget *predicted* within it. The prediction
is ``T(v) = R + A(v)``, the rest and the attention; a profile measured on another load, another
machine or another model version is off in the split (issue 56 measured it off by 2x and more),
and then a raise that looked free makes a new straggler: DST ends slower than SAB alone.

The guard: with the true time ``T_s(v) = R + s A(v)`` for an unknown skew ``s`` in
``[1/m, m]`` (``m = DSTConfig.skew_margin``), a raised worker ``r`` keeps the largest budget
``v`` (at most its nominal raise) for which some *reference* worker ``w`` that DST does not raise
stays at least as slow at both ends of the range:

    T_s(v)_r <= T_s(v_w)_w   for s = 1/m and s = m

Both sides are linear in ``s``, so this holds for every ``s`` in the range; a worker that is not
raised is at or below its time before DST (a cut lowers ``A``), so no ``s`` in the range makes
the slowest worker after DST slower than before it. The references are the slowest non-raised
workers at ``s = 1/m``, 1 and ``m`` (three, whatever the number of workers). Where even the base
budget fails (SAB's plan itself is uneven under the skew) the worker keeps the base.

Pipelines (a :class:`~.pipeline_workload.PipelineWorkload`: :class:`PipelineSkew`). A makespan
is not additive in the attention seconds, but every op of the schedule is: priced as
``rest + s x attention`` (each micro-batch's ``R_m + s A_m`` spread over the stages as at
``s = 1``; the head is rest), the makespan under a skew ``s`` is exactly the same makespan
function's (1F1B, interleaved or ZB-H1). It is a max of path sums (the schedules are max-plus
recurrences), each linear in ``s``: convex and piecewise linear in ``s``, so the two ends alone
no longer decide. The reference ``F(s)`` is the slowest pipeline DST does not raise, at its
budgets after the cuts (at or below its makespan before DST at every ``s``). A raised pipeline
keeps the largest raise whose makespans ``M`` at ``s = 1/m``, 1 and ``m`` are within ``F``
there, and whose chords between those are within ``Lambda`` at ``k1`` in ``[1/m, 1]`` and ``k2``
in ``[1, m]``. ``Lambda <= F`` is the upper envelope of four secants of ``F`` taken just outside
the checked skews (left of ``1/m``, right of ``m``, on both sides of 1: a secant of a convex
function lies below it outside its own interval; :data:`SECANT_STEP`), equal to ``F`` at the
three skews; ``k1`` and ``k2`` are where they cross. Between two checked skews ``M`` is below its
chord (convex), the chord below the secants (checked at both ends of each piece), the secants
below ``F``: no raised pipeline ends slower than the slowest pipeline DST does not raise, for
every ``s`` in ``[1/m, m]``. Exact by the model, not sampled, from three makespans per pipeline
(the three skews alone would not be: two convex functions may cross between them; on the
project's mixes and golden plans the chord rows have not changed a decision yet).

The micro-batch level (:mod:`.microbatch_dst`) keeps every pipeline within the same check: one
whose budgets per micro-batch go above its one budget (the rank level's) and fail it has them
capped, at the largest cap that passes. At the cap of its one budget a pipeline is no slower, at
any skew, than at the rank level, where it passed the check, is in ``F`` or kept the base.

Cost: the rest ``R = T(base) - A(base)`` once (the base prices are the tuner's own, memoised),
then one :func:`~.knob.search_many` over the raised workers the check fails at their nominal
budget, each probe one ``seconds`` pricing of those workers (``T_s = s T - (s - 1) R``).
Pipelines: ``R`` per micro-batch once (the base prices shared with the micro-batch level); one
makespan pass for ``F`` at seven skews and the raised pipelines at their raise and at the base;
one for the micro-batch level's check (on its own prices); only where a check fails, a search
(false position, :func:`_largest_safe`: ~3-5 probes, each one pricing of the failing pipelines'
micro-batches and one makespan pass). Measured on the golden plans (``tests/tuning/
golden_plan_dst.py``, 2-core CPU, shared): +1.3-2.6 ms on a ``decide`` of 11-16 ms at DP2 PP4,
3-4.5 ms at DP8 PP4 and DP4 PP8.
"""

from __future__ import annotations

import itertools

import numpy as np

from .knob import Knob, search_many

SECANT_STEP = 1e-3
"""Relative step of the secants that bound the pipelines' reference from below at ``1/m``, 1 and
``m`` (:class:`PipelineSkew`): small enough that a secant is nearly the tangent, large enough that
the difference of two makespans is far above their rounding (~1e-16 relative)."""


def safe_raises(work, knob: Knob, value: np.ndarray, raised: np.ndarray, base: np.ndarray, margin: float) -> np.ndarray:
    """``value`` ``(W,)`` with the ``raised`` workers' budgets lowered (never below ``base``)
    to what stays safe for a skew up to ``margin`` (see the module docstring); ``work``: the
    step's workload (``seconds``, ``attention_seconds``)."""
    if margin <= 1.0 or not raised.any() or raised.all():
        return value
    ends = np.array([1.0 / margin, margin])[:, None]  # (E, 1)
    # The rest does not depend on the budget: T_s(v) = s T(v) - (s - 1) R, one pricing per probe.
    rest = work.seconds(base) - work.attention_seconds(base)
    t = work.seconds(value)
    at_ends = ends * t[None, :] - (ends - 1.0) * rest[None, :]  # (E, W)
    others = np.flatnonzero(~raised)
    picks = [np.argmax(at_ends[0, others]), np.argmax(t[others]), np.argmax(at_ends[1, others])]
    refs = np.unique(others[picks])
    ref_times = at_ends[:, refs]  # (E, Q)

    def excess(v: np.ndarray, priced: np.ndarray) -> np.ndarray:
        """``(W,)`` > 0 where the budget ``v`` passes every reference at some end (``priced``:
        the workers to price, a fixed set during the search so the workload reuses its subset)."""
        mine = ends * work.seconds(v, priced)[None, :] - (ends - 1.0) * rest[None, :]  # (E, W)
        # per reference: the worker's worst end; it is safe if some reference stays slower
        gap = (mine[:, :, None] - ref_times[:, None, :]).max(axis=0)  # (W, Q)
        return np.where(priced, gap.min(axis=1), 0.0)

    unsafe = raised & (excess(value, raised) > 0)
    if not unsafe.any():
        return value
    safe = search_many(knob, lambda v, sel: np.where(sel, excess(v, unsafe), 0.0), base, value, unsafe, tol=_tol(knob))
    return np.where(unsafe, safe, value)


def _tol(knob: Knob) -> float:
    """A guard needs no 1e-4 precision: a hundredth of a block (top-k), or 1e-4 in gamma."""
    return 0.01 if knob.integer else 1e-4


def _pipeline_tol(knob: Knob) -> float:
    """The pipelines' guard stops at a tenth of a block (top-k), or 1e-3 in gamma: each of its
    probes is a makespan pass (~0.1 ms whatever its rows), and a tenth of a block is ~0.1 % of
    the raises it keeps."""
    return 10.0 * _tol(knob)


class PipelineSkew:
    """The guard for pipelines (the module docstring): the micro-batches of a
    :class:`~.pipeline_workload.PipelineWorkload` (``prices``, in :class:`~.microbatch_dst.
    MicroBatchPrices`' flat order, ``E`` entries) priced under skews ``s``, and the reference a
    raised pipeline must stay below. ``margin``: ``DSTConfig.skew_margin``, > 1.

    A pipeline's check reads its makespans at ``s = 1/m, 1, m`` (``M3``, ``(3,)``): every row of
    ``weights @ M3`` must be at most ``limits``. :meth:`safe_raises` (the rank level) fits the
    reference first; :meth:`safe_microbatches` (the micro-batch level) reuses it."""

    def __init__(self, prices, margin: float) -> None:  # a microbatch_dst.MicroBatchPrices (it imports this module)
        assert margin > 1.0, "a margin of 1 trusts the model: no guard"
        self.prices, self.margin = prices, float(margin)
        base = np.full(prices.size, float(prices.knob.base))
        self.base_seconds = prices.seconds(base)
        """``(E,)`` each micro-batch's seconds at the base budget."""
        self.rest = self.base_seconds - prices.attention_seconds(base)
        """``(E,)`` each micro-batch's seconds that are not attention (the head among them): the
        same at every budget."""
        self.skews = np.array([1.0 / margin, 1.0, margin])
        self.weights: np.ndarray | None = None
        """``(5, 3)``: the three makespans and the chords' values at ``k1``, ``k2`` (set with
        the reference by :meth:`safe_raises`)."""
        self.limits: np.ndarray | None = None
        """``(5,)``: ``F`` at the three skews, ``Lambda`` at ``k1``, ``k2``."""

    def makespans(self, jobs: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> list[np.ndarray]:
        """Per job ``(times (E,), skews (S,), ranks bool (R,))``, the ``(S, R)`` makespans of the
        pipelines ``ranks`` (the others read 0) with micro-batch seconds ``times``, each op priced
        as ``rest + s x attention`` for each of ``skews``: one makespan pass for all the jobs
        (a column per job and skew)."""
        pipe = self.prices.pipe
        columns, heads = [], []
        for times, skews, ranks in jobs:
            s = np.asarray(skews, dtype=np.float64)[None, :]
            on = ranks[pipe.entry_rank][:, None]
            # R + s A; a pipeline left out runs zeros (makespan 0), not a negative stage
            columns.append(np.where(on, s * times[:, None] - (s - 1.0) * self.rest[:, None], 0.0))
            heads.append(np.where(on, pipe.head[:, None], 0.0).repeat(s.shape[1], axis=1))
        spans = pipe.makespans(np.concatenate(columns, axis=1), np.concatenate(heads, axis=1))
        bounds = np.cumsum([0, *(c.shape[1] for c in columns)])
        return [spans[:, a:b].T for a, b in itertools.pairwise(bounds.tolist())]

    def _fit(self, spans: np.ndarray) -> None:
        """``weights`` and ``limits`` from ``F`` at the seven skews of :meth:`safe_raises`."""
        f = spans
        a, b, h = 1.0 / self.margin, self.margin, SECANT_STEP
        # four lines below the convex F: a secant lies below it outside its own interval
        g_a = (f[1] - f[0]) / (a * h)  # through (a, F(a)), valid on [a, inf)
        g_1l = (f[4] - f[3]) / h  # through (1, F(1)), valid on (-inf, 1]
        g_1r = (f[3] - f[2]) / h  # valid on [1, inf)
        g_b = (f[6] - f[5]) / (b * h)  # through (b, F(b)), valid on (-inf, b]
        k1 = _crossing(f[1], g_a, a, f[3], g_1l, 1.0)
        k2 = _crossing(f[3], g_1r, 1.0, f[5], g_b, b)
        w1, w2 = (k1 - a) / (1.0 - a), (k2 - 1.0) / (b - 1.0)
        self.weights = np.array([[1, 0, 0], [1 - w1, w1, 0], [0, 1, 0], [0, 1 - w2, w2], [0, 0, 1]], dtype=np.float64)
        # at a crossing both lines must hold: one bounds the segment to its left, one to its right
        lim1 = min(f[1] + g_a * (k1 - a), f[3] + g_1l * (k1 - 1.0))
        lim2 = min(f[3] + g_1r * (k2 - 1.0), f[5] + g_b * (k2 - b))
        self.limits = np.array([f[1], lim1, f[3], lim2, f[5]])

    def _excess(self, spans: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        """``(R,)`` from ``(3, R)`` makespans at ``1/m, 1, m``: > 0 where a pipeline of ``ranks``
        fails the check (0 outside ``ranks``)."""
        assert self.weights is not None and self.limits is not None, "the reference is fitted by safe_raises"
        return np.where(ranks, (self.weights @ spans - self.limits[:, None]).max(axis=0), 0.0)

    def excess(self, values: np.ndarray, ranks: np.ndarray, times: np.ndarray | None = None) -> np.ndarray:
        """``(R,)`` > 0 where a pipeline of ``ranks`` at micro-batch budgets ``values`` ``(E,)``
        (priced: ``times``, when given) fails the check; 0 outside ``ranks``."""
        if times is None:
            times = self.prices.seconds(values, ranks[self.prices.rank_of])
        return self._excess(self.makespans([(times, self.skews, ranks)])[0], ranks)

    def safe_raises(self, knob: Knob, value: np.ndarray, raised: np.ndarray, base: np.ndarray) -> np.ndarray:
        """The rank level: fit the reference ``F`` to the pipelines not ``raised`` at their budgets
        ``value`` ``(R,)`` (after the cuts), and return ``value`` with the raised pipelines'
        budgets lowered (never below ``base``) to the largest that passes the check; the base
        where even it does not (SAB's plan is uneven under the skew). One makespan pass prices the
        reference, the raised pipelines at their raise and at the base."""
        of, a, b, h = self.prices.rank_of, 1.0 / self.margin, self.margin, SECANT_STEP
        seven = np.array([a * (1 - h), a, 1 - h, 1.0, 1 + h, b, b * (1 + h)])
        times = self.prices.seconds(value[of])
        spans, at_base = self.makespans(
            [(times, seven, np.ones(value.size, dtype=bool)), (self.base_seconds, self.skews, raised)]
        )
        self._fit(np.where(raised, 0.0, spans).max(axis=1, initial=0.0))
        over = self._excess(spans[[1, 3, 5]], raised)
        unsafe = raised & (over > 0)
        if not unsafe.any():
            return value
        lowest = self._excess(at_base, unsafe)
        found = _largest_safe(
            lambda v, sel: self.excess(v[of], sel), base, value, lowest, over, unsafe, _pipeline_tol(knob)
        )
        return np.where(unsafe, found, value)

    def safe_microbatches(
        self, knob: Knob, values: np.ndarray, times: np.ndarray, one: np.ndarray, ranks: np.ndarray
    ) -> np.ndarray:
        """The micro-batch level: ``values`` ``(E,)`` (budgets per micro-batch, priced ``times``)
        with each pipeline of ``ranks`` (bool ``(R,)``) whose micro-batches above its ``one``
        budget ``(R,)`` (the rank level's) make it fail the check capped at the largest budget
        that passes (at least ``one``: there it is no slower than at the rank level, at every
        skew). Returns ``values`` itself when nothing is capped."""
        of, n = self.prices.rank_of, self.prices.pipe.num_ranks
        above = ranks & (np.bincount(of, weights=values > one[of], minlength=n) > 0)
        if not above.any():
            return values
        over = self.excess(values, above, times)
        unsafe = above & (over > 0)
        if not unsafe.any():
            return values
        top = one.astype(np.float64).copy()
        np.maximum.at(top, of, values)

        def capped(cap: np.ndarray) -> np.ndarray:
            return np.minimum(values, np.maximum(cap, one)[of])

        lowest = self.excess(capped(one), unsafe)
        cap = _largest_safe(
            lambda c, sel: self.excess(capped(c), sel), one, top, lowest, over, unsafe, _pipeline_tol(knob)
        )
        return np.where(unsafe[of], capped(cap), values)


def _largest_safe(excess, lo: np.ndarray, hi: np.ndarray, h_lo, h_hi, unsafe: np.ndarray, tol: float):
    """Per ``unsafe`` entry (``excess(lo) = h_lo``, ``excess(hi) = h_hi > 0``), the largest ``v``
    in ``[lo, hi]`` with ``excess(v) <= 0`` found to ``tol``; ``lo`` where even ``lo`` fails.
    ``excess(v (n,), sel (n,)) -> (n,)``, non-decreasing in ``v``, evaluated where ``sel``.

    False position with the Illinois modification, each probe kept ``tol / 2`` inside the bracket:
    :func:`~.knob.search_many`'s would take ~15 probes here, a makespan being piecewise linear
    (its false positions land on the root's infeasible side, then it bisects the bracket down to
    the tolerance); with the step kept inside, a probe next to the root closes the bracket."""
    a, b = lo.astype(np.float64).copy(), hi.astype(np.float64).copy()
    ha, hb = np.where(unsafe, h_lo, 0.0), np.where(unsafe, h_hi, 1.0)
    live = unsafe & (ha <= 0)
    last = np.zeros(a.shape, dtype=np.int8)  # which end moved last: -1 a, +1 b
    for _ in range(100):  # a safeguard; the tolerance stops it after a handful of probes
        live &= b - a > tol
        if not live.any():
            break
        t = np.where(live, -ha / np.where(live, hb - ha, 1.0), 0.5)
        c = np.clip(a + t * (b - a), a + 0.5 * tol, b - 0.5 * tol)
        hc = np.where(live, excess(c, live), 0.0)
        ok, bad = live & (hc <= 0), live & (hc > 0)
        hb = np.where(ok & (last == -1), 0.5 * hb, hb)  # Illinois: an end kept twice is halved
        ha = np.where(bad & (last == 1), 0.5 * ha, ha)
        a, ha = np.where(ok, c, a), np.where(ok, hc, ha)
        b, hb = np.where(bad, c, b), np.where(bad, hc, hb)
        last = np.where(ok, -1, np.where(bad, 1, last)).astype(np.int8)
    return a


def _crossing(f0: float, g0: float, s0: float, f1: float, g1: float, s1: float) -> float:
    """Where the line through ``(s0, f0)`` of slope ``g0`` meets the one through ``(s1, f1)`` of
    slope ``g1 >= g0`` (convexity), clipped into ``[s0, s1]``; the middle when they are parallel."""
    if not g1 - g0 > 1e-12 * (abs(g0) + abs(g1)):
        return 0.5 * (s0 + s1)
    return float(np.clip((f1 - f0 + g0 * s0 - g1 * s1) / (g0 - g1), s0, s1))
