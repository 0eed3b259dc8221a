"""The step's last stage: measured micro-batches recalibrate the latency model and teach the
density estimator (in rank order, so every rank's models stay identical).

One-rank micro-batches recalibrate the base :class:`~sparsebalance.latency.LatencyModel`;
context-parallel units (k > 1 ranks) recalibrate the multi-rank terms of the
:class:`~sparsebalance.latency.context.ContextCost` the plans are priced with (shard compute,
ring imbalance, transfer scale: :mod:`sparsebalance.latency.ring_calibration`), one
:class:`~sparsebalance.latency.ring_calibration.UnitTiming` per unit from its ranks' records."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import numpy as np

from ..batching import DensityEstimator
from ..latency import LatencyModel
from ..latency.ring_calibration import UnitTiming
from ..tuning import Knob
from ..workload import Sample
from .records import MicroBatchResult, StepFeedback

# Measured densities are floored here before the curve's inverse (a density is never 0).
_DENSITY_FLOOR = 1e-6


def apply_feedback(
    feedback: StepFeedback,
    latency: LatencyModel,
    estimator: DensityEstimator,
    knob: Knob,
    sample: Callable[[int], Sample],
    use_timings: bool = True,
    context=None,
) -> None:
    """Fold a step's measurements in.

    Args:
        feedback: every rank's micro-batches, in rank order.
        latency: recalibrated with each one-rank micro-batch's measured seconds (when
            ``use_timings``); CP units' times are not fed to it.
        estimator: observes each document's density and final budget, averaged over layers and
            over its chunks. Under gamma the density is the one at ``gamma0``, recovered from
            every layer that ran below gamma 1 (:meth:`DensityCurve.d0_for`); under top-k it is
            the realized density (what the document costs at the budget it ended with).
        knob: the tuner's budget knob (its curve, for gamma).
        sample: sample id -> :class:`Sample` (length and source, for the estimator).
        use_timings: ``False`` with ``--deterministic``: no timing enters any decision.
        context: the ``ContextCost`` over ``latency`` that prices CP units (``--strategy
            sab-cp``): each measured CP unit recalibrates its multi-rank terms. CP units never
            update ``latency`` itself (a rank's shard is not a profiled micro-batch).
    """
    by_sample: dict[int, list[tuple[float, float]]] = defaultdict(list)
    if use_timings and context is not None:
        for timing in unit_timings(feedback.microbatches):
            context.update(timing)
    units_seen = set()
    for mb in feedback.microbatches:
        if mb.degree > 1:  # a CP unit: each of its ranks reports the same (global) densities
            key = (mb.unit_ranks, mb.sample_ids)
            if key in units_seen:
                continue
            units_seen.add(key)
        elif use_timings and mb.seconds > 0:
            latency.update(list(mb.lengths), np.asarray(mb.layer_densities), mb.seconds)
        dens = np.clip(np.asarray(mb.layer_densities), _DENSITY_FLOOR, 1.0)  # (layers, N)
        values = np.asarray(mb.budgets)
        if knob.kind == "gamma":
            informative = values < 1.0  # at gamma = 1 every block is kept: no density signal
            if not informative.any():
                continue
            d0 = knob.curve.d0_for(dens[informative], values[informative][:, None])
            dens = np.clip(d0, _DENSITY_FLOOR, 1.0)  # (layers', N)
        if dens.size == 0:
            continue
        for sid, d in zip(mb.sample_ids, dens.mean(0), strict=True):
            by_sample[sid].append((float(d), float(values.mean())))
    if by_sample:
        ids = sorted(by_sample)
        pairs = [np.mean(by_sample[i], axis=0) for i in ids]
        estimator.observe([sample(i) for i in ids], [float(p[0]) for p in pairs], budgets=[float(p[1]) for p in pairs])


def unit_timings(microbatches: tuple[MicroBatchResult, ...]) -> list[UnitTiming]:
    """One :class:`UnitTiming` per CP unit (k > 1) of a step, in slot order, from the records of
    its k ranks (every rank's, as :class:`StepFeedback` holds them).

    The unit's time runs from its last rank's arrival to its last rank's end (``start_s``
    stamps), or without stamps is the last-arriving rank's seconds (the smallest: the others'
    include their wait for it). Per-rank compute (seconds minus the wait inside the ring) is
    given only where the ring measured waits. Units of several documents, or whose k records are
    not all there, carry no single-document timing and are left out.
    """
    groups: dict[tuple[int, tuple[int, ...]], list[MicroBatchResult]] = defaultdict(list)
    for mb in microbatches:
        if mb.degree > 1:
            groups[mb.slot, mb.unit_ranks].append(mb)
    out = []
    for (_, ranks), parts in sorted(groups.items()):
        first = parts[0]
        if len(parts) != len(ranks) or len(first.lengths) != 1:
            continue
        if all(p.start_s is not None for p in parts):
            start = max(p.start_s for p in parts)
            seconds = max(p.start_s + p.seconds for p in parts) - start
        else:
            seconds = min(p.seconds for p in parts)
        waits = [p.ring_wait_s for p in parts]
        compute = tuple(p.seconds - w for p, w in zip(parts, waits, strict=True))
        measured = any(w > 0 for w in waits) and min(compute) > 0
        density = float(np.clip(np.mean(np.asarray(first.layer_densities)), _DENSITY_FLOOR, 1.0))
        if seconds > 0:
            out.append(
                UnitTiming(int(first.lengths[0]), density, len(ranks), float(seconds), compute if measured else ())
            )
    return out
