"""The attention budget: what each query block may attend to, as top-k blocks or as a mass.

Two kinds, exactly one per :class:`Budget`:

- ``top_k`` (MoBA, the SparseBalance paper's budget): each query block keeps the ``top_k`` causal
  key blocks its gate ranks highest, on top of the always-kept anchors (sink and local blocks), so
  a query attends to at most ``top_k + sink_blocks + local_blocks`` blocks. Its density depends on
  the document's length only (:func:`topk_density`): the cost grows with ``k L``, not ``L^2``.
- ``gamma`` (threshold, FlexPrefill/XAttention-like, our extension): the fewest key blocks whose
  estimated attention mass reaches ``gamma``; its density depends on the content.

Both are one monotone *knob* (:attr:`Budget.value`, :meth:`Budget.with_value`): a larger value
never keeps fewer blocks; DST tunes it per micro-batch and layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from numpy.typing import ArrayLike

KINDS = ("top-k", "gamma")


@dataclass(frozen=True)
class Budget:
    """Budget for dynamic block selection (validated on construction): exactly one of ``gamma``
    and ``top_k``.

    Per query block, :func:`~sparsebalance.ops.select_blocks` keeps the anchor blocks plus either
    the ``top_k`` non-anchor causal blocks of highest estimated mass, or the fewest blocks whose
    estimated mass reaches ``gamma`` (at least ``min_blocks``), within the optional cap.
    Precedence: anchors > ``min_blocks`` > ``max_density`` > ``gamma`` / ``top_k``.
    """

    gamma: float | None = None
    """Estimated attention mass to keep, in (0, 1]. 1.0 keeps every causal block (exact)."""
    top_k: int | None = None
    """Key blocks the gate chooses per query block (>= 0), anchors not counted; a ``top_k`` that
    covers every causal block of a document gives exact attention there."""
    sink_blocks: int = 1
    """The first ``sink_blocks`` blocks of every document are always kept (attention sinks)."""
    local_blocks: int = 1
    """The diagonal block and the ``local_blocks - 1`` blocks before it are always kept."""
    max_density: float | None = None
    """Optional cap on the *total* kept per query block (per document it touches), anchors
    included: at most ``max(floor(max_density * causal blocks), anchors, min_blocks)``. So the
    density of a pack never exceeds ``max_density`` unless the anchors (or the ``min_blocks``
    floor) alone exceed it in some rows (short documents, early blocks): those rows keep exactly
    their anchors and floor, which keeps every query's own block."""
    min_blocks: int = 1
    """Floor: keep at least this many key blocks per query block (when that many are causal)."""
    floor: Any = field(default=None, compare=False)
    """A 0-dim device tensor raising the knob on the device: top-k keeps ``max(top_k, floor)``
    key blocks per query (int64), gamma keeps mass ``max(gamma, floor)`` (float): DST's coverage
    bound decided on the device, never read back inside the step. ``top_k`` / ``gamma`` is then
    a lower bound: host decisions that use it (:meth:`covers`) stay conservative."""

    def __post_init__(self) -> None:
        if (self.gamma is None) == (self.top_k is None):
            raise ValueError(
                "a Budget needs exactly one of gamma (mass to keep, e.g. Budget(gamma=0.9)) and "
                f"top_k (key blocks per query, e.g. Budget(top_k=8)); got gamma={self.gamma!r}, "
                f"top_k={self.top_k!r}"
            )
        if self.gamma is not None:
            if isinstance(self.gamma, bool) or not isinstance(self.gamma, (int, float)):
                raise TypeError(f"gamma must be a number in (0, 1], got {self.gamma!r}")
            if not (math.isfinite(self.gamma) and 0.0 < self.gamma <= 1.0):
                raise ValueError(f"gamma must be in (0, 1], got {self.gamma}")
        else:
            k = self.top_k
            if isinstance(k, (np.integer,)):
                object.__setattr__(self, "top_k", int(k))
                k = self.top_k
            if isinstance(k, bool) or not isinstance(k, int) or k < 0:
                raise ValueError(f"top_k must be an integer >= 0 (key blocks), got {k!r}")
        for name in ("sink_blocks", "local_blocks", "min_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.max_density is not None and not (0.0 < self.max_density <= 1.0):
            raise ValueError(f"max_density must be in (0, 1] or None, got {self.max_density}")
        if self.floor is not None and (not isinstance(self.floor, torch.Tensor) or self.floor.ndim):
            raise ValueError("floor is a 0-dim tensor")

    @property
    def kind(self) -> str:
        """``"top-k"`` or ``"gamma"``."""
        return "gamma" if self.gamma is not None else "top-k"

    @property
    def value(self) -> float:
        """The knob: ``gamma``, or ``top_k`` as a float."""
        return float(self.gamma) if self.gamma is not None else float(self.top_k)

    @property
    def anchor_blocks(self) -> int:
        """Anchors per query block once a document is long enough (sink + local)."""
        return self.sink_blocks + self.local_blocks

    @property
    def is_dense(self) -> bool:
        """True when the budget keeps every causal block of any document (exact attention).
        A ``top_k`` budget is dense only for documents it covers (see :func:`topk_density`)."""
        uncapped = self.max_density is None or self.max_density >= 1.0
        return self.gamma is not None and self.gamma >= 1.0 and uncapped

    def covers(self, num_segments: ArrayLike) -> np.ndarray:
        """Bool, elementwise: a document touching ``num_segments`` blocks keeps every causal
        block under this budget (exact attention there), decided on the host from the rule
        alone. Top-k: the last query block of a document of ``s`` blocks has ``s`` causal key
        blocks, ``sink_blocks + local_blocks`` of them anchors (fewer if they overlap), so
        ``top_k >= s - sink - local`` keeps them all; no earlier block has more candidates. A
        ``max_density`` cap below 1 is never taken to cover (conservative)."""
        s = np.asarray(num_segments)
        if self.max_density is not None and self.max_density < 1.0:
            return np.zeros(s.shape, dtype=bool)
        if self.gamma is not None:
            return np.full(s.shape, self.gamma >= 1.0)
        return self.top_k >= s - self.sink_blocks - self.local_blocks

    def dense_documents(self, pack, dense_from: float | None = None) -> tuple[bool, ...]:
        """Per document of a :class:`~.pack_index.PackIndex` (host): it keeps every causal block,
        because the budget :meth:`covers` it, or because its top-k density (from its length,
        :func:`topk_density`) reaches ``dense_from``, the density from which the dense kernel is
        faster than the sparse one (the latency profile's crossover): such a document is
        *promoted* to exact attention, never cut (more attention, less time)."""

        def build():
            dense = self.covers(pack.doc_segments)
            if dense_from is not None and self.top_k is not None and self.max_density is None:
                lengths = np.asarray(pack.lengths, dtype=np.float64)
                density = topk_density(lengths, self.top_k, pack.block_size, self.anchor_blocks)
                dense = dense | (density >= dense_from)
            return tuple(bool(x) for x in dense)

        return pack.memo(("dense_documents", self, dense_from), build)  # once per pack

    def with_value(self, value: float) -> Budget:
        """A copy with another knob value (gamma, or top_k rounded to an integer)."""
        if self.gamma is not None:
            return replace(self, gamma=float(value))
        return replace(self, top_k=round(value))

    def with_gamma(self, gamma: float) -> Budget:
        """A copy with another ``gamma`` (a gamma budget's knob)."""
        if self.gamma is None:
            raise ValueError("with_gamma on a top_k budget: use with_value")
        return replace(self, gamma=gamma)


def topk_density(lengths: ArrayLike, top_k: ArrayLike, block_size: int, anchor_blocks: int = 2) -> np.ndarray:
    """Density of a ``top_k`` budget on documents of ``lengths`` tokens, elementwise float64.

    A document of ``n = ceil(L / B)`` blocks starting on a block boundary: query block ``i``
    (0-based) has ``i + 1`` causal blocks and keeps ``min(i + 1, top_k + anchor_blocks)`` of them
    (anchors = sink + local blocks, distinct once ``i + 1 > anchor_blocks``). With ``W = top_k +
    anchors``: kept = ``n(n+1)/2`` if ``n <= W``, else ``W(W+1)/2 + (n - W) W``; density = kept /
    ``(n(n+1)/2)``. Exact for block-aligned documents without a ``max_density`` cap; a document
    that shares its first or last block with a neighbour differs by at most those blocks' rows.
    """
    n = np.ceil(np.asarray(lengths, dtype=np.float64) / block_size)
    n = np.maximum(n, 1.0)
    w = np.asarray(top_k, dtype=np.float64) + anchor_blocks
    w = np.maximum(w, 1.0)  # every query keeps at least its own block
    causal = n * (n + 1) / 2
    kept = np.where(n <= w, causal, w * (w + 1) / 2 + (n - w) * w)
    return kept / causal


def topk_for_density(lengths: ArrayLike, density: ArrayLike, block_size: int, anchor_blocks: int = 2) -> np.ndarray:
    """The (real-valued) ``top_k`` whose :func:`topk_density` on ``lengths`` is ``density``: the
    inverse in ``k`` (>= 0; a density of 1 maps to the document's block count)."""
    n = np.maximum(np.ceil(np.asarray(lengths, dtype=np.float64) / block_size), 1.0)
    d = np.clip(np.asarray(density, dtype=np.float64), 0.0, 1.0)
    kept = d * n * (n + 1) / 2
    # kept = w (n + 1/2) - w^2 / 2 for w <= n: the smaller root of w^2 - (2n + 1) w + 2 kept.
    b = 2 * n + 1
    w = (b - np.sqrt(np.maximum(b * b - 8 * kept, 0.0))) / 2
    return np.maximum(w - anchor_blocks, 0.0)
