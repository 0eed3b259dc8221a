"""The units of work every balancing stage passes around: samples, micro-batches, and the
latency-model protocol the planner (SAB), the tuner (DST) and the simulator call.

Data flow: ``Sample`` (tokenized document) -> planner -> ``MicroBatch`` per rank (with estimated
densities at the default budget) -> tuner (budgets) -> trainer. Predicted times come from a
``CostModel``; :class:`sparsebalance.latency.LatencyModel` is the real one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class Sample:
    """One tokenized document of the global batch."""

    id: int
    """Stable id (dataset index); plans refer to samples by id."""
    num_tokens: int
    """Length in tokens (> 0)."""
    source: str = ""
    """Domain / task key, so density estimators can learn per-source sparsity."""

    def __post_init__(self) -> None:
        if self.num_tokens <= 0:
            raise ValueError(f"Sample {self.id}: num_tokens must be > 0, got {self.num_tokens}")


@dataclass(frozen=True)
class MicroBatch:
    """A pack of documents run as one forward/backward on one rank."""

    sample_ids: tuple[int, ...]
    lengths: tuple[int, ...]
    """Tokens per document, in pack order."""
    densities: tuple[float, ...]
    """Estimated attention density of each document at the default budget ``gamma0``."""

    def __post_init__(self) -> None:
        if not (len(self.sample_ids) == len(self.lengths) == len(self.densities)):
            raise ValueError("MicroBatch: sample_ids, lengths and densities differ in length")

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


class PreparedCost(Protocol):
    """:meth:`CostModel.prepare`'s result: ``predict_many`` at fixed ``(M, K)`` lengths."""

    def predict(self, densities: np.ndarray) -> np.ndarray:
        """``(M, K)`` densities -> ``(M,)`` seconds: ``predict_many(lengths, densities)``."""
        ...

    def take(self, rows: np.ndarray) -> PreparedCost:
        """The same for the rows ``rows`` (int indices, increasing) only."""
        ...


class CostModel(Protocol):
    """What balancing needs from a latency model (seconds of forward + backward).

    ``densities`` are attention densities in (0, 1]; ``lengths`` are document lengths in tokens.
    """

    num_layers: int

    def predict(self, lengths: Sequence[int], densities: float | Sequence[float] | np.ndarray) -> float:
        """One micro-batch; densities scalar, ``(N,)`` per document or ``(num_layers, N)``."""
        ...

    def predict_many(self, lengths: np.ndarray, densities: np.ndarray) -> np.ndarray:
        """``(M, K)`` padded lengths (0 = empty slot) and densities -> ``(M,)`` seconds."""
        ...

    def doc_seconds(self, lengths: np.ndarray, densities: np.ndarray) -> np.ndarray:
        """Elementwise: what one document adds to its micro-batch (all layers' attention plus
        the token-proportional rest). ``predict == microbatch_overhead() + sum(doc_seconds)``
        up to the non-linearity of the token-proportional part in the token count."""
        ...

    def microbatch_overhead(self) -> float:
        """Fixed seconds per micro-batch, whatever it holds."""
        ...

    def layer_attention_seconds(self, lengths: np.ndarray, densities: np.ndarray) -> np.ndarray:
        """Elementwise: one layer's attention for one document."""
        ...

    def layer_other_seconds(self, num_tokens: int) -> float:
        """One layer's non-attention part (projections, MLP, norms) for a pack of this size."""
        ...


@runtime_checkable
class ManyOtherCost(Protocol):
    """A :class:`CostModel` whose ``layer_other_seconds`` also takes an array (optional: a cost
    model without it is asked once per micro-batch)."""

    def layer_other_seconds_many(self, num_tokens: np.ndarray) -> np.ndarray:
        """``layer_other_seconds`` of every entry of ``num_tokens`` (any shape): the same values."""
        ...


@runtime_checkable
class PreparableCost(Protocol):
    """A :class:`CostModel` that can also price fixed lengths at many densities fast (optional:
    a cost model without it is priced with ``predict_many``)."""

    def prepare(self, lengths: np.ndarray) -> PreparedCost | None:
        """``predict_many`` for fixed ``(M, K)`` lengths at many densities (DST's bisection), the
        length half done once; None where the model has no such shortcut (callers then call
        ``predict_many``)."""
        ...
