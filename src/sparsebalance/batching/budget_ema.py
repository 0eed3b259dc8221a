"""The SparseBalance paper's SAB estimate: per sequence-length bin, an exponential moving average of
the final top-k budgets DST ran with; a sample's density is then what that k keeps at its length.

Under top-k budgets a document's cost depends on its length and its k only (the density is
:func:`~sparsebalance.ops.topk_density` of both), so what the planner must guess before the step is
the k DST will end up giving it: the k of similar-length documents in earlier steps. Bins are
powers of two of the length (``[2^b, 2^(b+1))``); a bin not seen yet answers the base k.

``estimate(samples) -> (N,)`` densities in (0, 1] (the :class:`~.estimate.DensityEstimator`
protocol); ``observe(samples, densities, budgets)`` takes each sample's final budget (mean over
layers). O(N) numpy; the state is one float per bin seen.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ..ops import topk_density
from ..workload import Sample
from .estimate import HistoryEstimator

ESTIMATORS = ("auto", "ema", "history")


class BudgetEMAEstimator:
    """Per-length-bin EMA of final top-k budgets (see the module docstring).

    Args:
        base: the base k (answers for bins not seen yet).
        block_size, anchor_blocks: turn a k into a density at a length.
        decay: weight of the old average at each step's update (the paper's EMA), in [0, 1).
    """

    def __init__(self, base: int, block_size: int, anchor_blocks: int = 2, decay: float = 0.9) -> None:
        if base < 0 or block_size <= 0:
            raise ValueError(f"need base k >= 0 and block size > 0, got {base}, {block_size}")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.base = int(base)
        self.block_size = int(block_size)
        self.anchor_blocks = int(anchor_blocks)
        self.decay = float(decay)
        self.bins: dict[int, float] = {}
        """Length bin -> averaged k."""
        self.num_observed = 0

    @staticmethod
    def bin_of(lengths: np.ndarray) -> np.ndarray:
        """int64 power-of-two bin of each length (>= 1)."""
        return np.floor(np.log2(np.maximum(np.asarray(lengths, dtype=np.float64), 1.0))).astype(np.int64)

    def budgets(self, lengths: Sequence[int] | np.ndarray) -> np.ndarray:
        """float64 ``(N,)`` the averaged k of each length's bin (the base k where unseen)."""
        bins = self.bin_of(np.asarray(lengths))
        return np.array([self.bins.get(int(b), float(self.base)) for b in bins], dtype=np.float64)

    def estimate(self, samples: Sequence[Sample]) -> np.ndarray:
        """float64 ``(N,)`` predicted densities in (0, 1]."""
        lengths = np.fromiter((s.num_tokens for s in samples), dtype=np.float64, count=len(samples))
        return topk_density(lengths, self.budgets(lengths), self.block_size, self.anchor_blocks)

    def observe(
        self,
        samples: Sequence[Sample],
        densities: Sequence[float] | np.ndarray | None = None,
        budgets: Sequence[float] | np.ndarray | None = None,
    ) -> None:
        """Fold in one step's final budgets (``budgets`` ``(N,)``, each sample's k averaged over
        layers); ``densities`` are not needed under top-k (the length and k give them)."""
        if budgets is None:
            raise ValueError("BudgetEMAEstimator.observe needs the samples' final budgets")
        k = np.asarray(budgets, dtype=np.float64).reshape(-1)
        if k.size != len(samples):
            raise ValueError(f"observe: {len(samples)} samples but {k.size} budgets")
        if k.size and not (np.all(np.isfinite(k)) and np.all(k >= 0)):
            raise ValueError("observe: budgets must be finite k >= 0")
        bins = self.bin_of(np.array([s.num_tokens for s in samples]))
        for b in np.unique(bins).tolist():
            mean = float(k[bins == b].mean())
            old = self.bins.get(b)
            self.bins[b] = mean if old is None else self.decay * old + (1 - self.decay) * mean
        self.num_observed += k.size

    def state_dict(self) -> dict:
        """JSON-serialisable state for checkpoints."""
        return {
            "kind": "budget-ema",
            "base": self.base,
            "block_size": self.block_size,
            "anchor_blocks": self.anchor_blocks,
            "decay": self.decay,
            "bins": {str(b): v for b, v in sorted(self.bins.items())},
            "num_observed": self.num_observed,
        }

    def load_state_dict(self, state: Mapping) -> None:
        if state.get("kind") != "budget-ema":
            raise ValueError(
                "the checkpoint's density estimator is not a budget EMA (it was saved by a run "
                "with another --estimator or budget kind): resume with the same settings"
            )
        self.base = int(state["base"])
        self.block_size = int(state["block_size"])
        self.anchor_blocks = int(state["anchor_blocks"])
        self.decay = float(state["decay"])
        self.bins = {int(b): float(v) for b, v in state["bins"].items()}
        self.num_observed = int(state["num_observed"])


def make_estimator(name: str, knob) -> BudgetEMAEstimator | HistoryEstimator:
    """The density estimator ``--estimator name`` asks for, for DST's ``knob``: ``ema`` (the
    paper's, top-k only), ``history`` (a regression of realized densities on length), ``auto``
    (``ema`` under top-k, ``history`` under gamma)."""
    if name not in ESTIMATORS:
        raise ValueError(f"--estimator must be one of {', '.join(ESTIMATORS)}, got {name!r}")
    if name == "auto":
        name = "ema" if knob.kind == "top-k" else "history"
    if name == "history":
        return HistoryEstimator()
    if knob.kind != "top-k":
        raise ValueError("--estimator ema averages top-k budgets: it needs --budget top-k")
    return BudgetEMAEstimator(int(knob.base), knob.block_size, knob.anchor_blocks)
