"""Online recalibration: the latency model's (attention, rest) scale factors, tracked by an
extended Kalman filter that moves the *level* fast and the *split* between attention and the rest
slowly.

A micro-batch's prediction is ``theta_a * A + theta_r * R`` (attention, and everything that grows
with tokens: the rest of each layer and the head). Divided by the unscaled prediction ``A + R`` a
measurement reads ``y = theta_r + (theta_a - theta_r) a``, ``a = A / (A + R)`` the attention share.

Why two speeds. The level (both factors together) is what a loaded or drifting machine changes,
and every micro-batch measures it. The split is seen only through how ``a`` varies between
micro-batches, and on real packs ``a`` barely varies (0.19-0.27 on the held-out mix of issue 56):
a filter that moves both alike (the recursive least squares used before, forgetting 0.95, prior
0.5 on each factor) read timing noise as a split and swung ``theta_a / theta_r`` between 0.1 and
15 within a step. DST prices every cut and raise with that split, so its budgets became noise
(measured: DST on SAB 0.92-0.98x, ``benchmarks/dst_gain.py``). Here:

- the state is ``(log level, log ratio)`` with ``theta_r = level``, ``theta_a = level ratio``,
  and a measurement is read in logs, ``log y = log level + log(1 + (ratio - 1) a)``: the level's
  uncertainty and the split's are relative, so a profile 2.5x off (the level moves to 0.4) keeps
  the split as tight as one that is right; its prior is ``log level ~ N(log initial, 1)``,
  ``log ratio ~ N(0, (ln 2)^2)`` (a 2x split at one sigma, symmetric: attention 4x dearer or 4x
  cheaper are both two sigma), and between measurements the log level may drift by
  ``level_drift`` and the log ratio by ``split_drift`` (one sigma: the filter forgets old
  evidence in those proportions, never the prior);
- the measurement noise is the profile's own (timing CV and fit error, at least 5 %), in logs;
- an innovation beyond ``gate`` standard deviations of its predicted spread counts as that many
  (a burst of load moves the level, not the split, and never by more than the gate allows);
- the factors stay in ``[0.2, 5]`` and their ratio in ``[0.25, 4]``.

The split is learned when the data carry it: well-spread attention shares (the tests recover a
1.9x split within ~40 micro-batches), or DST's own cuts and raises, which spread the shares on
purpose. Until issue 56's second round the split's prior was 0.15 (in ``1 + skew``): a profile
whose attention was 4x off was still priced 1.1-1.4x off after 6 steps of DST, beyond the 2x its
raises are guarded for (:mod:`sparsebalance.tuning.skew`), and DST ended up to 2.8 % slower than
SAB alone by the true model (``tests/tuning/skew_loop.py``); with the wider prior the split
reaches 2.2-3.2x within those steps and DST is not slower from the third step on. The price: on
narrow shares, timing noise moves the split more (0.66-1.33 on issue 56's 192 held-out
micro-batches, against 0.92-1.05 with the old prior and 0.11-14.9 with the RLS), well within the
guard's margin.
"""

from __future__ import annotations

import numpy as np

_BOUNDS = (0.2, 5.0)
_RATIO = (0.25, 4.0)
SPLIT_STD = float(np.log(2.0))
"""Prior standard deviation of the log attention / rest ratio: a 2x split at one sigma."""
SPLIT_DRIFT = 0.003
"""How far the log ratio may move between two measurements (one sigma)."""


class ScaleFilter:
    """Extended Kalman filter of the (attention, rest) scale factors, in ``(log level, log
    ratio)`` (see the module docstring).

    Args:
        noise_std: relative noise of one measured micro-batch time (>= 0.05 is used).
        initial: starting ``(theta_a, theta_r)`` (1 = trust the profile as measured).
        level_std / split_std: prior standard deviations of the log level and of the log of the
            attention / rest ratio.
        level_drift / split_drift: how far each may move between two measurements (one sigma).
        gate: innovations are clipped at this many predicted standard deviations.
    """

    def __init__(
        self,
        noise_std: float = 0.05,
        initial=(1.0, 1.0),
        level_std: float = 1.0,
        split_std: float = SPLIT_STD,
        level_drift: float = 0.03,
        split_drift: float = SPLIT_DRIFT,
        gate: float = 3.0,
    ) -> None:
        if not noise_std > 0 or not level_std > 0 or not split_std > 0 or gate <= 0:
            raise ValueError("noise_std, level_std, split_std and gate must be > 0")
        if level_drift < 0 or split_drift < 0:
            raise ValueError("level_drift and split_drift must be >= 0")
        self.noise_var = max(float(noise_std), 0.05) ** 2
        self.initial = np.asarray(initial, dtype=float)
        if self.initial.shape != (2,) or np.any(self.initial <= 0):
            raise ValueError(f"initial must be two positive factors, got {initial}")
        self.gate = float(gate)
        self._prior = np.diag([level_std**2, split_std**2])
        self._drift = np.diag([level_drift**2, split_drift**2])
        self.state = self._state_of(self.initial)
        """``(log level, log(theta_a / theta_r))``."""
        self.cov = self._prior.copy()
        self.num_updates = 0

    @staticmethod
    def _state_of(theta: np.ndarray) -> np.ndarray:
        att, rest = ScaleFilter._bounded(np.asarray(theta, dtype=float))
        return np.array([np.log(rest), np.log(att / rest)])

    @property
    def theta(self) -> np.ndarray:
        """``(theta_a, theta_r)``: the attention and the rest factors."""
        level = float(np.exp(self.state[0]))
        return np.array([level * float(np.exp(self.state[1])), level])

    @property
    def split_std(self) -> float:
        """Standard deviation of the log attention / rest ratio: how far the split may still be
        off, as the filter sees it (the prior's until measurements with spread attention shares
        arrive)."""
        return float(np.sqrt(self.cov[1, 1]))

    def update(self, features: np.ndarray, measured: float) -> None:
        """Fold in one observation: ``measured ≈ theta · features`` (features: the unscaled
        attention and rest seconds of one micro-batch)."""
        x = np.asarray(features, dtype=float)
        base = float(x.sum())
        if not np.isfinite(measured) or measured <= 0 or base <= 0:
            raise ValueError(f"measured time must be finite and > 0, got {measured}")
        share = float(x[0]) / base
        ratio = float(np.exp(self.state[1]))
        mix = 1.0 + (ratio - 1.0) * share  # prediction / level, in units of the unscaled time
        cov = self.cov + self._drift
        h = np.array([1.0, share * ratio / mix])  # d log(prediction) / d state
        spread = float(h @ cov @ h) + self.noise_var
        innovation = float(np.log(measured / base) - self.state[0] - np.log(mix))
        limit = self.gate * np.sqrt(spread)
        innovation = float(np.clip(innovation, -limit, limit))
        gain = cov @ h / spread
        self.state = self._state_of_bounded(self.state + gain * innovation)
        self.cov = cov - np.outer(gain, h @ cov)
        self.num_updates += 1

    @staticmethod
    def _bounded(theta: np.ndarray) -> np.ndarray:
        att, rest = np.clip(theta, *_BOUNDS)
        att = float(np.clip(att, rest * _RATIO[0], rest * _RATIO[1]))
        return np.clip(np.array([att, rest]), *_BOUNDS)

    def _state_of_bounded(self, state: np.ndarray) -> np.ndarray:
        level = float(np.exp(state[0]))
        return self._state_of(np.array([level * float(np.exp(state[1])), level]))

    def state_dict(self) -> dict:
        return {
            "theta": self.theta.tolist(),
            "state": self.state.tolist(),
            "cov": self.cov.tolist(),
            "num_updates": self.num_updates,
            "filter": 4,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`. A state of an earlier filter keeps its factors: ``filter``
        3 (``(log level, skew)``, ``theta_a = level (1 + skew)``) also its uncertainty, carried
        to the log ratio (``d log ratio = d skew / (1 + skew)``), widened to this prior's
        split where it was narrower (its prior was 0.15); older ones (no ``filter`` key: the
        recursive least squares; ``filter`` 2: a linear Kalman filter) restart the uncertainty
        from the prior (their covariance meant something else)."""
        theta = np.asarray(state["theta"], float)
        if theta.shape != (2,):
            raise ValueError("calibration state has other dimensions than this latency model")
        kind = state.get("filter")
        if kind in (3, 4):
            own, cov = np.asarray(state["state"], float), np.asarray(state["cov"], float)
            if own.shape != (2,) or cov.shape != (2, 2):
                raise ValueError("calibration state has other dimensions than this latency model")
            if kind == 3:
                jac = np.diag([1.0, 1.0 / (1.0 + own[1])])
                own, cov = self._state_of(theta), jac @ cov @ jac.T
                cov[1, 1] = max(cov[1, 1], self._prior[1, 1])
        else:
            own, cov = self._state_of(theta), self._prior.copy()
        self.state, self.cov, self.num_updates = own, cov, int(state["num_updates"])
