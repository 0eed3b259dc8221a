"""The closed loop per pipeline stage (``--pp P``): the stages' measured forward and backward
seconds teach the planner and DST how a micro-batch's predicted time splits over the stages.

The pricing (:func:`~sparsebalance.batching.schedule.layered_makespans`) spreads a micro-batch's
predicted seconds over the stages by their layers, the LM head's term on the last stage, and
splits each stage's share into forward and backward at a ratio. What it assumes there (layers
cost alike, backward = 2 x forward) is measured here, from a step's micro-batch records
(:attr:`~.records.MicroBatchResult.stage_seconds`, summed over the step's micro-batches):

- ``ratio``: the step's backward seconds over its forward seconds;
- ``weight_share`` (zero bubble, ``--pp-schedule zb-h1``, whose stages also measure their W's):
  the step's W seconds over its backward (B + W) seconds, clamped to :data:`SHARE_BOUNDS`;
- ``scales[s]``: stage s's share of the measured seconds over its share of the predicted ones
  (the latency model's prediction at the densities that ran, each document's mean over the
  layers, spread as the pricing spreads it). Shares, not seconds: the latency model is already
  recalibrated with the same micro-batches' whole seconds (:func:`.feedback.apply_feedback`);
  scales of seconds would correct that whole-model error a second time. The scales move only
  the split: after averaging they are renormalised so that the step's predicted stage seconds
  times the scales sum to its predicted seconds.

Each step's values are clamped (:data:`SCALE_BOUNDS`, :data:`RATIO_BOUNDS`) and folded into an
exponential moving average of their logarithms (weight :data:`SMOOTHING`), so one outlier step
moves a value by at most ``4 ** 0.3 ~ 1.5x``. The start is the identity (ratio
:data:`~sparsebalance.batching.schedule.BACKWARD_RATIO`, scales 1): until a step was measured,
plans are priced exactly as without this loop. The records are every rank's, gathered in rank
order after the step (:class:`~.records.StepFeedback`), and the arithmetic is float64 in that
order: every rank learns the same values without a message.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..batching.schedule import BACKWARD_RATIO, head_seconds, spread_stages
from ..batching.zero_bubble import WEIGHT_SHARE
from ..workload import CostModel
from .records import MicroBatchResult

SMOOTHING = 0.3
"""Weight of a step's measured values in the moving average (of logarithms)."""
SCALE_BOUNDS = (0.25, 4.0)
"""A step's stage scale is clamped to this range before it is averaged in."""
RATIO_BOUNDS = (0.25, 8.0)
"""A step's backward : forward ratio is clamped to this range before it is averaged in."""
SHARE_BOUNDS = (0.02, 0.9)
"""A step's W share of the backward is clamped to this range before it is averaged in."""


def predicted_stage_seconds(
    cost_model: CostModel, microbatches: Sequence[MicroBatchResult], layers: np.ndarray
) -> np.ndarray:
    """``(M, P)`` the pricing's seconds of each micro-batch on each stage: ``predict_many`` at
    its documents' densities (the mean over layers of what ran), the head term
    (:func:`~sparsebalance.batching.schedule.head_seconds`) on the last stage, the rest spread by
    ``layers`` (int ``(P,)``)."""
    width = max(len(mb.lengths) for mb in microbatches)
    lengths = np.zeros((len(microbatches), width), dtype=np.int64)
    dens = np.ones((len(microbatches), width))
    for i, mb in enumerate(microbatches):
        lengths[i, : len(mb.lengths)] = mb.lengths
        if mb.layer_densities:
            dens[i, : len(mb.lengths)] = np.asarray(mb.layer_densities, dtype=np.float64).mean(axis=0)
    totals = np.asarray(cost_model.predict_many(lengths, dens), dtype=np.float64)
    return spread_stages(totals, head_seconds(cost_model, lengths, dens, totals), layers)


class StageCalibration:
    """The learned pricing of a pipeline of ``num_stages`` stages (see the module docstring);
    starts at the identity."""

    def __init__(self, num_stages: int) -> None:
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"StageCalibration: num_stages must be an integer >= 1, got {num_stages!r}")
        self.num_stages = num_stages
        self.ratio = BACKWARD_RATIO
        """Backward seconds per forward second (``PlanConfig.backward_ratio``)."""
        self.scales = np.ones(num_stages)
        """``(P,)`` each stage's time scale (``PlanConfig.stage_scales``)."""
        self.weight_share = WEIGHT_SHARE
        """Zero bubble: W's share of a stage's backward (``PlanConfig.weight_share``)."""
        self.steps = 0
        """Steps whose measurements were folded in (0: the identity)."""

    def pricing(self) -> dict:
        """What the planner's and DST's pipeline pricing take: ``{"backward_ratio": float,
        "stage_scales": (P,) tuple, "weight_share": float}`` (:class:`~sparsebalance.batching.
        PlanConfig`'s fields)."""
        return {
            "backward_ratio": float(self.ratio),
            "stage_scales": tuple(float(x) for x in self.scales),
            "weight_share": float(self.weight_share),
        }

    def observe(self, microbatches: Sequence[MicroBatchResult], cost_model: CostModel, layers: np.ndarray) -> bool:
        """Fold in one step's measured micro-batches (every rank's, rank order); those without
        one (forward, backward) pair per stage are left out. Returns whether anything was
        learned (False: nothing measured, or a stage or direction measured or predicted at 0 s
        or not finite)."""
        mbs = [mb for mb in microbatches if len(mb.stage_seconds) == self.num_stages]
        if not mbs or len({len(fb) for mb in mbs for fb in mb.stage_seconds}) != 1:
            return False
        measured = np.asarray([mb.stage_seconds for mb in mbs], dtype=np.float64)  # (M, P, 2 or 3)
        weights = measured[..., 2].sum() if measured.shape[-1] == 3 else None  # zero bubble's W's
        measured = measured[..., :2]
        predicted = predicted_stage_seconds(cost_model, mbs, layers).sum(axis=0)  # (P,)
        forward, backward = measured.sum(axis=(0, 1))
        per_stage = measured.sum(axis=(0, 2))  # (P,)
        finite = np.all(np.isfinite(measured)) and np.all(np.isfinite(predicted))
        if not (finite and forward > 0 and backward > 0 and np.all(per_stage > 0) and np.all(predicted > 0)):
            return False
        ratio = np.clip(backward / forward, *RATIO_BOUNDS)
        share = predicted / predicted.sum()
        scales = np.clip((per_stage / per_stage.sum()) / share, *SCALE_BOUNDS)
        self.ratio = float(_average(np.float64(self.ratio), ratio))
        if weights is not None and np.isfinite(weights) and weights > 0:
            w_share = np.clip(weights / backward, *SHARE_BOUNDS)
            self.weight_share = float(_average(np.float64(self.weight_share), w_share))
        averaged = _average(self.scales, scales)
        # renormalised on this step's shares: the average of logarithms (and the clamp) would
        # otherwise also scale a micro-batch's total, which the latency model already corrects
        self.scales = averaged / float(share @ averaged)
        self.steps += 1
        return True

    def state_dict(self) -> dict:
        """JSON-ready: the ratio, the scales, zero bubble's W share and the steps learned from."""
        return {
            "ratio": float(self.ratio),
            "scales": [float(x) for x in self.scales],
            "weight_share": float(self.weight_share),
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict | None) -> None:
        """Restore :meth:`state_dict`; None (a checkpoint from before this loop): the identity."""
        if state is None:
            self.ratio, self.scales, self.steps = BACKWARD_RATIO, np.ones(self.num_stages), 0
            self.weight_share = WEIGHT_SHARE
            return
        ratio, scales = float(state["ratio"]), np.asarray(state["scales"], dtype=np.float64)
        if scales.shape != (self.num_stages,):
            raise ValueError(
                f"--resume: the checkpoint's stage calibration has {scales.size} stages, this run {self.num_stages}"
            )
        if not (np.isfinite(ratio) and ratio > 0 and np.all(np.isfinite(scales)) and np.all(scales > 0)):
            raise ValueError(f"--resume: the checkpoint's stage calibration is not finite and > 0: {state}")
        share = float(state.get("weight_share", WEIGHT_SHARE))  # absent: a checkpoint from before zero bubble
        if not (np.isfinite(share) and 0 <= share < 1):
            raise ValueError(f"--resume: the checkpoint's stage calibration has a W share outside [0, 1): {state}")
        self.ratio, self.scales, self.steps, self.weight_share = ratio, scales, int(state["steps"]), share


def _average(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """The moving average of logarithms: ``old^(1 - w) x new^w`` (w = :data:`SMOOTHING`)."""
    return np.exp((1.0 - SMOOTHING) * np.log(old) + SMOOTHING * np.log(new))
