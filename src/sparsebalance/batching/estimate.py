"""Density estimators: each sample's expected attention density at the default budget ``gamma0``,
known *before* the step, so the planner can predict its latency.

- :class:`HistoryEstimator`: an online ridge regression of ``log(density)`` on ``log(length)``,
  optionally one per ``Sample.source``, fitted from the densities the trainer measured in earlier
  steps; a prior (a guess, weighted as a few observations) answers before any data arrives.
- :class:`ProbeEstimator`: a cheap pass over the sample's tokens (for example embeddings and the
  first layer's q/k projections, :class:`ProbeModel`) followed by the real selection rule
  (:func:`~sparsebalance.ops.estimate_block_mass` then ``.density(Budget(gamma0))``).
- :func:`mape` and :func:`estimator_report`: accuracy against realized densities, and what that
  error does to predicted latency.

Every estimator maps ``list[Sample]`` to a float64 ``(N,)`` array in ``(0, 1]``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np
import torch
from torch import nn

from ..ops import Budget, estimate_block_mass
from ..workload import CostModel, Sample


class DensityEstimator(Protocol):
    """What the planner needs: ``estimate(samples) -> (N,)`` densities in (0, 1]."""

    def estimate(self, samples: Sequence[Sample]) -> np.ndarray: ...


def _lengths(samples: Sequence[Sample]) -> np.ndarray:
    return np.fromiter((s.num_tokens for s in samples), dtype=np.float64, count=len(samples))


class _RidgeStats:
    """Weighted sufficient statistics of ``y ≈ a + b x`` (5 floats), with exponential forgetting."""

    __slots__ = ("sw", "sx", "sxx", "sxy", "sy")

    def __init__(self, values: Sequence[float] = (0.0,) * 5) -> None:
        self.sw, self.sx, self.sxx, self.sy, self.sxy = map(float, values)

    def add(self, x: np.ndarray, y: np.ndarray, decay: float) -> None:
        self.sw, self.sx, self.sxx, self.sy, self.sxy = (
            decay * self.sw + x.size,
            decay * self.sx + float(x.sum()),
            decay * self.sxx + float((x * x).sum()),
            decay * self.sy + float(y.sum()),
            decay * self.sxy + float((x * y).sum()),
        )

    def solve(self, prior: tuple[float, float], weight: float) -> tuple[float, float]:
        """Ridge solution pulled towards ``prior = (a0, b0)`` with ``weight`` pseudo-observations
        (at x = 0 for the intercept and x = ±1 for the slope)."""
        a0, b0 = prior
        # Normal equations of sum w (y - a - b x)^2 + weight (a - a0)^2 + weight (b - b0)^2.
        m00, m01, m11 = self.sw + weight, self.sx, self.sxx + weight
        r0, r1 = self.sy + weight * a0, self.sxy + weight * b0
        det = m00 * m11 - m01 * m01
        return (r0 * m11 - m01 * r1) / det, (m00 * r1 - m01 * r0) / det

    def values(self) -> list[float]:
        return [self.sw, self.sx, self.sxx, self.sy, self.sxy]


class HistoryEstimator:
    """Online regression ``log d = a + b log(L / ref_length)``, global and per source.

    Before any data the prediction is the prior ``prior_density * (L / ref_length) ** prior_slope``
    (threshold selection keeps a shrinking fraction of blocks as documents grow). Each
    :meth:`observe` call first multiplies the accumulated statistics by ``decay`` (so the fit
    follows a drifting model), then adds the new points. With ``per_source`` a source's own fit is
    pulled towards the global fit with ``source_prior_weight`` pseudo-observations, so a new source
    starts at the global curve. Predictions are clipped to ``[min_density, 1]``.

    Cost: ``observe`` and ``estimate`` are O(N) numpy; the state is 5 floats per source.
    """

    def __init__(
        self,
        prior_density: float = 0.3,
        prior_slope: float = -0.5,
        ref_length: int = 8192,
        prior_weight: float = 4.0,
        per_source: bool = True,
        source_prior_weight: float = 16.0,
        decay: float = 1.0,
        min_density: float = 1e-3,
    ) -> None:
        if not 0.0 < prior_density <= 1.0:
            raise ValueError(f"prior_density must be in (0, 1], got {prior_density}")
        if ref_length <= 0 or prior_weight <= 0 or source_prior_weight <= 0:
            raise ValueError("ref_length, prior_weight and source_prior_weight must be > 0")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if not 0.0 < min_density <= 1.0:
            raise ValueError(f"min_density must be in (0, 1], got {min_density}")
        self.prior = (math.log(prior_density), float(prior_slope))
        self.ref_length = int(ref_length)
        self.prior_weight = float(prior_weight)
        self.per_source = per_source
        self.source_prior_weight = float(source_prior_weight)
        self.decay = float(decay)
        self.min_density = float(min_density)
        self._global = _RidgeStats()
        self._sources: dict[str, _RidgeStats] = {}
        self.num_observed = 0

    def _x(self, lengths: np.ndarray) -> np.ndarray:
        return np.log(lengths / self.ref_length)

    def observe(
        self,
        samples: Sequence[Sample],
        densities: Sequence[float] | np.ndarray,
        budgets: Sequence[float] | np.ndarray | None = None,
    ) -> None:
        """Add the densities the trainer measured for ``samples`` (``(N,)``, in (0, 1]; at the
        base budget under gamma, at the final budget under top-k); ``budgets`` are unused."""
        d = np.asarray(densities, dtype=np.float64).reshape(-1)
        if d.size != len(samples):
            raise ValueError(f"observe: {len(samples)} samples but {d.size} densities")
        if d.size and not (np.all(d > 0) and np.all(d <= 1.0 + 1e-9)):
            raise ValueError("observe: realized densities must lie in (0, 1]")
        x = self._x(_lengths(samples))
        y = np.log(np.clip(d, self.min_density, 1.0))
        self._global.add(x, y, self.decay)
        if self.per_source:
            keys = np.array([s.source for s in samples], dtype=object)
            for key in sorted(set(keys.tolist())):
                sel = keys == key
                self._sources.setdefault(key, _RidgeStats()).add(x[sel], y[sel], self.decay)
        self.num_observed += d.size

    def coefficients(self, source: str | None = None) -> tuple[float, float]:
        """``(a, b)`` of ``log d = a + b log(L / ref_length)``: global, or for one source."""
        glob = self._global.solve(self.prior, self.prior_weight)
        if source is None or not self.per_source or source not in self._sources:
            return glob
        return self._sources[source].solve(glob, self.source_prior_weight)

    def estimate(self, samples: Sequence[Sample]) -> np.ndarray:
        """float64 ``(N,)`` predicted densities in ``[min_density, 1]``. O(N)."""
        x = self._x(_lengths(samples))
        a = np.empty_like(x)
        b = np.empty_like(x)
        keys = [s.source for s in samples]
        for key in sorted(set(keys)):
            sel = np.fromiter((k == key for k in keys), dtype=bool, count=len(keys))
            a[sel], b[sel] = self.coefficients(key)
        return np.clip(np.exp(a + b * x), self.min_density, 1.0)

    def state_dict(self) -> dict:
        """JSON-serialisable state for checkpoints (configuration and statistics)."""
        return {
            "kind": "history",
            "prior": list(self.prior),
            "ref_length": self.ref_length,
            "prior_weight": self.prior_weight,
            "per_source": self.per_source,
            "source_prior_weight": self.source_prior_weight,
            "decay": self.decay,
            "min_density": self.min_density,
            "global": self._global.values(),
            "sources": {k: v.values() for k, v in sorted(self._sources.items())},
            "num_observed": self.num_observed,
        }

    def load_state_dict(self, state: Mapping) -> None:
        if state.get("kind", "history") != "history":
            raise ValueError(
                f"the checkpoint's density estimator is a {state.get('kind')!r}, not a history "
                "regression (saved by a run with another --estimator): resume with the same "
                "settings"
            )
        self.prior = (float(state["prior"][0]), float(state["prior"][1]))
        self.ref_length = int(state["ref_length"])
        self.prior_weight = float(state["prior_weight"])
        self.per_source = bool(state["per_source"])
        self.source_prior_weight = float(state["source_prior_weight"])
        self.decay = float(state["decay"])
        self.min_density = float(state["min_density"])
        self._global = _RidgeStats(state["global"])
        self._sources = {k: _RidgeStats(v) for k, v in state["sources"].items()}
        self.num_observed = int(state["num_observed"])


class ProbeModel(nn.Module):
    """Embedding plus first-layer q/k projections: token ids ``(L,)`` -> ``q (L, Hq, D)``,
    ``k (L, Hkv, D)``, block-pooled.

    Embeddings are mean-pooled per block *before* the projections and the pooled q/k are repeated
    back to tokens; for linear projections (with bias) this equals projecting every token and
    pooling afterwards, which is all :func:`~sparsebalance.ops.estimate_block_mass` looks at, at
    ``1 / block_size`` of the matmul cost. RoPE and norms of the real first layer are not applied
    (an approximation). Cost: O(L * hidden + (L / B) * hidden * (Hq + Hkv) * D).
    """

    def __init__(
        self,
        embedding: nn.Embedding,
        q_proj: nn.Linear,
        k_proj: nn.Linear,
        num_heads: int,
        num_kv_heads: int,
        block_size: int,
    ) -> None:
        super().__init__()
        if q_proj.out_features % num_heads or k_proj.out_features % num_kv_heads:
            raise ValueError("q_proj/k_proj out_features must be multiples of the head counts")
        self.embedding, self.q_proj, self.k_proj = embedding, q_proj, k_proj
        self.num_heads, self.num_kv_heads, self.block_size = num_heads, num_kv_heads, block_size

    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = token_ids.numel()
        x = self.embedding(token_ids.reshape(-1))  # (L, hidden)
        block = torch.arange(n, device=x.device) // self.block_size
        nb = -(-n // self.block_size)
        pooled = torch.zeros(nb, x.shape[1], dtype=x.dtype, device=x.device).index_add_(0, block, x)
        pooled /= torch.bincount(block, minlength=nb).to(x.dtype)[:, None]
        q = self.q_proj(pooled).view(nb, self.num_heads, -1)[block]
        k = self.k_proj(pooled).view(nb, self.num_kv_heads, -1)[block]
        return q, k


class ProbeEstimator:
    """Densities from a cheap pass over each sample's tokens and the real selection rule.

    ``qk_fn(token_ids (L,)) -> (q (L, Hq, D), k (L, Hkv, D))`` (e.g. a :class:`ProbeModel`);
    ``tokens`` gives a sample's token ids (a mapping ``id -> LongTensor`` or a callable). Each
    sample's density is ``estimate_block_mass(q, k, [0, L], block_size).density(budget)``. Cost per
    sample: ``qk_fn`` plus O((L / B)^2 * D) per head. ``last_seconds`` holds the wall time of the
    last :meth:`estimate` call, to report the probe's cost relative to a training step.
    """

    def __init__(
        self,
        qk_fn: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        tokens: Mapping[int, torch.Tensor] | Callable[[Sample], torch.Tensor],
        budget: Budget | None = None,
        *,
        block_size: int,
    ) -> None:
        self.qk_fn, self.tokens = qk_fn, tokens
        self.budget = Budget(gamma=0.9) if budget is None else budget
        if not isinstance(self.budget, Budget):
            raise TypeError(f"budget must be a sparsebalance.ops.Budget, got {budget!r}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self.last_seconds = 0.0

    def _ids(self, sample: Sample) -> torch.Tensor:
        ids = self.tokens[sample.id] if isinstance(self.tokens, Mapping) else self.tokens(sample)
        if ids.numel() != sample.num_tokens:
            raise ValueError(
                f"probe: sample {sample.id} has num_tokens={sample.num_tokens} but {ids.numel()} token ids"
            )
        return ids

    def estimate(self, samples: Sequence[Sample]) -> np.ndarray:
        """float64 ``(N,)`` densities in (0, 1]."""
        t0 = time.perf_counter()
        out = np.empty(len(samples), dtype=np.float64)
        with torch.no_grad():
            for i, s in enumerate(samples):
                q, k = self.qk_fn(self._ids(s))
                cu = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
                out[i] = estimate_block_mass(q, k, cu, self.block_size).density(self.budget)
        self.last_seconds = time.perf_counter() - t0
        return out


def mape(predicted: Sequence[float] | np.ndarray, actual: Sequence[float] | np.ndarray) -> float:
    """Mean absolute percentage error ``mean(|p - a| / a)`` (a fraction: 0.1 = 10 %)."""
    p = np.asarray(predicted, dtype=np.float64).reshape(-1)
    a = np.asarray(actual, dtype=np.float64).reshape(-1)
    if p.shape != a.shape or a.size == 0:
        raise ValueError(f"mape: need two non-empty arrays of one shape, got {p.shape}, {a.shape}")
    if np.any(a <= 0):
        raise ValueError("mape: actual values must be > 0")
    return float(np.mean(np.abs(p - a) / a))


def estimator_report(
    cost_model: CostModel,
    samples: Sequence[Sample],
    predicted: np.ndarray,
    realized: np.ndarray,
) -> dict[str, float]:
    """Density MAPE and the per-document latency MAPE it causes (``doc_seconds`` at predicted vs
    realized densities, same lengths), plus the signed bias of predicted total time."""
    lengths = _lengths(samples)
    t_pred = cost_model.doc_seconds(lengths, np.asarray(predicted, dtype=np.float64))
    t_real = cost_model.doc_seconds(lengths, np.asarray(realized, dtype=np.float64))
    return {
        "density_mape": mape(predicted, realized),
        "latency_mape": mape(t_pred, t_real),
        "latency_bias": float(t_pred.sum() / t_real.sum() - 1.0),
    }
