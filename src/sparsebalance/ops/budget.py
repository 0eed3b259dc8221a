"""The attention budget: how much estimated attention mass each query block keeps."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Budget:
    """Threshold budget for dynamic block selection (validated on construction).

    Per query block, :func:`~sparsebalance.ops.select_blocks` keeps the fewest key blocks whose
    estimated attention mass reaches ``gamma`` (at least ``min_blocks``), plus the anchor blocks,
    within the optional cap. Precedence: anchors > ``min_blocks`` > ``max_density`` > ``gamma``.
    """

    gamma: float = 0.9
    """Estimated attention mass to keep, in (0, 1]. 1.0 keeps every causal block (exact)."""
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

    def __post_init__(self) -> None:
        if isinstance(self.gamma, bool) or not isinstance(self.gamma, (int, float)):
            raise TypeError(f"gamma must be a number in (0, 1], got {self.gamma!r}")
        if not (math.isfinite(self.gamma) and 0.0 < self.gamma <= 1.0):
            raise ValueError(f"gamma must be in (0, 1], got {self.gamma}")
        for name in ("sink_blocks", "local_blocks", "min_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.max_density is not None and not (0.0 < self.max_density <= 1.0):
            raise ValueError(f"max_density must be in (0, 1] or None, got {self.max_density}")

    @property
    def is_dense(self) -> bool:
        """True when the budget keeps every causal block (exact attention)."""
        return self.gamma >= 1.0 and (self.max_density is None or self.max_density >= 1.0)

    def with_gamma(self, gamma: float) -> Budget:
        """A copy with another ``gamma`` (the tuner's knob)."""
        return replace(self, gamma=gamma)
