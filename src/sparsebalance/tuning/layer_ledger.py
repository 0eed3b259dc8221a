"""What the layer controller (:mod:`.layer`) asks of a layer's gate and plans before its first
layer: each unit's predicted seconds, its budget range, and, for a pipeline's stage, the ledger
of the whole rank.

Pipelines (issue 54). A stage's process decides only its own layers, so a controller that
budgeted from its own running sums alone saw the other stages' layers as never spent: PP2 chose
other budgets than PP1 for the same plan. :func:`replay` runs the controller's rule over every
unit of the rank, in the order one process decides them (micro-batch by micro-batch, layer by
layer), from the plan alone (no gate: each unit at the largest budget its allotment allows, as
no coverage bound had raised it). A stage then reads the spent and remaining seconds at its unit
from that replay and adds what its own units cost beyond it (a coverage bound's raise, a measured
layer): with no such event the stage decides exactly what one process decides, and an event's
overspend is taken back from the stage's later units (the only ones it sees without a message).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ..ops import Budget, topk_density
from ..workload import CostModel, MicroBatch
from .config import DSTConfig
from .knob import Knob, converged, midpoint


class LayerGate(Protocol):
    """What the controller asks of one layer's gate (``ops.TopKGate``, ``ops.BlockMassEstimate``):
    the estimated block mass of the layer's real queries and keys, for any budget."""

    def document_density(self, budget: Budget) -> torch.Tensor:
        """float64 ``(N,)``: per-document density of the layout ``budget`` keeps."""

    def coverage(self, budget: Budget) -> float:
        """The gate mass ``budget`` keeps, mean over heads and tokens (one read back)."""

    def coverage_curve(self, budget: Budget, ks: Sequence[int]) -> np.ndarray:
        """float64 ``(K,)``: the coverage of ``budget``'s anchors at every k of ``ks`` (host)."""

    def coverage_floor(self, budget: Budget, ks: Sequence[float], p: float) -> torch.Tensor:
        """int64 ``(1,)`` device: the index in ``ks`` (knob values, ascending, the last the base)
        of the smallest one whose coverage is within ``p`` of the last's (no read back)."""

    def keeps_whole(self, budget: Budget) -> bool:
        """Whether ``budget`` keeps every document of the layer's pack whole (host; then no
        coverage is lost and the gate need not be computed at all)."""


def document_densities(estimate: LayerGate, budget: Budget, num_docs: int) -> np.ndarray:
    """``(N,)`` float64 densities of the layout ``budget`` keeps (one read back: gamma only)."""
    dd = np.asarray(estimate.document_density(budget).detach().cpu(), dtype=np.float64)
    dd = dd.reshape(-1)
    if dd.size != num_docs:
        raise ValueError(f"the layer's layout has {dd.size} documents, the micro-batch has {num_docs}")
    return dd


@dataclass(frozen=True)
class Replay:
    """:func:`replay`'s ``(M, L)`` arrays, one entry per unit."""

    spent: np.ndarray
    """Seconds spent before the unit (the replay's running sum when it is decided)."""
    left: np.ndarray
    """Planned seconds of the units not yet decided, the unit included."""
    cost: np.ndarray
    """The unit's predicted seconds at its replayed budget (0 for a micro-batch never asked)."""


def replay(
    planned: np.ndarray,
    fixed: np.ndarray,
    target: float,
    asked: np.ndarray,
    choose: Callable[[int, float], tuple[float, float]],
) -> Replay:
    """The controller's running sums over every unit of ``planned`` ``(M, L)`` in decision order,
    for ``target`` seconds: unit (m, l) is allotted ``(target - spent) x planned / left`` and
    ``choose(m, limit)`` returns its budget's ``(value, attention seconds)`` within ``limit`` =
    allotment - ``fixed[m, l]``. Micro-batches outside ``asked`` (bool ``(M,)``: their every
    document is kept whole, no layer asks) neither spend nor leave the sums, as in one process.
    The same float operations in the same order as :meth:`LayerController.choose`."""
    m, num_layers = planned.shape
    out = Replay(np.zeros((m, num_layers)), np.zeros((m, num_layers)), np.zeros((m, num_layers)))
    spent, left = 0.0, float(planned.sum())
    for i in range(m):
        for layer in range(num_layers):
            out.spent[i, layer], out.left[i, layer] = spent, left
            if not asked[i]:
                continue
            share = planned[i, layer] / left if left > 0 else 0.0
            _, attention = choose(i, (target - spent) * share - fixed[i, layer])
            cost = attention + fixed[i, layer]
            out.cost[i, layer] = cost
            spent += cost
            left -= float(planned[i, layer])
    return out


def asked_microbatches(
    budget: Budget, lengths: Sequence[np.ndarray], block_size: int, dense_from: float | None
) -> np.ndarray:
    """Bool ``(M,)``: the micro-batches whose layers ask the controller, i.e. not every document
    is kept whole at ``budget`` (the controller's lowest; :meth:`Budget.dense_documents` on the
    pack of ``lengths``, packed in order: what :class:`~sparsebalance.models.attention.
    PackedAttention` decides from the same host facts)."""
    out = np.ones(len(lengths), dtype=bool)
    for i, n in enumerate(lengths):
        n = np.asarray(n, dtype=np.int64)
        if n.size == 0:
            continue
        off = np.concatenate([[0], np.cumsum(n)])
        dense = budget.covers((off[1:] - 1) // block_size - off[:-1] // block_size + 1)
        if dense_from is not None and budget.top_k is not None and budget.max_density is None:
            dense = dense | (
                topk_density(n.astype(np.float64), budget.top_k, block_size, budget.anchor_blocks) >= dense_from
            )
        out[i] = not bool(np.all(dense))
    return out


def bisect(
    knob: Knob,
    ok: Callable[[float], bool],
    lo: float,
    hi: float,
    probes: int,
    largest: bool = True,
) -> float:
    """The largest (smallest) value in ``[lo, hi]`` with ``ok``, for a monotone ``ok``, in at
    most ``probes`` evaluations (2 at the ends, the rest bisecting; whole k for top-k); ``lo``
    (``hi``) when even that end fails. Only an evaluated-feasible value is returned, or the
    fallback end."""
    near, far = (lo, hi) if largest else (hi, lo)
    if lo == hi or ok(far):
        return far
    if not ok(near):
        return near
    a, b = float(lo), float(hi)  # invariant: ok at the `near` end, not at the `far` end
    for _ in range(probes - 2):
        if converged(knob, a, b, integer=True):
            break
        mid = float(midpoint(knob, a, b, integer=True))
        good = ok(mid)
        if largest:
            a, b = (mid, b) if good else (a, mid)
        else:
            a, b = (a, mid) if good else (mid, b)
    return a if largest else b


def budget_range(
    knob: Knob, config: DSTConfig, span: tuple[float, float], microbatches: Sequence[MicroBatch]
) -> tuple[float, float]:
    """``[lo, hi]``: the budgets a layer may run (the base alone when DST is off; the step-level
    budgets' ``span`` (min, max) inside)."""
    base = float(knob.base)
    if config.mode == "off":
        return base, base
    longest = max((max(mb.lengths) for mb in microbatches if mb.lengths), default=0)
    upper = float(knob.upper(np.array([longest]))[0])
    hi = upper if config.mode == "bidirectional" else base
    lo = base if config.p == 0 else float(knob.lo)
    lo, hi = min(lo, span[0]), max(hi, span[1])
    if knob.integer:  # a layer runs a whole k; the step's value may be a mean over layers
        lo, hi = float(math.floor(lo)), float(math.ceil(hi))
    return lo, hi


def unit_seconds(
    microbatches: Sequence[MicroBatch],
    lengths: Sequence[np.ndarray],
    cost_model: CostModel,
    knob: Knob,
    values: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Predicted seconds at each micro-batch's budget ``values[m]``: ``(M,)`` attention per
    layer, ``(M, L)`` the rest."""
    num_layers = int(cost_model.num_layers)
    attention = np.zeros(len(microbatches))
    fixed = np.zeros((len(microbatches), num_layers))
    for i, mb in enumerate(microbatches):
        d0 = np.asarray(mb.densities, dtype=np.float64)
        dens = knob.density(lengths[i], d0, float(values[i]))
        attention[i] = np.sum(cost_model.layer_attention_seconds(lengths[i], dens))
        fixed[i, :] = cost_model.layer_other_seconds(mb.num_tokens)
        # Layer 0 also carries what is outside the layers (embedding, head, loss), defined so
        # that the units of a micro-batch add up to exactly the model's prediction for it.
        total = cost_model.predict(lengths[i], dens)
        fixed[i, 0] += max(total - num_layers * attention[i] - fixed[i].sum(), 0.0)
    return attention, fixed
