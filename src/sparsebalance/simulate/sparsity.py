"""Per-document attention density at the default budget ``gamma0`` for simulated batches.

Default model (``--density-model powerlaw``), for a document of L tokens and block size B:

    d0(L) = clip(max(a * (L / 4096) ** -beta * exp(sigma * z), floor(L)), 0, 1),   z ~ N(0, 1)

- ``a = 0.3`` (``--density-at-4k``): density at 4K tokens and gamma0 = 0.9;
- ``beta = 0.5`` (``--density-slope``): longer documents are sparser (the kept mass concentrates
  on fewer blocks while causal pairs grow as L^2);
- ``sigma = 0.5`` (``--density-noise``): per-document spread at a fixed length (content: code and
  retrieval-heavy text need more blocks than prose); a log-normal factor, so the ratio between
  the 84th and 16th percentile at one length is about e = 2.7x;
- ``floor(L) = min(1, 4 / (n + 1))`` with ``n = ceil(L / B)`` blocks: the sink and local blocks
  kept for every query block (2 of the ``(n + 1) / 2`` causal blocks a query block sees on
  average), so short documents are nearly dense whatever the content.

**Where the numbers come from, plainly**: the shape (density falling with length, a wide content
spread) is what published threshold / top-p sparse-attention methods report for long contexts at
gamma about 0.9 (densities of tens of percent at a few K tokens, a few percent at 100K+). The
three constants are our assumption, chosen inside that range; they are not a fit to measured
data. Measured densities (``estimate_block_mass(...).density`` at ``gamma0`` for real samples)
can be given instead, paired with their lengths in the ``--lengths`` JSON file.

How a document's density moves with the budget is the tuner's knob: under gamma the
:class:`~sparsebalance.tuning.DensityCurve` (``d = d0 ** e(gamma)``), whose exponent makes each
document's sensitivity depend on its own ``d0``; under top-k the length alone
(:func:`~sparsebalance.ops.topk_density`).

Coverage (:class:`CoverageModel`, what DST's coverage bound reads in simulation): the gate mass a
document keeps at density ``d`` is ``C(d) = d ** s`` with ``s = log(gamma0) / log(d0)`` clipped to
``[0.05, 1]``, so that ``C(d0) = gamma0`` (the threshold rule's definition of ``d0``) and ``C(1) =
1``; concave, since a gate keeps its best blocks first. A concentrated document (small ``d0``)
keeps most of its mass when cut (insensitive); a spread one (``d0`` near ``gamma0``) loses mass in
proportion (sensitive). This is a model of our own, as assumed as ``d0`` itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import flags

# Densities never reach 0: a document keeps at least its anchor blocks.
_MIN_DENSITY = 1e-3


@dataclass(frozen=True)
class SparsityModel:
    """Draws ``d0`` (density at gamma0) per document (validated; CLI flags in brackets)."""

    density_at_4k: float = 0.3
    """[--density-at-4k] median density of a 4,096-token document at gamma0, in (0, 1]."""
    slope: float = 0.5
    """[--density-slope] beta: ``d0`` scales as ``L ** -beta`` (>= 0)."""
    noise: float = 0.5
    """[--density-noise] sigma of the per-document log-normal factor (>= 0)."""

    def __post_init__(self) -> None:
        flags.check_fields(self)  # types first (the Python API): one line naming the field
        if not (math.isfinite(self.density_at_4k) and 0.0 < self.density_at_4k <= 1.0):
            raise ValueError(f"--density-at-4k must be in (0, 1], got {self.density_at_4k}")
        if not (math.isfinite(self.slope) and self.slope >= 0.0):
            raise ValueError(f"--density-slope must be >= 0, got {self.slope}")
        if not (math.isfinite(self.noise) and self.noise >= 0.0):
            raise ValueError(f"--density-noise must be >= 0, got {self.noise}")

    def floor(self, lengths: np.ndarray, block_size: int) -> np.ndarray:
        """``(N,)`` the anchor-block density floor ``min(1, 4 / (n + 1))``, n = blocks of
        ``block_size`` tokens (the simulated kernel's, :attr:`SimConfig.block_size`)."""
        if block_size < 1:
            raise ValueError(f"block size must be >= 1, got {block_size}")
        n = np.ceil(np.asarray(lengths, dtype=np.float64) / block_size)
        return np.minimum(1.0, 4.0 / (n + 1.0))

    def median(self, lengths: np.ndarray, block_size: int) -> np.ndarray:
        """``(N,)`` the density without noise (the median at each length)."""
        lengths = np.asarray(lengths, dtype=np.float64)
        body = self.density_at_4k * (lengths / 4096.0) ** -self.slope
        return np.clip(np.maximum(body, self.floor(lengths, block_size)), _MIN_DENSITY, 1.0)

    def sample(self, rng: np.random.Generator, lengths: np.ndarray, block_size: int) -> np.ndarray:
        """``(N,)`` float64 densities in (0, 1] for documents of these lengths."""
        lengths = np.asarray(lengths, dtype=np.float64)
        body = self.density_at_4k * (lengths / 4096.0) ** -self.slope
        body = body * np.exp(self.noise * rng.standard_normal(lengths.shape))
        return np.clip(np.maximum(body, self.floor(lengths, block_size)), _MIN_DENSITY, 1.0)

    def describe(self, block_size: int) -> str:
        return (
            f"d0 = {self.density_at_4k:g} (L/4096)^-{self.slope:g} x lognormal({self.noise:g}), "
            f"floor 4/(blocks+1), block {block_size}"
        )


@dataclass(frozen=True)
class CoverageModel:
    """Simulated gate coverage per document: ``C = density ** s(d0)`` (see the module docstring).

    ``density(lengths, d0, values)`` is the knob's density response (top-k: from the length;
    gamma: the curve); ``d0`` is the document's density at ``gamma0`` (its content)."""

    density: object
    """The knob's ``density(lengths, d0, values)`` (elementwise)."""
    gamma0: float = 0.9
    """The mass a document covers at its density ``d0``."""

    def exponent(self, d0: np.ndarray) -> np.ndarray:
        d0 = np.clip(np.asarray(d0, dtype=np.float64), _MIN_DENSITY, 1.0 - 1e-9)
        return np.clip(np.log(self.gamma0) / np.log(d0), 0.05, 1.0)

    def document_coverage(self, lengths: np.ndarray, d0: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Elementwise coverage in (0, 1] of documents ``(lengths, d0)`` at budget ``values``."""
        dens = self.density(lengths, d0, values)
        return np.clip(dens, _MIN_DENSITY, 1.0) ** self.exponent(d0)
