"""The step's stages every front end runs the same way: plan (SAB), tune (DST), the rank's layer
controller, and the attention context of one packed micro-batch (its budget, DST's per-layer
choices, the layer timer of DST's closed loop).

Pure functions of their arguments: :class:`~.planning.StepEngine` holds what they read (latency
model, estimator, tuner) and the own trainer's :class:`~.step.StepRunner`, the integrations'
planner and sampler call them through it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from ..batching import DensityEstimator, PlanConfig, plan_batch
from ..latency import LatencyModel
from ..models.attention import PackedAttention
from ..ops import Budget
from ..tuning import DSTConfig, DSTTuner, Knob, LayerController, decide_units
from ..workload import CostModel, MicroBatch, Sample
from .cp_unit import pass_schedule
from .records import StepPlan, TunedStep

BACKWARD_RATIO = 3.0  # forward + backward ~ 3x forward: prices a layer before its backward runs


def label_weight(mb: MicroBatch, per_doc_weighting: bool) -> float:
    """Total loss weight of a micro-batch (what its loss sum is normalised by)."""
    if per_doc_weighting:
        return float(sum(1 for n in mb.lengths if n > 1))
    return float(sum(n - 1 for n in mb.lengths))


def check_plan_agreement(hashes: list[str], plan) -> None:
    """Raise ``RuntimeError`` unless every rank's plan hash (``hashes[r]``) is the same, naming
    the ranks that differ from the majority and the CP units (of this rank's plan) they are in."""
    if len(set(hashes)) == 1:
        return
    common = max(set(hashes), key=lambda h: (hashes.count(h), h))
    odd = [r for r, h in enumerate(hashes) if h != common]
    units = [f"unit {u.slot} (ranks {list(u.ranks)})" for u in plan.units if set(u.ranks) & set(odd)]
    where = f"; CP units they take part in: {', '.join(units)}" if units else ""
    raise RuntimeError(
        f"ranks {odd} derived a different plan from the other ranks (hashes {hashes}): their "
        f"inputs diverged, the step is stopped{where}"
    )


def plan_step(
    samples: list[Sample],
    cost: CostModel,
    pcfg: PlanConfig,
    estimator: DensityEstimator,
    all_gather: Callable[[object], list],
    per_doc_weighting: bool = False,
) -> StepPlan:
    """Stage 1 (SAB): plan the global batch ``samples``, check with one ``all_gather``
    (``obj -> [obj of every rank]``) that every rank derived the same plan, and count the global
    loss weight (every unit once)."""
    plan = plan_batch(samples, cost, pcfg, estimator=estimator)
    hashes = all_gather(plan.hash())
    check_plan_agreement(hashes, plan)
    units, rank_units = plan.execution()
    # Every unit once (a CP unit appears in each of its ranks' lists).
    weight = sum(label_weight(MicroBatch(u.sample_ids, u.lengths, u.densities), per_doc_weighting) for u in units)
    return StepPlan(plan, hashes[0], weight, units, rank_units, pass_schedule(units, rank_units))


def tune_step(
    planned: StepPlan,
    tuner: DSTTuner,
    latency: LatencyModel,
    cost: CostModel | None,
    world_size: int,
) -> TunedStep:
    """Stage 2 (DST): a budget per rank (per worker with CP units, priced by ``cost``, else
    ``latency``) and the loss scale ``world_size / global weight``."""
    plan = planned.plan
    t0 = time.perf_counter()
    # with CP units the workers are ranks joined by units, one budget each
    decision = decide_units(tuner, plan, cost or latency) if plan.units else tuner.decide(plan.ranks, latency)
    return TunedStep(planned, decision, world_size / max(planned.global_weight, 1e-9), time.perf_counter() - t0)


def rank_controller(
    step: TunedStep,
    rank: int,
    latency: LatencyModel,
    dst: DSTConfig,
    knob: Knob,
    device: torch.device,
) -> LayerController | None:
    """DST's closed-loop layer controller for rank ``rank``'s one-rank micro-batches of ``step``
    (None with ``mode="off"`` or when the rank has none), deciding for ``device`` (the run's).
    Micro-batch ``m`` of the controller is the rank's m-th one-rank micro-batch in plan order."""
    planned = step.planned
    plan, units = planned.plan, planned.units
    solo = [plan.ranks[rank][j] for j, u in enumerate(planned.rank_units[rank]) if units[u].degree == 1]
    if dst.mode == "off" or not solo:
        return None
    controller = LayerController.from_decision(step.decision.ranks[rank], solo, latency, dst, knob=knob, device=device)
    if len(solo) < len(plan.ranks[rank]):  # its CP units are not the controller's
        controller.target_seconds = float(controller.planned.sum())
    return controller


def layer_feedback(dst: DSTConfig, deterministic: bool, device: torch.device | str) -> bool:
    """Whether DST's closed loop gets measured layer times: host times mean the layer's time
    only where the host does the work (CPU), and never in a deterministic run."""
    return bool(dst.layer_feedback) and not deterministic and torch.device(device).type == "cpu"


class LayerTimer:
    """DST's closed loop inside a forward: each attention layer's host time since the previous
    one (x :data:`BACKWARD_RATIO`, its forward + backward) fed to the controller as micro-batch
    ``m``'s measured layer; the first layer's only if :meth:`start` stamped the micro-batch's
    start (a collator builds the context long before the forward). Host times mean anything only
    where the host does the work: callers enable it on CPU outside deterministic runs."""

    def __init__(self, controller: LayerController | None, m: int, enabled: bool) -> None:
        self.controller, self.m = controller, m
        self.enabled = enabled and controller is not None
        self.last: float | None = None

    def start(self, host_time: float) -> None:
        self.last = host_time

    def __call__(self, layer: int) -> None:
        now = time.perf_counter()
        if self.enabled and self.last is not None and self.controller.was_chosen(self.m, layer):
            self.controller.observe(self.m, layer, (now - self.last) * BACKWARD_RATIO)
        self.last = now


def microbatch_attention(
    cu_seqlens: torch.Tensor,
    lengths: Sequence[int],
    budget: Budget,
    block_size: int,
    backend: str,
    controller: LayerController | None = None,
    m: int = 0,
    timer: LayerTimer | None = None,
    dense_from: float | None = None,
) -> PackedAttention:
    """The attention context of micro-batch ``m`` (its documents' ``lengths`` on the host):
    ``budget`` for every layer, or DST's per-layer choice when a ``controller`` is given; the
    ``timer`` sees each layer's end; ``dense_from``: the latency profile's crossover (documents
    from that density run whole on the dense kernel). What the own executor and the
    integrations' collator build."""
    choose, low = None, None
    if controller is not None:
        choose = lambda layer, e: controller.choose(m, layer, e)  # noqa: E731
        low = controller.lowest_budget()
    return PackedAttention(
        cu_seqlens,
        budget,
        block_size,
        backend,
        choose_budget=choose,
        on_layer_end=timer,
        lengths=tuple(int(n) for n in lengths),
        min_budget=low,
        dense_from=dense_from,
    )
