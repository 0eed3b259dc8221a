"""The budget knob DST turns: ``top_k`` (the paper's MoBA budget) or ``gamma``, behind one
interface, so the step-level rule (:mod:`.dst`), the layer controller (:mod:`.layer`), the workloads
and the simulator never branch on the budget kind.

A knob has a base value (what the planner's densities are estimated at), a floor ``lo`` (the
deepest cut), an upper bound (how far a raise may go) and a density response (what a document of
length ``L`` costs at value ``v``: :meth:`density`). Values travel as float64 arrays.

Discreteness. A layer runs an integer k, but a worker's step-level budget is a real number: the
mean k over its (micro-batch, layer) units, which the :class:`~.layer.LayerController` realizes by
choosing k or k + 1 per layer against the time it has left (integer searches there). Priced at a
real k, :func:`~sparsebalance.ops.topk_density` interpolates between whole blocks. So step-level
searches are continuous for both kinds (to 1e-7 in gamma, 1e-4 blocks in k) and the rule keeps
its guarantees without one-block jumps; the layer level searches integers.

- :class:`TopKKnob`: ``density = topk_density(L, k)``, exact from the length (the top-k rule keeps
  ``min(i + 1, k + anchors)`` blocks in query block ``i``); the planner's per-document estimate
  ``d0`` is not needed to price it.
- :class:`GammaKnob`: ``density = DensityCurve(d0, gamma)``, from the document's estimated
  density at ``gamma0``.

:func:`search_many` is the one vectorised bisection both use: per active entry, the largest
(or smallest) value in ``[lo, hi]`` satisfying a monotone predicate.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..ops import Budget, topk_density
from .curve import DensityCurve

GAMMA_TOL = 1e-7
"""Bisection on gamma stops when the interval is this narrow (about 23 halvings of [0.5, 1])."""
TOPK_TOL = 1e-4
"""Step-level bisection on k stops at this width (blocks): about 20 halvings of [8, 128]."""


@dataclass(frozen=True)
class GammaKnob:
    """Threshold budgets: the knob is gamma in ``[lo, hi]``, base ``curve.gamma0``."""

    curve: DensityCurve
    lo: float
    """The lowest gamma a cut may reach (``--gamma-min``)."""
    hi: float
    """The highest gamma a raise may reach (``--gamma-max``)."""
    kind = "gamma"
    integer = False

    @property
    def base(self) -> float:
        return self.curve.gamma0

    def density(self, lengths: np.ndarray, d0: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Densities of documents (``d0`` at gamma0) at ``values``; broadcasts."""
        return self.curve.density(d0, values)

    def upper(self, max_lengths: np.ndarray) -> np.ndarray:
        """``(R,)`` the highest value worth trying per worker: ``hi`` everywhere."""
        return np.full(np.shape(max_lengths), self.hi, dtype=np.float64)

    def budget(self, template: Budget, value: float) -> Budget:
        """``template`` (anchors, caps) with this knob at ``value``."""
        return _with_value(template, "gamma", value)

    def note(self, lengths: np.ndarray) -> str:
        """One line for a run's start: the base budget and DST's range."""
        return f"budget: gamma {self.base} (DST range [{self.lo}, {self.hi}])"


@dataclass(frozen=True)
class TopKKnob:
    """Top-k budgets: the knob is k (key blocks per query block, anchors not counted)."""

    base: int
    """k of the base budget (``--budget-tokens / block size``)."""
    lo: int
    """The smallest k a cut may reach (``--budget-tokens-min / block size``)."""
    hi: int | None
    """The largest k a raise may reach; None: up to exact attention on the longest document."""
    block_size: int
    anchor_blocks: int = 2
    """Sink + local blocks kept on top of k (the :class:`~sparsebalance.ops.Budget` anchors)."""
    kind = "top-k"
    integer = True

    def __post_init__(self) -> None:
        if not 0 <= self.lo <= self.base:
            raise ValueError(f"top-k: need 0 <= k_min ({self.lo}) <= k_base ({self.base})")
        if self.hi is not None and self.hi < self.base:
            raise ValueError(f"top-k: k_max ({self.hi}) must be >= k_base ({self.base})")
        if self.block_size <= 0:
            raise ValueError(f"top-k: block size must be > 0, got {self.block_size}")

    def density(self, lengths: np.ndarray, d0: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Densities of documents of ``lengths`` at k = ``values`` (``d0`` unused); broadcasts."""
        shape = np.broadcast_shapes(np.shape(lengths), np.shape(d0), np.shape(values))
        lengths = np.broadcast_to(lengths, shape)
        dens = topk_density(np.maximum(lengths, 1), values, self.block_size, self.anchor_blocks)
        return np.where(lengths > 0, dens, 1.0)  # padded slots: density 1 (as the d0 padding)

    def upper(self, max_lengths: np.ndarray) -> np.ndarray:
        """``(R,)`` per worker, the k past which its longest document gains nothing (every
        causal block kept), at least ``base`` and at most ``hi``."""
        blocks = np.ceil(np.asarray(max_lengths, dtype=np.float64) / self.block_size)
        k = np.maximum(blocks - self.anchor_blocks, self.base)
        return np.minimum(k, self.hi) if self.hi is not None else k

    def budget(self, template: Budget, value: float) -> Budget:
        return _with_value(template, "top-k", value)

    def note(self, lengths: np.ndarray) -> str:
        """One line for a run's start: the base budget and what it keeps of documents of these
        ``lengths`` (a budget covering every block of the longest one is exact attention: said,
        not hidden)."""
        longest = int(np.max(lengths)) if len(lengths) else 0
        median = int(np.median(lengths)) if len(lengths) else 0
        dens = self.density(np.asarray([longest, median]), 1.0, float(self.base))
        line = (
            f"budget: top-k {self.base * self.block_size:,} tokens = k {self.base} blocks of "
            f"{self.block_size} (+{self.anchor_blocks} anchors; DST cuts to k {self.lo}); "
            f"density at the base budget {dens[0]:.2f} for the longest document "
            f"({longest:,} tokens), {dens[1]:.2f} for the median one"
        )
        if dens[0] >= 1.0:
            line += ": the budget covers every document, attention is exact (lower --budget-tokens to make it sparse)"
        return line


Knob = GammaKnob | TopKKnob


def _with_value(template: Budget, kind: str, value: float) -> Budget:
    if template.kind == kind:
        return template.with_value(value)
    extra = dict(
        sink_blocks=template.sink_blocks,
        local_blocks=template.local_blocks,
        max_density=template.max_density,
        min_blocks=template.min_blocks,
    )
    if kind == "gamma":
        return Budget(gamma=float(value), **extra)
    return Budget(top_k=round(value), **extra)


def converged(knob: Knob, lo: np.ndarray, hi: np.ndarray, integer: bool = False) -> np.ndarray:
    """Bool: the bisection interval ``[lo, hi]`` cannot be split further (``integer``: the
    layer level's whole k; otherwise the step level's tolerance)."""
    if integer and knob.integer:
        return hi - lo <= 1.0
    return hi - lo <= (TOPK_TOL if knob.integer else GAMMA_TOL)


def midpoint(knob: Knob, lo: np.ndarray, hi: np.ndarray, integer: bool = False) -> np.ndarray:
    mid = 0.5 * (lo + hi)
    return np.floor(mid) if integer and knob.integer else mid


def search_many(
    knob: Knob,
    g: Callable[[np.ndarray, np.ndarray], np.ndarray],
    lo: np.ndarray,
    hi: np.ndarray,
    active: np.ndarray,
    largest: bool = True,
    *,
    tol: float | None = None,
) -> np.ndarray:
    """Per active entry, for ``g`` non-decreasing in the value: the largest ``v`` in ``[lo, hi]``
    with ``g(v) <= 0`` (``largest``), or the smallest with ``g(v) >= 0``. ``g(values (n,),
    sel bool (n,)) -> (n,)`` is evaluated only where ``sel``.

    Preconditions: ``g(lo) <= 0`` for ``largest`` (``g(hi) >= 0`` otherwise); the result is
    ``lo`` (``hi``) where not active. Only evaluated values on the feasible side are returned,
    so the result satisfies its condition even if ``g`` is not exactly monotone.

    Search: the bracket ``[a, b]`` (``a`` feasible for ``largest``) shrinks by false position with
    the Illinois modification (the retained end's value is halved when the same end stays twice,
    so both ends move), and by bisection whenever a step fails to halve the bracket; it stops at
    the knob's step-level tolerance. Predicted times and coverages are smooth in the budget, so
    this takes a handful of probes where bisection takes ~20. ``tol``: a coarser stop than the
    knob's step-level tolerance (the bracket's width), for searches that need less.
    """
    lo, hi = lo.astype(np.float64).copy(), hi.astype(np.float64).copy()
    result = (lo if largest else hi).copy()
    if not active.any():
        return result
    sign = 1.0 if largest else -1.0  # make the feasible end ``a`` the one with h <= 0
    a, b = (lo, hi) if largest else (hi, lo)
    hb = sign * g(b, active)
    done = active & (hb <= 0)  # the far end is feasible already
    result[done] = b[done]
    search = active & ~done
    if not search.any():
        return result
    ha = np.where(search, sign * g(a, search), 0.0)
    last = np.zeros(a.shape, dtype=np.int8)  # which end moved last: -1 a, +1 b
    width = np.abs(b - a)
    for _ in range(200):  # a safeguard; the tolerance stops it long before
        lo_ab, hi_ab = np.minimum(a, b), np.maximum(a, b)
        search &= ~(converged(knob, lo_ab, hi_ab) if tol is None else hi_ab - lo_ab <= tol)
        if not search.any():
            break
        c = _false_position(a, b, ha, hb)
        hc = np.where(search, sign * g(c, search), 0.0)
        feasible = hc <= 0
        move_a, move_b = search & feasible, search & ~feasible
        # Illinois: an end kept twice in a row has its value halved
        hb = np.where(move_a & (last == -1), 0.5 * hb, hb)
        ha = np.where(move_b & (last == 1), 0.5 * ha, ha)
        a, ha = np.where(move_a, c, a), np.where(move_a, hc, ha)
        b, hb = np.where(move_b, c, b), np.where(move_b, hc, hb)
        last = np.where(move_a, -1, np.where(move_b, 1, last)).astype(np.int8)
        new_width = np.abs(b - a)
        slow = search & (new_width > 0.5 * width)
        if slow.any():  # a bisection step on the entries that did not halve
            a, b, ha, hb, last = _bisect(g, sign, slow, a, b, ha, hb, last)
        width = np.abs(b - a)
    bracketed = active & ~done
    result[bracketed] = a[bracketed]
    return result


def _false_position(a: np.ndarray, b: np.ndarray, ha: np.ndarray, hb: np.ndarray) -> np.ndarray:
    """The secant's root between ``a`` and ``b`` (``h`` values ``ha``, ``hb``); the midpoint
    where it does not fall strictly inside the bracket."""
    denom = hb - ha
    t = np.where(denom > 0, -ha / np.where(denom > 0, denom, 1.0), 0.5)
    c = a + np.clip(t, 0.0, 1.0) * (b - a)
    bisect = ~((c - np.minimum(a, b) > 0) & (np.maximum(a, b) - c > 0))
    return np.where(bisect, 0.5 * (a + b), c)


def _bisect(g, sign: float, slow: np.ndarray, a, b, ha, hb, last):
    """One bisection step of :func:`search_many`'s brackets on the ``slow`` entries: the midpoint
    replaces the end on its side (feasible: ``a``); neither end counts as kept (Illinois)."""
    m = 0.5 * (a + b)
    hm = np.where(slow, sign * g(m, slow), 0.0)
    ok = slow & (hm <= 0)
    a, ha = np.where(ok, m, a), np.where(ok, hm, ha)
    b, hb = np.where(slow & ~ok, m, b), np.where(slow & ~ok, hm, hb)
    return a, b, ha, hb, np.where(slow, 0, last).astype(np.int8)


def search_one(knob: Knob, g: Callable[[float], float], lo: float, hi: float, largest: bool = True) -> float:
    """:func:`search_many` for one scalar (the per-rank reference)."""
    one = np.array([True])
    found = search_many(knob, lambda v, sel: np.array([g(float(v[0]))]), np.array([lo]), np.array([hi]), one, largest)
    return float(found[0])


def knob_from_tokens(
    base_tokens: int,
    block_size: int,
    min_tokens: int | None = None,
    max_tokens: int | None = None,
    anchor_blocks: int = 2,
) -> TopKKnob:
    """A :class:`TopKKnob` from budgets stated in tokens attended (``k x block size``), so a
    block-size change keeps the budget: ``k = tokens // block_size`` (at least 1 block for a
    positive budget). ``min_tokens`` defaults to a quarter of the base."""

    def blocks(tokens: int) -> int:
        return max(1, tokens // block_size) if tokens > 0 else 0

    base = blocks(base_tokens)
    lo = blocks(min_tokens) if min_tokens is not None else math.floor(base / 4)
    hi = None if max_tokens is None else blocks(max_tokens)
    return TopKKnob(base, min(lo, base), hi, block_size, anchor_blocks)
