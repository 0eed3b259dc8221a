"""What a memory budget allows: ``--capacity auto``'s micro-batch (:func:`auto_capacity`), each
document's minimum context-parallel degree (:class:`MemoryBound`), and the default budget on a GPU
(:func:`with_budget_fraction`), all from :mod:`.memory`'s predicted peaks."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .memory import GIB, MemoryCoefficients, MemoryConfig, MemoryModel


def auto_capacity(model: MemoryModel, budget_bytes: float, cfg: MemoryConfig) -> int:
    """``--capacity auto``: the largest micro-batch (tokens per rank) whose predicted peak fits
    ``budget_bytes``. Raises ValueError when not even one block fits."""
    tokens = model.max_tokens(budget_bytes, cfg)
    if tokens == 0:
        need = model.peak_bytes(cfg.block_size, cfg)
        raise ValueError(
            f"--capacity auto: --memory-budget {budget_bytes / GIB:.2f} GiB fits no micro-batch "
            f"({cfg.block_size} tokens need {need / GIB:.2f} GiB, mostly weights and optimizer "
            "state); raise the budget, shard with --parallel fsdp2, or give --capacity"
        )
    return tokens


@dataclass(frozen=True)
class MemoryBound:
    """What a memory budget allows, for the planners: the per-rank token capacity of a
    micro-batch (``--capacity auto``) and each document's minimum context-parallel degree."""

    model: MemoryModel
    budget_bytes: float
    """Bytes per device (``--memory-budget``)."""
    config: MemoryConfig
    """Features of the run (checkpointing, loss, FSDP2 degree, block size); its ``cp`` is
    ignored (each query sets its own)."""

    def capacity(self) -> int:
        """The largest micro-batch (tokens per rank) that fits (:func:`auto_capacity`)."""
        return auto_capacity(self.model, self.budget_bytes, replace(self.config, cp=1))

    def fits(self, tokens: int, degree: int) -> bool:
        """Whether one document of ``tokens`` on ``degree`` ranks (CP) fits on each of them."""
        return self.model.peak_bytes(tokens, replace(self.config, cp=degree)) <= self.budget_bytes

    def min_degree(self, lengths, max_degree: int) -> np.ndarray:
        """``(N,)`` smallest CP degree ``k <= max_degree`` whose predicted per-rank peak for the
        document fits the budget; ``max_degree + 1`` where none does. Counts what ``ceil(L /
        capacity)`` misses: the ring's remote K/V shard and the layout metadata of the whole
        document (a rank's query blocks x all key blocks), which grow with ``L``, not ``L / k``.
        Binary search per distinct length (the peak falls as k grows)."""
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        out = np.empty_like(lengths)
        for n in np.unique(lengths).tolist():
            lo, hi = 1, max_degree + 1  # the answer lies in [lo, hi]; hi means "none fits"
            while lo < hi:
                mid = (lo + hi) // 2
                if self.fits(n, mid):
                    hi = mid
                else:
                    lo = mid + 1
            out[lengths == n] = lo
        return out

    def max_document(self, degree: int) -> int:
        """The longest document (a multiple of the block size) that fits on ``degree`` ranks."""
        return self.model.max_tokens(self.budget_bytes, replace(self.config, cp=degree))


def with_budget_fraction(coefficients: MemoryCoefficients, fraction: float = 0.9) -> float:
    """The default memory budget on a GPU: ``fraction`` of its memory."""
    if coefficients.device_bytes is None:
        raise ValueError("--memory-budget is required on CPU (no device memory to take 90% of)")
    if not 0 < fraction <= 1:
        raise ValueError(f"budget fraction must lie in (0, 1], got {fraction}")
    return fraction * coefficients.device_bytes


__all__ = ["MemoryBound", "auto_capacity", "with_budget_fraction"]
