"""DST layer level: a per-rank closed-loop controller picking the budget per (micro-batch, layer).

The step level (:mod:`sparsebalance.tuning.dst`) gives each rank a target time from *predicted*
densities. In the forward pass every attention layer has its real block scores
(``BlockMassEstimate``, the gate), so it knows the exact density, and through the ``CostModel``
the predicted seconds, of any budget, and the gate's coverage. :class:`LayerController` uses that
to keep the rank on track:

    remaining = target - spent            (spent: measured seconds of finished units)
    allotted  = remaining * P_u / sum(P_v over units not yet decided, u included)
    v_time    = largest v in [lo, hi] with  fixed_u + attention_u(v) <= allotted
    v_cov     = smallest v in [lo, base] with  C_u(base) - C_u(v) <= p     (the coverage bound)
    v_u       = max(v_time, v_cov)

``P_v`` is a unit's predicted seconds at the rank's step budget, ``fixed_u`` its non-attention
part (``layer_other_seconds``, plus ``microbatch_overhead`` on layer 0), ``attention_u(v)`` is
``layer_attention_seconds`` at the layer's per-document densities for budget ``v`` (gamma: the
exact densities of the layer's layouts; top-k: the knob's, which the length fixes, so a probe
builds no layout) and
``C_u`` the gate's coverage (:meth:`~sparsebalance.ops.BlockMassEstimate.coverage`); both searches
are bisections (``config.layer_probes`` evaluations at most; an integer k stops at one block).
When earlier units cost more than predicted, ``remaining`` shrinks and later layers cut, within
the coverage bound; when they cost less, later layers get more (``bidirectional`` only: ``down``
never goes above the base, ``off`` always uses the base). ``p = 0`` never cuts below the base.

The controller only decides in the forward pass: the backward reuses the forward's layouts, so a
unit's ``seconds`` passed to :meth:`LayerController.observe` should be its forward + backward
cost (or the forward scaled by the model's backward ratio, until the backward has run). A unit
chosen but not yet observed counts with its predicted seconds.

In a pipeline each stage's process decides only its own layers: :meth:`LayerController.
share_by_stage` reads ``spent`` and the units left from the rank's whole ledger, replayed from
the plan (:mod:`.layer_ledger`), plus what the stage's own units cost beyond it; so the stages
choose the budgets one process chooses, and a stage's overspend is taken back from its later
units.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from ..ops import Budget
from ..workload import CostModel, MicroBatch
from .config import DSTConfig
from .knob import Knob
from .layer_ledger import (
    LayerGate,
    Replay,
    asked_microbatches,
    bisect,
    budget_range,
    document_densities,
    replay,
    unit_seconds,
)
from .records import LayerRecord, RankDecision, RankRunSummary


class LayerController:
    """Closed-loop budgets for one rank's forward passes in one step (see the module docstring).

    Args:
        microbatches: the rank's micro-batches for this step (densities at the base budget).
        cost_model: any object following ``sparsebalance.workload.CostModel``.
        config: the DST config (mode, coverage bound p, probes).
        target_seconds: the rank's target forward + backward seconds for the step.
        value: the rank's step-level budget (default the knob's base; with ``values``, their mean).
        values: a budget per micro-batch (a pipeline's, :attr:`RankDecision.microbatch_budgets`):
            each micro-batch's units are planned at its own (default ``value`` for every one).
        knob: the budget knob: the tuner's, built from ``config`` at the resolved kernel's block
            size (required: a top-k knob states its budget in blocks of that size).
        budget: template for the returned budgets (anchors, caps); its knob value is replaced.
        device: the run's training device. Off the CPU nothing inside the step may wait for
            the device, so the coverage bound is decided there (:meth:`LayerGate.
            coverage_floor`: the layer runs ``max(v_time, v_cov)``, ``v_cov`` a device scalar;
            gamma's over a grid of ``2 ** (layer_probes - 2) + 1`` values of ``[lo, base]``, the
            host bisection's resolution), a gamma layer's time is priced at the planned
            densities (the knob's response, as top-k's always is) instead of its layout's, and
            every record's device values are read at the step's end.
    """

    def __init__(
        self,
        microbatches: Sequence[MicroBatch],
        cost_model: CostModel,
        config: DSTConfig,
        target_seconds: float,
        value: float | None = None,
        budget: Budget | None = None,
        *,
        knob: Knob,
        device: torch.device | str,
        values: Sequence[float] | None = None,
    ) -> None:
        if not np.isfinite(target_seconds) or target_seconds < 0:
            raise ValueError(f"target_seconds must be finite and >= 0, got {target_seconds}")
        self.config = config
        self.cost_model = cost_model
        self.knob = knob
        self.target_seconds = float(target_seconds)
        self.base = float(knob.base)
        if values is not None and len(values) != len(microbatches):
            raise ValueError(f"{len(values)} budgets for {len(microbatches)} micro-batches")
        if value is None:
            value = self.base if not values else float(np.mean(values))
        self.value = float(value)
        self.values = np.full(len(microbatches), self.value) if values is None else np.asarray(values, dtype=float)
        """``(M,)`` each micro-batch's step-level budget."""
        span = (float(min(self.value, *self.values)), float(max(self.value, *self.values)))
        self.lo, self.hi = budget_range(knob, config, span, microbatches)
        if not self.lo <= span[0] <= span[1] <= self.hi and config.mode != "off":
            raise ValueError(f"budget {self.value} (per micro-batch {self.values}) outside [{self.lo}, {self.hi}]")
        self.budget = knob.budget(budget or Budget(top_k=0), self.value)
        if knob.integer:
            grid = tuple(range(int(self.lo), int(self.base) + 1))
        else:
            grid = tuple(np.linspace(self.lo, self.base, 2 ** max(config.layer_probes - 2, 1) + 1).tolist())
        self._bound = (grid, knob.budget(self.budget, self.base))
        """The coverage bound's candidates: every whole k of ``[lo, base]`` (top-k), an even
        grid of ``[lo, base]`` (gamma, on the device); and the base budget."""

        self.lengths = [np.asarray(mb.lengths, dtype=np.int64) for mb in microbatches]
        self.d0 = [np.asarray(mb.densities, dtype=np.float64) for mb in microbatches]
        num_layers = int(cost_model.num_layers)
        m = len(microbatches)
        attention, self.fixed = unit_seconds(microbatches, self.lengths, cost_model, knob, self.values)
        self.planned = attention[:, None] + self.fixed  # (M, L) predicted seconds at self.values
        self._chosen = np.zeros((m, num_layers), dtype=bool)
        self._predicted = np.full((m, num_layers), np.nan)  # at the chosen budget
        self._measured = np.full((m, num_layers), np.nan)
        self._records: dict[tuple[int, int], LayerRecord] = {}
        self._costs: list[dict[float, tuple[float, np.ndarray]]] = [{} for _ in range(m)]
        """Per micro-batch, top-k: attention seconds and densities at each k probed so far (a
        top-k density follows from the lengths: every layer of a micro-batch shares them)."""
        self._spent = 0.0
        self._planned_left = float(self.planned.sum())
        """Running sums: seconds of the decided units, planned seconds of the others."""
        self._budgets: dict[float, Budget] = {}
        """The knob's budget at each value chosen so far (built once)."""
        self.decide_seconds = 0.0
        """Wall seconds spent in :meth:`choose` (DST's per-layer overhead)."""
        self.on_device = torch.device(device).type != "cpu" and self.budget.max_density is None
        """Coverage bound decided on the device (see ``device`` above; a capped budget's is read
        on the host); the layer's time is then accounted at ``v_time`` (a lower bound: later
        layers may be allotted a little more than the host decision would give them)."""
        self._stage_of: np.ndarray | None = None
        """``(L,)`` each layer's pipeline stage (:meth:`share_by_stage`); None: one process."""
        self._asked = np.ones(m, dtype=bool)
        self._over: np.ndarray | None = None
        """Per stage: what its decided units cost beyond the :func:`~.layer_ledger.replay`."""
        self._replay: tuple[float, Replay] | None = None
        self._plan_costs: list[dict[float, tuple[float, np.ndarray]]] = [{} for _ in range(m)]

    @classmethod
    def from_decision(
        cls,
        decision: RankDecision,
        microbatches: Sequence[MicroBatch],
        cost_model: CostModel,
        config: DSTConfig,
        budget: Budget | None = None,
        *,
        knob: Knob,
        device: torch.device | str,
    ) -> LayerController:
        """The controller for a rank's step-level :class:`RankDecision` (a pipeline's: one budget
        per micro-batch, ``decision.microbatch_budgets``)."""
        return cls(
            microbatches,
            cost_model,
            config,
            decision.target_seconds,
            value=decision.budget,
            knob=knob,
            budget=budget,
            device=device,
            values=decision.microbatch_budgets,
        )

    def share_by_stage(self, stage_of: Sequence[int], block_size: int, dense_from: float | None) -> None:
        """Budget as one stage of a pipeline (issue 54): ``stage_of`` ``(L,)`` gives each layer's
        stage, and a stage decides only its own layers. Each unit is allotted what it is allotted
        in one process that decides every layer (the rank's :func:`~.layer_ledger.replay`, from
        the plan), less what this stage's earlier units cost beyond theirs (a coverage bound's
        raise, a measured layer). Without such an event every stage decides exactly what one
        process decides for the same plan; an overspend is taken back from the stage's later
        units, which it alone sees (stages exchange no message about it). ``block_size`` and
        ``dense_from`` (the profile's crossover) tell which micro-batches no layer asks, as the
        attention context decides it."""
        stage_of = np.asarray(stage_of, dtype=np.int64)
        if stage_of.shape != (self.planned.shape[1],):
            raise ValueError(
                f"stage_of must give each of the {self.planned.shape[1]} layers a stage, got {stage_of.shape}"
            )
        self._stage_of = stage_of
        self._over = np.zeros(int(stage_of.max(initial=0)) + 1)
        self._asked = asked_microbatches(self.lowest_budget(), self.lengths, block_size, dense_from)
        self._replay = None
        t0 = time.perf_counter()
        self._ledger()  # now, before the forward: not inside its first layer
        self.decide_seconds += time.perf_counter() - t0

    def _plan_cost(self, microbatch: int, value: float) -> float:
        """Attention seconds of one layer of ``microbatch`` at ``value``, priced from the plan
        (the knob's densities)."""
        by_plan = self.knob.kind == "top-k" or self.on_device
        cache = self._costs[microbatch] if by_plan else self._plan_costs[microbatch]
        if value not in cache:
            lengths = self.lengths[microbatch]
            dens = self.knob.density(lengths, self.d0[microbatch], value)
            cache[value] = (float(np.sum(self.cost_model.layer_attention_seconds(lengths, dens))), dens)
        return cache[value][0]

    def _ledger(self) -> Replay:
        """The rank's replay at the current target (built at a stage's first decision)."""
        if self._replay is None or self._replay[0] != self.target_seconds:
            probes = self.config.layer_probes

            def choose(m: int, limit: float) -> tuple[float, float]:
                v = bisect(self.knob, lambda v: self._plan_cost(m, v) <= limit, self.lo, self.hi, probes)
                return v, self._plan_cost(m, v)

            ledger = replay(self.planned, self.fixed, self.target_seconds, self._asked, choose)
            self._replay = (self.target_seconds, ledger)
        return self._replay[1]

    def was_chosen(self, microbatch: int, layer: int) -> bool:
        """Whether unit (``microbatch``, ``layer``) was decided (a layer whose every budget keeps
        every causal block is not asked)."""
        self._check_unit(microbatch, layer)
        return bool(self._chosen[microbatch, layer])

    def lowest_budget(self) -> Budget:
        """The smallest budget :meth:`choose` may return (the knob at ``lo``)."""
        return self.knob.budget(self.budget, self.lo)

    def spent_seconds(self) -> float:
        """Seconds of the units decided so far: measured where observed, else predicted (a
        running sum, kept by :meth:`choose` and :meth:`observe`)."""
        return self._spent

    def choose(self, microbatch: int, layer: int, estimate: LayerGate, spent_seconds: float | None = None) -> Budget:
        """The budget for one attention layer of one micro-batch.

        Args:
            microbatch, layer: which unit (each is decided once, in any order).
            estimate: the layer's gate (:class:`LayerGate`: ``TopKGate`` or
                ``BlockMassEstimate``).
            spent_seconds: override for the seconds spent so far this step (e.g. wall clock);
                default :meth:`spent_seconds`.
        """
        self._check_unit(microbatch, layer)
        if self._chosen[microbatch, layer]:
            raise ValueError(f"unit (microbatch={microbatch}, layer={layer}) was already chosen")
        t0 = time.perf_counter()
        try:
            return self._choose(microbatch, layer, estimate, spent_seconds)
        finally:
            self.decide_seconds += time.perf_counter() - t0

    def _choose(self, microbatch, layer, estimate: LayerGate, spent_seconds) -> Budget:
        spent, left = self._spent, self._planned_left
        if self._stage_of is not None:  # a pipeline's stage: the rank's sums, from the plan
            ledger = self._ledger()
            spent = ledger.spent[microbatch, layer] + self._over[self._stage_of[layer]]
            left = ledger.left[microbatch, layer]
        spent = spent if spent_seconds is None else float(spent_seconds)
        share = self.planned[microbatch, layer] / left if left > 0 else 0.0
        allotted = (self.target_seconds - spent) * share
        limit = allotted - self.fixed[microbatch, layer]
        lengths = self.lengths[microbatch]
        # a top-k density follows from length and k; off the CPU gamma is priced as planned too
        by_plan = self.knob.kind == "top-k" or self.on_device
        cache = self._costs[microbatch] if by_plan else {}

        def cost(v: float) -> float:
            if v not in cache:
                if by_plan:
                    dens = self.knob.density(lengths, self.d0[microbatch], v)
                else:
                    budget = self.knob.budget(self.budget, v)
                    dens = document_densities(estimate, budget, lengths.size)
                att = float(np.sum(self.cost_model.layer_attention_seconds(lengths, dens)))
                cache[v] = (att, dens)
            return cache[v][0]

        probes = self.config.layer_probes
        value = bisect(self.knob, lambda v: cost(v) <= limit, self.lo, self.hi, probes)
        coverage, limited, floor = None, False, None
        if value < self.base and self.config.p < 1 and not estimate.keeps_whole(self._budget(value)):
            if self.on_device:
                grid, base = self._bound
                # a non-finite gate (NaN coverage) finds no k within the bound: the base
                index = estimate.coverage_floor(base, grid, self.config.p)[0].clamp(max=len(grid) - 1)
                if self.knob.integer:
                    floor = index + grid[0]
                else:  # the grid is even: its index to gamma on the device
                    step = (grid[-1] - grid[0]) / (len(grid) - 1)
                    floor = index.to(torch.float64) * step + grid[0]
            else:
                v_cov, coverage = self._coverage_floor(estimate, value)
                limited = v_cov > value
                value = max(value, v_cov)
        cost(value)
        attention, dens = cache[value]
        predicted = attention + self.fixed[microbatch, layer]
        weights = lengths.astype(np.float64) ** 2
        density = float(weights @ dens / weights.sum()) if weights.sum() else 1.0
        self._chosen[microbatch, layer] = True
        self._predicted[microbatch, layer] = predicted
        self._spent += predicted
        self._planned_left -= float(self.planned[microbatch, layer])
        if self._stage_of is not None:
            self._over[self._stage_of[layer]] += predicted - self._ledger().cost[microbatch, layer]
        self._records[(microbatch, layer)] = LayerRecord(
            microbatch,
            layer,
            value,
            density,
            predicted,
            allotted,
            coverage=coverage,
            limited_on_host=limited,
            floor=floor,
        )
        budget = self._budget(value)
        return budget if floor is None else replace(budget, floor=floor)

    def _budget(self, value: float) -> Budget:
        """The knob's budget at ``value`` (built once per value)."""
        if value not in self._budgets:
            self._budgets[value] = self.knob.budget(self.budget, value)
        return self._budgets[value]

    def _coverage_floor(self, estimate: LayerGate, value: float) -> tuple[float, float]:
        """``(v_cov, coverage at max(value, v_cov))``: the smallest budget in ``[lo, base]``
        within the coverage bound ``C(base) - C(v) <= p`` of the layer's gate, on the host.
        Top-k: every whole k of the range at once (one read-back); gamma: a bisection of
        ``layer_probes`` coverages."""
        base = self.knob.budget(self.budget, self.base)
        if self.knob.integer:
            ks, base = self._bound
            first = min(int(estimate.coverage_floor(base, ks, self.config.p)[0]), len(ks) - 1)  # NaN: the base
            cov = estimate.coverage_curve(base, ks)
            return float(ks[first]), float(cov[max(first, int(np.searchsorted(ks, value)))])

        def cov(v: float) -> float:
            return float(estimate.coverage(self.knob.budget(self.budget, v)))

        floor_c = cov(self.base) - self.config.p
        v_cov = bisect(
            self.knob, lambda v: cov(v) >= floor_c, self.lo, self.base, self.config.layer_probes, largest=False
        )
        return v_cov, cov(max(value, v_cov))

    def observe(self, microbatch: int, layer: int, seconds: float) -> None:
        """Report what a chosen unit actually cost (forward + backward seconds)."""
        self._check_unit(microbatch, layer)
        if not self._chosen[microbatch, layer]:
            raise ValueError(f"unit (microbatch={microbatch}, layer={layer}) was never chosen")
        if not np.isfinite(seconds) or seconds < 0:
            raise ValueError(f"seconds must be finite and >= 0, got {seconds}")
        before = self._measured[microbatch, layer]
        if np.isnan(before):
            before = self._predicted[microbatch, layer]
        self._spent += float(seconds) - float(before)
        if self._stage_of is not None:
            self._over[self._stage_of[layer]] += float(seconds) - float(before)
        self._measured[microbatch, layer] = seconds
        key = (microbatch, layer)
        self._records[key] = replace(self._records[key], measured_seconds=float(seconds))

    def _chosen_values(self) -> dict[tuple[int, int], float]:
        """Every decided unit's knob value, device floors read back together (one read)."""
        keys = [k for k, r in self._records.items() if r.floor is not None]
        floors = torch.stack([self._records[k].floor for k in keys]).tolist() if keys else []
        read = dict(zip(keys, floors, strict=True))
        return {k: max(r.budget, read[k]) if k in read else r.budget for k, r in self._records.items()}

    @property
    def num_coverage_limited(self) -> int:
        """Decisions where the coverage bound stopped a cut the time target asked for (device
        floors are read here, at the step's end, in one read)."""
        chosen = self._chosen_values()
        return sum(
            int(chosen[k] > r.budget if r.floor is not None else r.limited_on_host) for k, r in self._records.items()
        )

    @property
    def records(self) -> list[LayerRecord]:
        """The decisions so far, in (micro-batch, layer) order."""
        return [self._records[k] for k in sorted(self._records)]

    def summary(self) -> RankRunSummary:
        """Per-layer budget min/mean/max, realized density and seconds of the decided units;
        units never decided count with their planned seconds."""
        if not self._records:
            raise ValueError("no unit was chosen yet")
        values = np.full(self._chosen.shape, np.nan)
        dens = []
        for (m, layer), chosen in self._chosen_values().items():
            values[m, layer] = chosen
            dens.append(self._records[(m, layer)].density)
        predicted = np.where(self._chosen, self._predicted, self.planned)
        measured = np.where(np.isnan(self._measured), predicted, self._measured)
        with warnings.catch_warnings():  # layers no micro-batch decided yet are all-NaN
            warnings.simplefilter("ignore", RuntimeWarning)
            per_layer = [np.nanmin(values, 0), np.nanmean(values, 0), np.nanmax(values, 0)]
        chosen = values[self._chosen]
        return RankRunSummary(
            target_seconds=self.target_seconds,
            predicted_seconds=float(predicted.sum()),
            measured_seconds=float(measured.sum()),
            budget_min=float(chosen.min()),
            budget_mean=float(chosen.mean()),
            budget_max=float(chosen.max()),
            layer_budget_min=tuple(float(x) for x in per_layer[0]),
            layer_budget_mean=tuple(float(x) for x in per_layer[1]),
            layer_budget_max=tuple(float(x) for x in per_layer[2]),
            density_mean=float(np.mean(dens)),
        )

    def _check_unit(self, microbatch: int, layer: int) -> None:
        m, num_layers = self._chosen.shape
        if not (0 <= microbatch < m and 0 <= layer < num_layers):
            raise ValueError(
                f"unit (microbatch={microbatch}, layer={layer}) outside the step's "
                f"{m} micro-batches x {num_layers} layers"
            )
