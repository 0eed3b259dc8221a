"""The density-response curve: how a document's attention density moves with the budget gamma.

The planner only knows each document's estimated density ``d0`` at the default budget ``gamma0``.
To predict what another gamma costs, the tuner needs ``d(gamma; d0)``. The family used here is

    d(gamma; d0) = d0 ** e(gamma),    e(gamma) = ((1 - gamma) / (1 - gamma0)) ** alpha

with one exponent ``alpha`` below ``gamma0`` and one above it (both 1.0 by default, which gives
``d = d0 ** ((1 - gamma) / (1 - gamma0))``). Every member satisfies, for any ``d0`` in (0, 1]:

- ``d(gamma0) = d0`` and ``d(1) = 1`` (gamma 1.0 keeps every causal block);
- non-decreasing in gamma (``e`` is non-increasing and ``d0 <= 1``), strictly when ``d0 < 1``;
- stays in (0, 1] (floored at 1e-12); a sparser document (smaller ``d0``) never gets denser
  than a less sparse one at the same gamma.

The default is a prior, not a measurement: :meth:`DensityCurve.fit` estimates both exponents from
measured ``(gamma, density)`` pairs (for instance ``BlockMassEstimate.density`` at a few gammas),
least squares on ``log e``. The inverse, :meth:`DensityCurve.gamma_for`, gives the gamma that
reaches a target density, and :meth:`DensityCurve.d0_for` recovers ``d0`` from a density
measured at any gamma below 1 (the trainer's feedback into the density estimator). Everything is
vectorized numpy and broadcasts like ufuncs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

# Densities are clipped to this floor before taking logs (a density is never exactly 0).
_TINY = 1e-12


@dataclass(frozen=True)
class DensityCurve:
    """``d(gamma; d0) = d0 ** e(gamma)``; see the module docstring (validated on construction)."""

    gamma0: float = 0.9
    """The default budget at which the planner's densities ``d0`` were estimated, in (0, 1)."""
    alpha_low: float = 1.0
    """Shape exponent of ``e`` for ``gamma < gamma0`` (> 0; larger = density falls faster)."""
    alpha_high: float = 1.0
    """Shape exponent of ``e`` for ``gamma >= gamma0`` (> 0)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.gamma0) and 0.0 < self.gamma0 <= 1.0):
            raise ValueError(f"DensityCurve: gamma0 (--gamma0) must be in (0, 1], got {self.gamma0}")
        for name in ("alpha_low", "alpha_high"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0.0):
                raise ValueError(f"DensityCurve: {name} must be finite and > 0, got {value}")

    def exponent(self, gamma: ArrayLike) -> np.ndarray:
        """``e(gamma)``, float64, same shape as ``gamma`` (each in (0, 1])."""
        g = _check_gamma(gamma)
        # gamma = 1 keeps every block (exponent 0, density 1), also when gamma0 = 1 (dense runs).
        x = np.where(g >= 1.0, 0.0, (1.0 - g) / max(1.0 - self.gamma0, 1e-12))
        return np.where(g < self.gamma0, x**self.alpha_low, x**self.alpha_high)

    def density(self, d0: ArrayLike, gamma: ArrayLike) -> np.ndarray:
        """Density at ``gamma`` of documents whose density at ``gamma0`` is ``d0``.

        ``d0`` in (0, 1] and ``gamma`` in (0, 1] broadcast against each other; float64 result.
        """
        d0 = _check_density(d0, "d0")
        # Floored at 1e-12 so steep curves never underflow to a density of 0.
        return np.maximum(np.exp(self.exponent(gamma) * np.log(np.maximum(d0, _TINY))), _TINY)

    def gamma_for(self, d0: ArrayLike, target: ArrayLike) -> np.ndarray:
        """The smallest gamma in (0, 1] whose density reaches ``target`` (the inverse).

        Broadcasts like :meth:`density`. Targets below the density as gamma -> 0 map to a tiny
        positive gamma (the caller clips to its floor); a document with ``d0 == 1`` is dense at
        every gamma, so every target maps to that tiny gamma too.
        """
        d0 = _check_density(d0, "d0")
        target = _check_density(target, "target")
        log_d0 = np.log(np.maximum(d0, _TINY))
        log_t = np.log(np.maximum(target, _TINY))
        # e* = log(target) / log(d0); d0 == 1 leaves e* free: any gamma works, take e* = inf.
        with np.errstate(divide="ignore", invalid="ignore"):
            e_star = np.where(log_d0 < 0.0, log_t / np.where(log_d0 < 0.0, log_d0, -1.0), np.inf)
        alpha = np.where(e_star > 1.0, self.alpha_low, self.alpha_high)
        with np.errstate(over="ignore"):
            gamma = 1.0 - (1.0 - self.gamma0) * e_star ** (1.0 / alpha)
        return np.clip(gamma, _TINY, 1.0)

    def d0_for(self, density: ArrayLike, gamma: ArrayLike) -> np.ndarray:
        """The density at ``gamma0`` of documents measured at ``density`` under ``gamma``: the
        inverse of :meth:`density` in ``d0`` (``density ** (1 / e(gamma))``).

        ``density`` in (0, 1] and ``gamma`` in (0, 1) broadcast; float64 result in [1e-12, 1].
        ``gamma == 1`` keeps every block, so its density says nothing about ``d0``: ValueError.
        """
        density = _check_density(density, "density")
        g = _check_gamma(gamma)
        if np.any(g >= 1.0):
            raise ValueError("d0_for: gamma = 1 keeps every block and carries no density signal")
        return np.clip(density ** (1.0 / self.exponent(g)), _TINY, 1.0)

    @classmethod
    def fit(cls, gamma0: float, d0: ArrayLike, gamma: ArrayLike, density: ArrayLike) -> DensityCurve:
        """Fit ``alpha_low`` / ``alpha_high`` to measured points.

        Args:
            gamma0: the default budget.
            d0: ``(P,)`` each point's document density at ``gamma0``.
            gamma: ``(P,)`` the gamma of each measurement.
            density: ``(P,)`` the density measured at that gamma.

        Points that carry no information (``d0`` or ``density`` equal to 1 or at the 1e-12
        floor, ``gamma`` equal to ``gamma0`` or 1) are skipped; a side without usable points
        keeps exponent 1.0.
        """
        d0, g, d = (np.asarray(a, dtype=np.float64).ravel() for a in (d0, gamma, density))
        if not (d0.shape == g.shape == d.shape):
            raise ValueError(
                f"DensityCurve.fit: d0, gamma, density must have one shape, got {d0.shape}, {g.shape}, {d.shape}"
            )
        _check_density(d0, "d0")
        _check_density(d, "density")
        _check_gamma(g)
        alphas = []
        for side in (g < gamma0, g > gamma0):
            ok = side & (g < 1.0) & (d0 < 1.0) & (d < 1.0) & (d > _TINY)
            # log e = alpha * log((1 - g) / (1 - gamma0)): least squares through the origin.
            x = np.log((1.0 - g[ok]) / (1.0 - gamma0))
            y = np.log(np.log(d[ok]) / np.log(d0[ok]))
            den = float(x @ x)
            alpha = float(x @ y) / den if den > 0.0 else 1.0
            alphas.append(alpha if math.isfinite(alpha) and alpha > 0.0 else 1.0)
        return cls(gamma0=gamma0, alpha_low=alphas[0], alpha_high=alphas[1])


def _check_gamma(gamma: ArrayLike) -> np.ndarray:
    g = np.asarray(gamma, dtype=np.float64)
    if not np.all((g > 0.0) & (g <= 1.0)):
        raise ValueError(f"gamma must be in (0, 1], got values in [{g.min()}, {g.max()}]")
    return g


def _check_density(d: ArrayLike, name: str) -> np.ndarray:
    d = np.asarray(d, dtype=np.float64)
    if not np.all((d > 0.0) & (d <= 1.0)):
        raise ValueError(f"{name} must be densities in (0, 1], got values in [{d.min()}, {d.max()}]")
    return d
