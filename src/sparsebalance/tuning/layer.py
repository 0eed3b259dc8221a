"""DST layer level: a per-rank closed-loop controller that picks gamma per (micro-batch, layer).

The step level (:mod:`sparsebalance.tuning.dst`) gives each rank a target time from *predicted*
densities. In the forward pass every attention layer has its real block scores
(``BlockMassEstimate``), so it knows the exact density, and through the ``CostModel`` the
predicted seconds, of any gamma. :class:`LayerController` uses that to keep the rank on track:

    remaining = target - spent            (spent: measured seconds of finished units)
    allotted  = remaining * P_u / sum(P_v over units not yet decided, u included)
    gamma_u   = largest gamma in [lo, hi] with  fixed_u + attention_u(gamma) <= allotted

``P_v`` is a unit's predicted seconds at the rank's step gamma (curve densities), ``fixed_u`` its
non-attention part (``layer_other_seconds``, plus ``microbatch_overhead`` on layer 0) and
``attention_u(gamma)`` is ``layer_attention_seconds`` at the layer's exact per-document densities
for that gamma, found by bisection with ``config.layer_probes`` density evaluations. When earlier
units cost more than predicted, ``remaining`` shrinks and later layers cut; when they cost less,
later layers get more (``bidirectional`` only: ``down`` never goes above ``gamma0``, ``off``
always uses ``gamma0``).

The controller only decides in the forward pass: the backward reuses the forward's layouts, so a
unit's ``seconds`` passed to :meth:`LayerController.observe` should be its forward + backward
cost (or the forward scaled by the model's backward ratio, until the backward has run). A unit
chosen but not yet observed counts with its predicted seconds.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from ..ops import Budget
from ..workload import CostModel, MicroBatch
from .curve import DensityCurve
from .dst import DSTConfig
from .records import LayerRecord, RankDecision, RankRunSummary


class LayerController:
    """Closed-loop budgets for one rank's forward passes in one step (see the module docstring).

    Args:
        microbatches: the rank's micro-batches for this step (densities at ``config.gamma0``).
        cost_model: any object following ``sparsebalance.workload.CostModel``.
        config: the DST config (mode, gamma bounds, probes).
        target_seconds: the rank's target forward + backward seconds for the step.
        gamma: the rank's step-level gamma (default ``config.gamma0``).
        curve: prices the plan's densities at ``gamma`` (default ``DensityCurve(gamma0)``).
        budget: template for the returned budgets (anchors, caps); its gamma is replaced.
    """

    def __init__(
        self,
        microbatches: Sequence[MicroBatch],
        cost_model: CostModel,
        config: DSTConfig,
        target_seconds: float,
        gamma: float | None = None,
        curve: DensityCurve | None = None,
        budget: Budget | None = None,
    ) -> None:
        if not np.isfinite(target_seconds) or target_seconds < 0:
            raise ValueError(f"target_seconds must be finite and >= 0, got {target_seconds}")
        self.config = config
        self.cost_model = cost_model
        self.target_seconds = float(target_seconds)
        self.gamma = config.gamma0 if gamma is None else float(gamma)
        if config.mode == "off":
            self.lo = self.hi = config.gamma0
        else:
            hi = config.gamma_max if config.mode == "bidirectional" else config.gamma0
            self.lo, self.hi = config.gamma_min, max(hi, self.gamma)
        if not self.lo <= self.gamma <= self.hi and config.mode != "off":
            raise ValueError(f"gamma={self.gamma} outside [{self.lo}, {self.hi}]")
        self.budget = budget or Budget(gamma=self.gamma)
        curve = curve or DensityCurve(gamma0=config.gamma0)

        self.lengths = [np.asarray(mb.lengths, dtype=np.int64) for mb in microbatches]
        num_layers = int(cost_model.num_layers)
        m = len(microbatches)
        attention = np.zeros(m)
        self.fixed = np.zeros((m, num_layers))
        for i, mb in enumerate(microbatches):
            dens = curve.density(np.asarray(mb.densities, dtype=np.float64), self.gamma)
            attention[i] = np.sum(cost_model.layer_attention_seconds(self.lengths[i], dens))
            self.fixed[i, :] = cost_model.layer_other_seconds(mb.num_tokens)
            # Layer 0 also carries what is outside the layers (embedding, head, loss), defined so
            # that the units of a micro-batch add up to exactly the model's prediction for it.
            total = cost_model.predict(self.lengths[i], dens)
            self.fixed[i, 0] += max(total - num_layers * (attention[i] + self.fixed[i, 1]), 0.0)
        self.planned = attention[:, None] + self.fixed  # (M, L) predicted seconds at self.gamma
        self._chosen = np.zeros((m, num_layers), dtype=bool)
        self._predicted = np.full((m, num_layers), np.nan)  # at the chosen gamma
        self._measured = np.full((m, num_layers), np.nan)
        self._records: dict[tuple[int, int], LayerRecord] = {}

    @classmethod
    def from_decision(
        cls,
        decision: RankDecision,
        microbatches: Sequence[MicroBatch],
        cost_model: CostModel,
        config: DSTConfig,
        curve: DensityCurve | None = None,
        budget: Budget | None = None,
    ) -> LayerController:
        """The controller for a rank's step-level :class:`RankDecision`."""
        return cls(
            microbatches,
            cost_model,
            config,
            decision.target_seconds,
            gamma=decision.gamma,
            curve=curve,
            budget=budget,
        )

    def spent_seconds(self) -> float:
        """Seconds of the units decided so far: measured where observed, else predicted."""
        done = self._chosen
        return float(
            np.where(np.isnan(self._measured), self._predicted, self._measured)[done].sum()
        )

    def choose(
        self, microbatch: int, layer: int, estimate: Any, spent_seconds: float | None = None
    ) -> Budget:
        """The budget for one attention layer of one micro-batch.

        Args:
            microbatch, layer: which unit (each is decided once, in any order).
            estimate: the layer's ``BlockMassEstimate``, or anything with ``density(Budget)``
                (one density for the pack) or ``layout(Budget).document_density()`` (``(N,)``).
            spent_seconds: override for the seconds spent so far this step (e.g. wall clock);
                default :meth:`spent_seconds`.
        """
        self._check_unit(microbatch, layer)
        if self._chosen[microbatch, layer]:
            raise ValueError(f"unit (microbatch={microbatch}, layer={layer}) was already chosen")
        spent = self.spent_seconds() if spent_seconds is None else float(spent_seconds)
        left = self.planned[~self._chosen]
        share = self.planned[microbatch, layer] / left.sum() if left.sum() > 0 else 0.0
        allotted = (self.target_seconds - spent) * share
        limit = allotted - self.fixed[microbatch, layer]
        lengths = self.lengths[microbatch]
        cache: dict[float, tuple[float, np.ndarray]] = {}

        def cost(g: float) -> float:
            if g not in cache:
                dens = _document_densities(estimate, self.budget.with_gamma(g), lengths.size)
                att = float(np.sum(self.cost_model.layer_attention_seconds(lengths, dens)))
                cache[g] = (att, dens)
            return cache[g][0]

        lo, hi = self.lo, self.hi
        if lo == hi or cost(hi) <= limit:
            gamma = hi
        elif cost(lo) > limit:
            gamma = lo
        else:  # invariant: cost(lo) <= limit < cost(hi)
            for _ in range(self.config.layer_probes - 2):
                mid = 0.5 * (lo + hi)
                if cost(mid) <= limit:
                    lo = mid
                else:
                    hi = mid
            gamma = lo
        cost(gamma)
        attention, dens = cache[gamma]
        predicted = attention + self.fixed[microbatch, layer]
        weights = lengths.astype(np.float64) ** 2
        density = float(weights @ dens / weights.sum()) if weights.sum() else 1.0
        self._chosen[microbatch, layer] = True
        self._predicted[microbatch, layer] = predicted
        self._records[(microbatch, layer)] = LayerRecord(
            microbatch, layer, gamma, density, predicted, allotted
        )
        return self.budget.with_gamma(gamma)

    def observe(self, microbatch: int, layer: int, seconds: float) -> None:
        """Report what a chosen unit actually cost (forward + backward seconds)."""
        self._check_unit(microbatch, layer)
        if not self._chosen[microbatch, layer]:
            raise ValueError(f"unit (microbatch={microbatch}, layer={layer}) was never chosen")
        if not np.isfinite(seconds) or seconds < 0:
            raise ValueError(f"seconds must be finite and >= 0, got {seconds}")
        self._measured[microbatch, layer] = seconds
        key = (microbatch, layer)
        self._records[key] = replace(self._records[key], measured_seconds=float(seconds))

    @property
    def records(self) -> list[LayerRecord]:
        """The decisions so far, in (micro-batch, layer) order."""
        return [self._records[k] for k in sorted(self._records)]

    def summary(self) -> RankRunSummary:
        """Per-layer gamma min/mean/max, realized density and seconds of the decided units;
        units never decided count with their planned seconds."""
        if not self._records:
            raise ValueError("no unit was chosen yet")
        gammas = np.full(self._chosen.shape, np.nan)
        dens = []
        for (m, layer), rec in self._records.items():
            gammas[m, layer] = rec.gamma
            dens.append(rec.density)
        predicted = np.where(self._chosen, self._predicted, self.planned)
        measured = np.where(np.isnan(self._measured), predicted, self._measured)
        with warnings.catch_warnings():  # layers no micro-batch decided yet are all-NaN
            warnings.simplefilter("ignore", RuntimeWarning)
            per_layer = [np.nanmin(gammas, 0), np.nanmean(gammas, 0), np.nanmax(gammas, 0)]
        chosen = gammas[self._chosen]
        return RankRunSummary(
            target_seconds=self.target_seconds,
            predicted_seconds=float(predicted.sum()),
            measured_seconds=float(measured.sum()),
            gamma_min=float(chosen.min()),
            gamma_mean=float(chosen.mean()),
            gamma_max=float(chosen.max()),
            layer_gamma_min=tuple(float(x) for x in per_layer[0]),
            layer_gamma_mean=tuple(float(x) for x in per_layer[1]),
            layer_gamma_max=tuple(float(x) for x in per_layer[2]),
            density_mean=float(np.mean(dens)),
        )

    def _check_unit(self, microbatch: int, layer: int) -> None:
        m, num_layers = self._chosen.shape
        if not (0 <= microbatch < m and 0 <= layer < num_layers):
            raise ValueError(
                f"unit (microbatch={microbatch}, layer={layer}) outside the step's "
                f"{m} micro-batches x {num_layers} layers"
            )


def _document_densities(estimate: Any, budget: Budget, num_docs: int) -> np.ndarray:
    """``(N,)`` float64 densities of the layout ``budget`` keeps, per document when possible."""
    fast = getattr(estimate, "document_density", None)  # BlockMassEstimate: no layout built
    layout = getattr(estimate, "layout", None)
    if fast is not None or layout is not None:
        dd = fast(budget) if fast is not None else layout(budget).document_density()
        dd = dd.detach().cpu().numpy() if hasattr(dd, "detach") else np.asarray(dd)
        dd = np.asarray(dd, dtype=np.float64).reshape(-1)
        if dd.size != num_docs:
            raise ValueError(
                f"the layer's layout has {dd.size} documents, the micro-batch has {num_docs}"
            )
        return dd
    return np.full(num_docs, float(estimate.density(budget)))
