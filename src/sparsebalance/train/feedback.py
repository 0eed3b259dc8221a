"""The step's last stage: measured micro-batches recalibrate the latency model and teach the
density estimator (in rank order, so every rank's models stay identical)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import numpy as np

from ..batching import HistoryEstimator
from ..latency import LatencyModel
from ..tuning import DensityCurve
from ..workload import Sample
from .records import StepFeedback

# Measured densities are floored here before the curve's inverse (a density is never 0).
_DENSITY_FLOOR = 1e-6


def apply_feedback(
    feedback: StepFeedback,
    latency: LatencyModel,
    estimator: HistoryEstimator,
    curve: DensityCurve,
    sample: Callable[[int], Sample],
    use_timings: bool = True,
) -> None:
    """Fold a step's measurements in.

    Args:
        feedback: every rank's micro-batches, in rank order.
        latency: recalibrated with each micro-batch's measured seconds (when ``use_timings``).
        estimator: observes each document's density at ``gamma0``, recovered from every layer
            that ran below gamma 1 (:meth:`DensityCurve.d0_for`), averaged over its chunks.
        curve: the tuner's density curve.
        sample: sample id -> :class:`Sample` (length and source, for the estimator).
        use_timings: ``False`` with ``--deterministic``: no timing enters any decision.
    """
    by_sample: dict[int, list[float]] = defaultdict(list)
    for mb in feedback.microbatches:
        if use_timings and mb.seconds > 0:
            latency.update(list(mb.lengths), np.asarray(mb.layer_densities), mb.seconds)
        dens = np.clip(np.asarray(mb.layer_densities), _DENSITY_FLOOR, 1.0)  # (layers, N)
        g = np.asarray(mb.gammas)
        informative = g < 1.0  # at gamma = 1 every block is kept: no density signal
        if not informative.any():
            continue
        d0 = curve.d0_for(dens[informative], g[informative][:, None])  # (layers', N)
        d0 = np.clip(d0, _DENSITY_FLOOR, 1.0).mean(0)
        for sid, d in zip(mb.sample_ids, d0, strict=True):
            by_sample[sid].append(float(d))
    if by_sample:
        ids = sorted(by_sample)
        estimator.observe([sample(i) for i in ids], [float(np.mean(by_sample[i])) for i in ids])
