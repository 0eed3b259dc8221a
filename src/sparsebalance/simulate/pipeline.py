"""Pipeline parallelism in the simulator: the exact makespan of a pipeline schedule over PP
stages (1F1B, interleaved 1F1B or zero-bubble ZB-H1).

A data-parallel rank with ``--pp P`` is a pipeline of P stages (devices). Each of its M
micro-batches runs a forward on stage 0, 1, ..., P-1 and then a backward on stage P-1, ..., 0.
Every stage runs its ops in the non-interleaved 1F1B order (PyTorch's ``Schedule1F1B``,
Megatron-LM's default): a warm-up of ``min(P - s - 1, M)`` forwards, then alternately one forward
and one backward, then the remaining backwards (cool-down).

Makespan (:func:`one_f_one_b`): an op starts when the previous op of its stage has finished and
its input is there, the forward of micro-batch m on stage s-1 (a forward) or the backward of m
on stage s+1 (a backward; on the last stage, its own forward); the recurrence is solved exactly,
so heterogeneous micro-batches make the bubbles they make. With equal times f and b the
makespan is ``(M + P - 1) (f + b)``; with P = 1 it is the sum of all ops.

How a micro-batch's predicted time (forward + backward, from the latency model) is divided
(:func:`stage_seconds`): the L transformer layers are split into P contiguous stages, the given
split (``stage_layers``: the trainer's, :func:`~sparsebalance.batching.schedule.balanced_layers`,
which gives the stage holding the LM head and loss fewer layers) or, when none is given, ``L // P``
layers each, the first ``L % P`` stages one more; a stage's time is its layers' share of the
micro-batch's per-layer time (attention at the micro-batch's densities plus the rest of the
layer) plus, on the last stage, the latency model's head term (the embedding lookup is
negligible and not priced). Forward : backward is split at a fixed ratio, backward = 2 x forward
by default (:data:`BACKWARD_RATIO`: two GEMMs per forward GEMM), since the latency model
predicts forward + backward together.

Interleaved 1F1B (``virtual`` V > 1, ``--pp-virtual``): the layers are split into P V virtual
stages (``stage_layers`` then has P V entries), virtual stage k runs on device ``k % P``, and the
makespan is the exact interleaved one (:mod:`sparsebalance.batching.interleaved`); a device's busy
time sums its V chunks.

Zero bubble ZB-H1 (``weight_share`` given, ``--pp-schedule zb-h1``, V = 1): each stage's backward
is split into B (the input's gradient, ``1 - weight_share`` of it) and W (the weights', which
nobody waits for), run in ZB-H1's per-stage order; the makespan is the exact one
(:mod:`sparsebalance.batching.zero_bubble`), a device's busy time its F + B + W seconds (the same
work as 1F1B's, in less time).

Not modelled: send/receive of activations between stages (taken as free, overlapped; interleaving
sends V times as many), memory limits of the warm-up's in-flight activations.

The schedule's math (:func:`one_f_one_b`, the vectorised :func:`makespans`) lives in
:mod:`sparsebalance.batching.schedule`, shared with the planner (SAB) and DST, which use the same
makespan when ``pipeline_stages > 1``; it is re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..batching import interleaved, zero_bubble
from ..batching.schedule import (
    BACKWARD_RATIO,
    PipelineResult,
    head_seconds,
    makespans,
    one_f_one_b,
    resolve_layers,
    schedule_order,
    split_forward_backward,
    stage_layers,
)
from ..workload import CostModel

__all__ = [
    "BACKWARD_RATIO",
    "PipelineResult",
    "makespans",
    "one_f_one_b",
    "pipeline_record",
    "pipeline_result",
    "schedule_order",
    "split_forward_backward",
    "stage_layers",
    "stage_seconds",
]


def stage_seconds(
    cost_model: CostModel,
    lengths: np.ndarray,
    densities: np.ndarray,
    num_stages: int,
    stage_layers: tuple[int, ...] = (),
) -> np.ndarray:
    """``(M, P)`` forward + backward seconds of each micro-batch on each stage.

    Args:
        lengths: int ``(M, K)`` documents per micro-batch (0 = empty slot); densities ``(M, K)``.
        stage_layers: layers per stage (P entries summing to L); empty: the even split.

    Each row sums to ``cost_model.predict_many(lengths, densities)`` (up to rounding): per-layer
    time x the stage's layers, and the remainder (the head term,
    :func:`~sparsebalance.batching.schedule.head_seconds`) on the last stage.
    """
    lengths = np.asarray(lengths)
    densities = np.asarray(densities, dtype=np.float64)
    layers = resolve_layers(cost_model.num_layers, num_stages, stage_layers)
    total = np.asarray(cost_model.predict_many(lengths, densities), dtype=np.float64)
    head = head_seconds(cost_model, lengths, densities, total)
    per_layer = (total - head) / cost_model.num_layers
    out = per_layer[:, None] * layers[None, :].astype(np.float64)
    out[:, -1] += head
    return out


def pipeline_result(
    forward: np.ndarray, backward: np.ndarray, virtual: int = 1, weight_share: float | None = None
) -> PipelineResult:
    """One pipeline's exact makespan and per-device busy and bubble seconds: ``forward`` and
    ``backward`` float ``(M, P V)`` seconds per (virtual) stage; ``virtual`` V: interleaved 1F1B
    (each device's busy time sums its V chunks); ``weight_share``: ZB-H1 (V = 1), the backward
    split into B and W, W this share of it (busy: F + B + W); neither: :func:`one_f_one_b`."""
    if weight_share is not None:
        if virtual != 1:
            raise ValueError(f"zero bubble (weight_share) runs one chunk per device, got virtual {virtual}")
        f = np.asarray(forward, dtype=np.float64)
        b = np.asarray(backward, dtype=np.float64)
        b_input, b_weight = zero_bubble.split_backward(b, weight_share)
        makespan = float(zero_bubble.makespans(f[None], b_input[None], b_weight[None])[0])
        busy = f.sum(axis=0) + b_input.sum(axis=0) + b_weight.sum(axis=0)
        return PipelineResult(makespan, busy, makespan - busy)
    if virtual == 1:
        return one_f_one_b(forward, backward)
    f = np.asarray(forward, dtype=np.float64)
    b = np.asarray(backward, dtype=np.float64)
    makespan = float(interleaved.makespans(f[None], b[None], virtual)[0])
    busy = interleaved.rank_busy(f, b, virtual)
    return PipelineResult(makespan, busy, makespan - busy)


def pipeline_record(
    work,
    values: np.ndarray,
    num_stages: int,
    ratio: float = BACKWARD_RATIO,
    *,
    mb_values: Sequence[np.ndarray] | None = None,
    stage_layers: tuple[int, ...] = (),
    virtual: int = 1,
    weight_share: float | None = None,
) -> dict:
    """A simulated step's pipeline numbers for a :class:`~sparsebalance.tuning.PlanWorkload`
    priced at per-rank knob values ``(R,)``, or per micro-batch: ``mb_values`` (one ``(M_r,)``
    per rank, DST's budgets per micro-batch of a pipeline); what the engine's record reads
    instead of rank sums. ``stage_layers``: layers per (virtual) stage (empty: the even split);
    ``virtual``: V chunks per device, interleaved 1F1B (1: plain 1F1B); ``weight_share``: ZB-H1
    with W this share of a backward (None: 1F1B).

    Returns: ``compute`` (slowest pipeline's makespan), ``mean_rank`` (mean makespan),
    ``rank_times`` ``(R,)`` makespans, ``device_idle`` (mean idle share of the R x P devices in
    the step, all-reduce excluded), ``mb_imbalance`` (max / mean micro-batch time, the
    paper's imbalance) and ``stage_times``: per rank, ``(M_r, P V)`` forward + backward seconds
    per micro-batch and (virtual) stage (what another schedule can be priced on).
    """
    r = work.num_ranks
    makespans = np.zeros(r)
    busy = np.zeros((r, num_stages))
    mb_times: list[np.ndarray] = []
    stage_times: list[np.ndarray] = [np.zeros((0, num_stages * virtual))] * r
    for g in work.groups:
        if mb_values is None:
            per_mb = values[g.ranks][:, None, None]
        else:
            per_mb = np.stack([np.asarray(mb_values[r], dtype=np.float64) for r in g.ranks.tolist()])[..., None]
        dens = work.knob.density(g.lengths, g.d0, per_mb)
        for i, rank in enumerate(g.ranks.tolist()):
            st = stage_seconds(work.cost_model, g.lengths[i], dens[i], num_stages * virtual, stage_layers)
            res = pipeline_result(*split_forward_backward(st, ratio), virtual, weight_share)
            makespans[rank] = res.makespan
            busy[rank] = res.busy
            mb_times.append(st.sum(axis=1))
            stage_times[rank] = st
    compute = float(makespans.max())
    mbs = np.concatenate(mb_times) if mb_times else np.zeros(1)
    return {
        "compute": compute,
        "mean_rank": float(makespans.mean()),
        "rank_times": makespans,
        "device_idle": float(1.0 - busy.mean() / compute) if compute > 0 else 0.0,
        "mb_imbalance": float(mbs.max() / mbs.mean()) if mbs.mean() > 0 else 1.0,
        "stage_times": stage_times,
    }
