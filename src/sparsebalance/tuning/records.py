"""What DST decided and what happened: the typed records the trainer's metrics and plots read.

- :class:`StepTargets`: the step-level numbers every rank derives identically from the ranks'
  predicted times (anchor, cut threshold, post-cut step time ``T'``, who is cut / raised).
- :class:`RankDecision`: one rank's budget for the step and its predicted effect.
- :class:`StepDecision`: targets plus every rank's decision (the plan path, or after a gather).
- :class:`LayerRecord` / :class:`RankRunSummary`: the layer controller's per-(micro-batch, layer)
  choices and their summary once the rank's forward passes are done.

All times are predicted or measured seconds of forward + backward, as in ``CostModel``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

CUT, RAISED, KEPT = "cut", "raised", "kept"


@dataclass(frozen=True)
class StepTargets:
    """Step-level targets; a pure function of the ranks' predicted times and the config.

    The per-rank tuples hold one entry per *worker*: a rank for data-parallel plans (``R``), a
    group of ranks joined by CP units for hybrid plans (:func:`~sparsebalance.tuning.
    unit_workload.decide_units`; ``RankDecision.role`` then carries each rank's worker's role)."""

    anchor_seconds: float
    """``T* = anchor(times_before)``."""
    cut_threshold: float
    """``(1 + p) * T*``: ranks predicted above it are stragglers and get a smaller budget."""
    post_cut_seconds: float
    """``T'``: the step time after the cuts (a cut worker counts as its target, or its floor's
    time when the floor cannot reach it)."""
    raise_seconds: float
    """What raised workers are raised up to: ``T_anchor`` (the paper's rule) or ``T'``."""
    times_before: tuple[float, ...]
    """``(W,)`` predicted worker times at the base budget (W = R without CP units)."""
    times_floor: tuple[float, ...]
    """``(W,)`` predicted worker times at the deepest allowed cut (the knob's floor, or the
    coverage bound's)."""
    roles: tuple[str, ...]
    """``(W,)`` ``"cut"``, ``"raised"`` (bidirectional, below the raise target) or ``"kept"``."""

    @property
    def step_seconds_before(self) -> float:
        return max(self.times_before, default=0.0)


@dataclass(frozen=True)
class RankDecision:
    """One rank's step-level budget and its predicted effect."""

    rank: int
    role: str
    """``"cut"``, ``"raised"`` or ``"kept"`` (see :class:`StepTargets`)."""
    budget: float
    """The rank's budget for the step, the knob's value (k or gamma; the layer controller starts
    from it); with :attr:`microbatch_budgets`, their mean."""
    target_seconds: float
    """What the rank aims at: its predicted time at ``budget`` (the layer controller's target)."""
    predicted_before: float
    """Predicted time at the base budget."""
    predicted_after: float
    """Predicted time at ``budget``."""
    density_before: float
    """Predicted density at the base budget: mean over the rank's documents weighted by
    length²."""
    density_after: float
    """Same at ``budget``."""
    attention_before: float
    """Predicted attention seconds (all layers, all micro-batches) at the base budget."""
    attention_after: float
    """Predicted attention seconds at ``budget``."""
    microbatch_budgets: tuple[float, ...] | None = None
    """Pipelines (``pipeline_stages`` > 1, DST on): the budget of each of the rank's
    micro-batches, plan order (:mod:`~sparsebalance.tuning.microbatch_dst`); ``budget`` is then
    their mean and the times and densities are priced at them. None: ``budget`` for every one."""

    @property
    def budget_delta(self) -> float:
        """Attention seconds given (> 0) or cut (< 0) relative to the base budget."""
        return self.attention_after - self.attention_before


@dataclass(frozen=True)
class StepDecision:
    """The whole step: shared targets plus one :class:`RankDecision` per rank, in rank order."""

    mode: str
    anchor: str
    p: float
    targets: StepTargets
    ranks: tuple[RankDecision, ...]
    kind: str = "top-k"
    """The budget kind: ``top-k`` or ``gamma``."""
    base: float = 0.0
    """The base budget (k or gamma0)."""

    @property
    def budgets(self) -> np.ndarray:
        """``(R,)`` float64 budget (knob value) per rank."""
        return np.array([r.budget for r in self.ranks], dtype=np.float64)

    @property
    def times_before(self) -> np.ndarray:
        return np.array([r.predicted_before for r in self.ranks], dtype=np.float64)

    @property
    def times_after(self) -> np.ndarray:
        return np.array([r.predicted_after for r in self.ranks], dtype=np.float64)

    @property
    def step_seconds_before(self) -> float:
        return float(self.times_before.max(initial=0.0))

    @property
    def step_seconds_after(self) -> float:
        return float(self.times_after.max(initial=0.0))

    @property
    def bubbles_before(self) -> np.ndarray:
        """``(R,)`` predicted wait at the gradient sync at the base budget."""
        return bubbles(self.times_before)

    @property
    def bubbles_after(self) -> np.ndarray:
        return bubbles(self.times_after)

    @property
    def budget_cut(self) -> float:
        """Predicted attention seconds taken from stragglers (>= 0)."""
        return float(sum(-min(r.budget_delta, 0.0) for r in self.ranks))

    @property
    def budget_given(self) -> float:
        """Predicted attention seconds given to raised ranks (>= 0)."""
        return float(sum(max(r.budget_delta, 0.0) for r in self.ranks))

    def to_dict(self) -> dict:
        """JSON-ready summary (for ``--json`` output and metrics files)."""
        return {
            "mode": self.mode,
            "anchor": self.anchor,
            "p": self.p,
            "budget_kind": self.kind,
            "budget_base": self.base,
            "anchor_seconds": self.targets.anchor_seconds,
            "cut_threshold": self.targets.cut_threshold,
            "post_cut_seconds": self.targets.post_cut_seconds,
            "raise_seconds": self.targets.raise_seconds,
            "step_seconds_before": self.step_seconds_before,
            "step_seconds_after": self.step_seconds_after,
            "bubble_before": float(self.bubbles_before.sum()),
            "bubble_after": float(self.bubbles_after.sum()),
            "budget_cut": self.budget_cut,
            "budget_given": self.budget_given,
            "bubbles_before": self.bubbles_before.tolist(),
            "bubbles_after": self.bubbles_after.tolist(),
            "ranks": [asdict(r) for r in self.ranks],
        }


@dataclass(frozen=True)
class LayerRecord:
    """One (micro-batch, layer) decision of the layer controller."""

    microbatch: int
    layer: int
    budget: float
    """The chosen knob value (k or gamma)."""
    density: float
    """Realized density of the chosen layout (length²-weighted over documents)."""
    predicted_seconds: float
    """The cost model's seconds for this unit at the chosen layout's real densities."""
    allotted_seconds: float
    """The share of the remaining budget this unit was given."""
    coverage: float | None = None
    """The gate's coverage at the chosen budget (None when no coverage bound was checked, or
    where it was decided on the device)."""
    limited_on_host: bool = False
    """The host's coverage bound stopped a cut (see :attr:`coverage_limited`)."""
    measured_seconds: float | None = None
    """What it actually cost (``None`` until :meth:`LayerController.observe`)."""
    floor: object = None
    """Where the coverage bound was decided on the device: the int64 0-dim tensor ``v_cov``;
    the layer ran ``max(budget, floor)`` (:attr:`chosen`)."""

    @property
    def chosen(self) -> float:
        """The knob value the layer ran with (reads ``floor`` back: call at the step's end)."""
        return self.budget if self.floor is None else max(self.budget, float(self.floor))

    @property
    def coverage_limited(self) -> bool:
        """The coverage bound stopped a cut the time target asked for (the empty feasible set;
        reads ``floor`` back where it was decided on the device: call at the step's end)."""
        return self.limited_on_host if self.floor is None else float(self.floor) > self.budget


@dataclass(frozen=True)
class RankRunSummary:
    """A rank's realized budgets after its forward passes (per-layer budget min/mean/max)."""

    target_seconds: float
    predicted_seconds: float
    """Sum of the units' predicted seconds at the chosen budgets."""
    measured_seconds: float
    """Sum of the observed seconds (predicted where a unit was not observed)."""
    budget_min: float
    budget_mean: float
    budget_max: float
    layer_budget_min: tuple[float, ...]
    """``(L,)`` over micro-batches, per layer."""
    layer_budget_mean: tuple[float, ...]
    layer_budget_max: tuple[float, ...]
    density_mean: float
    """Mean realized density over the units."""

    @property
    def relative_error(self) -> float:
        """``(measured - target) / target``: how far the closed loop landed from its target."""
        return (self.measured_seconds - self.target_seconds) / max(self.target_seconds, 1e-30)


def bubbles(times: np.ndarray) -> np.ndarray:
    """``(R,)`` wait at the gradient sync: ``max(times) - times``."""
    times = np.asarray(times, dtype=np.float64)
    return times.max(initial=0.0) - times if times.size else times
