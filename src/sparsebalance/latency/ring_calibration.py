"""Online recalibration of the multi-rank terms of a :class:`~sparsebalance.latency.context.
ContextCost` from measured context-parallel (CP) units.

A CP unit of one document (L tokens, density d) on k ranks is modelled per rank as (see
:mod:`.context`) ``t = s_c (c0 + rest / k) + layers * ring(s_c * attn * imb / k, s_x * x)``:
three terms the base latency model does not know and that a profile of one device cannot
measure:

- ``s_c`` (``compute_scale``): measured / modelled compute of a shard (a striped shard is not a
  profiled micro-batch: other block shapes, the ring's per-step kernel calls);
- ``imb`` (``imbalance["flat" | "hierarchical"]``): the slowest rank's attention over the mean
  (the striped placement's residual imbalance);
- ``s_x`` (``comm_scale``): measured / modelled transfer time (ring K/V steps and the selection
  all-gather; a CPU gloo ring runs far below the analytic NVLink figures).

One measurement (:class:`UnitTiming`) gives targets, in this order:

1. with per-rank compute (each rank's seconds minus its wait inside the ring, the ring's
   telemetry): ``s_c = mean_r compute_r / (fixed + attention)`` and
   ``imb = (max_r compute_r - s_c fixed) / (mean_r compute_r - s_c fixed)`` (>= 1), with
   ``(fixed, attention)`` from :meth:`ContextCost.unit_terms`; without it both are left alone;
2. ``s_x``: the transfer scale at which the model reproduces the measured unit time, found on a
   log grid. Where the transfers are hidden behind compute the time does not depend on ``s_x``
   over a range: the current value is kept if it lies in that range, else the nearest end is the
   target (a model that is right is never moved; a measured time below what even free transfers
   give says nothing about ``s_x``: it is kept).

Each parameter then moves toward its target in log space with gain ``max(1 / n, min_gain)``
(n = its number of updates: the first measurement replaces the prior, later ones average, and a
floor keeps tracking a drifting machine). Every rank folds in the same measurements in the same
order, so the calibrated cost stays identical on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Plausible ranges: a measured/modelled ratio outside them is a broken measurement, not a machine.
COMPUTE_RANGE = (0.1, 10.0)
COMM_RANGE = (1e-3, 1e4)
IMBALANCE_RANGE = (1.0, 4.0)
_GRID = np.geomspace(*COMM_RANGE, 281)  # 40 points per decade
_REL_TOL = 0.01  # a modelled time within 1 % of the measurement reproduces it


@dataclass(frozen=True)
class UnitTiming:
    """One measured CP unit: one document run on ``degree`` ranks."""

    length: int
    """L, the document's (or ``--overlong`` chunk's) tokens over all ranks of the unit."""
    density: float
    """Its attention density at the budget it ran with (mean over layers), in (0, 1]."""
    degree: int
    """k >= 2."""
    seconds: float
    """The unit's time: from when its last rank arrived to when its last rank finished."""
    rank_compute: tuple[float, ...] = ()
    """``(k,)`` each rank's seconds in the unit minus its wait inside the ring; ``()`` when the
    ring's waits were not measured."""

    def __post_init__(self) -> None:
        if self.degree < 2:
            raise ValueError(f"UnitTiming: degree must be >= 2, got {self.degree}")
        if self.length < 1 or not 0.0 < self.density <= 1.0:
            raise ValueError(f"UnitTiming: need length >= 1 and density in (0, 1], got {self.length}, {self.density}")
        if not (np.isfinite(self.seconds) and self.seconds > 0):
            raise ValueError(f"UnitTiming: seconds must be finite and > 0, got {self.seconds}")
        if self.rank_compute and len(self.rank_compute) != self.degree:
            raise ValueError("UnitTiming: rank_compute needs one entry per rank of the unit")


class RingCalibration:
    """Update counts and the update rule of a :class:`ContextCost`'s multi-rank terms (the
    terms themselves live on the cost, so every prediction reads them)."""

    def __init__(self, min_gain: float = 0.1) -> None:
        if not 0.0 < min_gain <= 1.0:
            raise ValueError(f"min_gain must be in (0, 1], got {min_gain}")
        self.min_gain = min_gain
        self.counts = {"compute": 0, "comm": 0, "flat": 0, "hierarchical": 0}

    def _move(self, key: str, current: float, target: float, bounds: tuple[float, float]) -> float:
        self.counts[key] += 1
        gain = max(1.0 / self.counts[key], self.min_gain)
        lo, hi = bounds
        target = min(max(target, lo), hi)
        return float(np.exp((1 - gain) * np.log(current) + gain * np.log(target)))

    def update(self, cost, t: UnitTiming) -> dict:
        """Move ``cost``'s terms toward what ``t`` implies; returns the targets (JSON-ready)."""
        kind, _ = cost.ring_of(t.degree)
        targets: dict = {"ring": kind}
        if t.rank_compute:
            fixed, attention = cost.unit_terms(t.length, t.density, t.degree)
            comp = np.asarray(t.rank_compute, dtype=np.float64)
            mean, peak = float(comp.mean()), float(comp.max())
            if mean > 0 and fixed + attention > 0:
                sc = mean / (fixed + attention)
                cost.compute_scale = self._move("compute", cost.compute_scale, sc, COMPUTE_RANGE)
                targets["compute_scale"] = sc
                base = cost.compute_scale * fixed
                if mean - base > 0:
                    imb = max((peak - base) / (mean - base), 1.0)
                    cost.imbalance[kind] = self._move(kind, cost.imbalance[kind], imb, IMBALANCE_RANGE)
                    targets["imbalance"] = imb
        times = cost.probe(t.length, t.density, t.degree, _GRID)  # non-decreasing in s_x
        sx = _comm_target(times, t.seconds, cost.comm_scale)
        cost.comm_scale = self._move("comm", cost.comm_scale, sx, COMM_RANGE)
        targets["comm_scale"] = sx
        return targets

    def state_dict(self, cost) -> dict:
        return {
            "compute_scale": cost.compute_scale,
            "comm_scale": cost.comm_scale,
            "imbalance": dict(cost.imbalance),
            "counts": dict(self.counts),
        }

    def load_state_dict(self, cost, state: dict) -> None:
        if set(state.get("imbalance", {})) != set(cost.imbalance):
            raise ValueError("ring calibration state has other ring kinds than this cost model")
        cost.compute_scale = float(state["compute_scale"])
        cost.comm_scale = float(state["comm_scale"])
        cost.imbalance = {k: float(v) for k, v in state["imbalance"].items()}
        self.counts = {k: int(v) for k, v in state["counts"].items()}


def _comm_target(times: np.ndarray, measured: float, current: float) -> float:
    """The transfer scale on :data:`_GRID` whose modelled time (``times``, ``(S,)``
    non-decreasing) reproduces ``measured``; ``current`` when it already does (hidden
    transfers: a flat range of ``times``)."""
    ok = np.abs(times / measured - 1.0) <= _REL_TOL
    if ok.any():
        lo, hi = _GRID[ok].min(), _GRID[ok].max()
        return float(min(max(current, lo), hi))
    above = np.nonzero(times > measured)[0]
    if above.size == 0:  # even the slowest transfers are too fast: the grid's ceiling
        return float(_GRID[-1])
    i = int(above[0])
    if i == 0:  # even free transfers are too slow: compute is over-predicted, comm unknown
        return float(current)
    # interpolate in log space between the last grid point below and the first above
    t0, t1 = times[i - 1], times[i]
    w = (measured - t0) / (t1 - t0) if t1 > t0 else 0.0
    return float(np.exp(np.log(_GRID[i - 1]) + w * (np.log(_GRID[i]) - np.log(_GRID[i - 1]))))
