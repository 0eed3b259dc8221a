"""Online recalibration: per-component scale factors fitted by recursive least squares.

A micro-batch's prediction is ``s_attn * A + s_other * O + s_head * H`` (the three profiled
components). Each measured time updates ``s`` by RLS on the *relative* error (features and target
divided by the unscaled prediction), with a forgetting factor so a drifting machine is tracked and
a covariance cap so directions that are never excited do not wind up.
"""

from __future__ import annotations

import numpy as np


class RecursiveScales:
    """RLS estimate of component scale factors, starting at ``initial`` (the profile's own
    end-to-end calibration; 1 = trust the tables as measured)."""

    def __init__(
        self,
        num: int = 3,
        forgetting: float = 0.95,
        prior_std: float = 0.5,
        noise_std: float = 0.05,
        initial=None,
    ) -> None:
        """``prior_std``: how far from 1 the scales may plausibly be; ``noise_std``: relative
        noise of one measured time. Their ratio sets how much one measurement moves the scales."""
        if not 0.5 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0.5, 1], got {forgetting}")
        if prior_std <= 0 or noise_std <= 0:
            raise ValueError("prior_std and noise_std must be > 0")
        self.forgetting = forgetting
        self.noise_var = noise_std**2
        self.initial = np.ones(num) if initial is None else np.asarray(initial, dtype=float)
        self.theta = self.initial.copy()
        self.p0 = np.eye(num) * prior_std**2
        self.cov = self.p0.copy()
        self.num_updates = 0

    def update(self, features: np.ndarray, measured: float) -> None:
        """Fold in one observation: ``measured ≈ theta · features``."""
        x = np.asarray(features, dtype=float)
        base = float(x.sum())
        if not np.isfinite(measured) or measured <= 0 or base <= 0:
            raise ValueError(f"measured time must be finite and > 0, got {measured}")
        x, y = x / base, measured / base
        px = self.cov @ x
        gain = px / (self.forgetting * self.noise_var + float(x @ px))
        # A machine is rarely 5x off its profile; the bounds keep a burst of noise from
        # carrying the scales somewhere absurd.
        self.theta = np.clip(self.theta + gain * (y - float(x @ self.theta)), 0.2, 5.0)
        self.cov = (self.cov - np.outer(gain, px)) / self.forgetting
        cap = np.trace(self.p0)
        if np.trace(self.cov) > cap:
            self.cov *= cap / np.trace(self.cov)
        self.num_updates += 1

    def state_dict(self) -> dict:
        return {
            "theta": self.theta.tolist(),
            "cov": self.cov.tolist(),
            "num_updates": self.num_updates,
        }

    def load_state_dict(self, state: dict) -> None:
        theta, cov = np.asarray(state["theta"], float), np.asarray(state["cov"], float)
        if theta.shape != self.theta.shape or cov.shape != self.cov.shape:
            raise ValueError("calibration state has other dimensions than this latency model")
        self.theta, self.cov, self.num_updates = theta, cov, int(state["num_updates"])
