"""Pipeline parallelism in the simulator: the exact makespan of a 1F1B schedule over PP stages.

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
(:func:`stage_seconds`): the L transformer layers are split into P contiguous stages of
``L // P`` layers, the first ``L % P`` stages one layer more (the LM head and loss sit on the last
stage, which therefore gets the fewest layers); a stage's time is its layers' share of the
micro-batch's per-layer time (attention at the micro-batch's densities plus the rest of the
layer) plus, on the last stage, the latency model's head term (the embedding lookup is
negligible and not priced). Forward : backward is split at a fixed ratio, backward = 2 x forward
by default (:data:`BACKWARD_RATIO`: two GEMMs per forward GEMM), since the latency model
predicts forward + backward together.

Not modelled: send/receive of activations between stages (taken as free, overlapped), the
interleaved (virtual-stage) schedule, memory limits of the warm-up's in-flight activations.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..workload import CostModel

BACKWARD_RATIO = 2.0
"""Backward seconds per forward second, when the latency model gives only their sum."""


@dataclass(frozen=True)
class PipelineResult:
    """One pipeline's step: ``makespan`` seconds, ``busy`` and ``bubble`` ``(P,)`` seconds per
    stage (``busy + bubble == makespan``)."""

    makespan: float
    busy: np.ndarray
    bubble: np.ndarray


def schedule_order(num_stages: int, num_micro_batches: int, stage: int) -> list[tuple[str, int]]:
    """Stage ``stage``'s ops in 1F1B order: ``("F", m)`` / ``("B", m)``."""
    m = num_micro_batches
    warm = min(num_stages - stage - 1, m)
    order = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        order += [("F", warm + i), ("B", i)]
    order += [("B", i) for i in range(m - warm, m)]
    return order


def one_f_one_b(forward: np.ndarray, backward: np.ndarray) -> PipelineResult:
    """Exact makespan of the non-interleaved 1F1B schedule.

    Args:
        forward, backward: float ``(M, P)`` seconds of micro-batch m's forward / backward on stage
            s (>= 0, finite).

    Returns:
        :class:`PipelineResult`. Cost: each of the 2 M P ops is placed once; sweeps over the
        stages repeat until all are placed (at most 2 M P sweeps, a few in practice).
    """
    f = np.asarray(forward, dtype=np.float64)
    b = np.asarray(backward, dtype=np.float64)
    if f.ndim != 2 or f.shape != b.shape or f.shape[0] < 1 or f.shape[1] < 1:
        raise ValueError(f"forward and backward must both be (M, P) with M, P >= 1, got {f.shape} and {b.shape}")
    if not (np.all(np.isfinite(f)) and np.all(np.isfinite(b)) and (f >= 0).all() and (b >= 0).all()):
        raise ValueError("forward and backward seconds must be finite and >= 0")
    m, p = f.shape
    orders = [schedule_order(p, m, s) for s in range(p)]
    end = {"F": np.full((m, p), np.nan), "B": np.full((m, p), np.nan)}
    nxt = [0] * p  # next op index per stage
    free = [0.0] * p  # when each stage finishes its previous op
    left = 2 * m * p
    while left:
        progressed = False
        for s in range(p):
            while nxt[s] < len(orders[s]):
                kind, mb = orders[s][nxt[s]]
                if kind == "F":
                    ready = 0.0 if s == 0 else end["F"][mb, s - 1]
                    dur = f[mb, s]
                else:
                    ready = end["F"][mb, s] if s == p - 1 else end["B"][mb, s + 1]
                    dur = b[mb, s]
                if np.isnan(ready):  # its input is not computed yet: another stage first
                    break
                start = max(free[s], ready)
                free[s] = end[kind][mb, s] = start + dur
                nxt[s] += 1
                left -= 1
                progressed = True
        assert progressed, "1F1B dependencies form a cycle"  # cannot happen for this order
    makespan = float(max(free))
    busy = f.sum(axis=0) + b.sum(axis=0)
    return PipelineResult(makespan, busy, makespan - busy)


def stage_layers(num_layers: int, num_stages: int) -> np.ndarray:
    """``(P,)`` layers per stage: ``L // P`` each, the first ``L % P`` stages one more."""
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"--pp must be an integer >= 1, got {num_stages!r}")
    if num_stages > num_layers:
        raise ValueError(f"--pp {num_stages}: more pipeline stages than the model's {num_layers} layers")
    out = np.full(num_stages, num_layers // num_stages, dtype=np.int64)
    out[: num_layers % num_stages] += 1
    return out


def stage_seconds(cost_model: CostModel, lengths: np.ndarray, densities: np.ndarray, num_stages: int) -> np.ndarray:
    """``(M, P)`` forward + backward seconds of each micro-batch on each stage.

    Args:
        lengths: int ``(M, K)`` documents per micro-batch (0 = empty slot); densities ``(M, K)``.

    Each row sums to ``cost_model.predict_many(lengths, densities)`` (up to rounding): per-layer
    time x the stage's layers, and the remainder (the head term) on the last stage.
    """
    lengths = np.asarray(lengths)
    densities = np.asarray(densities, dtype=np.float64)
    layers = stage_layers(cost_model.num_layers, num_stages)
    total = np.asarray(cost_model.predict_many(lengths, densities), dtype=np.float64)
    valid = lengths > 0
    attn = np.zeros(lengths.shape)
    attn[valid] = cost_model.layer_attention_seconds(lengths[valid], densities[valid])
    rest = np.array([cost_model.layer_other_seconds(int(t)) for t in lengths.sum(axis=-1).tolist()])
    per_layer = attn.sum(axis=-1) + rest  # (M,)
    head = np.maximum(total - cost_model.num_layers * per_layer, 0.0)
    out = per_layer[:, None] * layers[None, :].astype(np.float64)
    out[:, -1] += head
    return out


def split_forward_backward(seconds: np.ndarray, ratio: float = BACKWARD_RATIO) -> tuple[np.ndarray, np.ndarray]:
    """``seconds`` (forward + backward) -> (forward, backward) at backward = ``ratio`` x forward."""
    if not (np.isfinite(ratio) and ratio >= 0):
        raise ValueError(f"backward ratio must be finite and >= 0, got {ratio}")
    forward = np.asarray(seconds, dtype=np.float64) / (1.0 + ratio)
    return forward, forward * ratio


def pipeline_record(work, values: np.ndarray, num_stages: int, ratio: float = BACKWARD_RATIO) -> dict:
    """A simulated step's pipeline numbers for a :class:`~sparsebalance.tuning.PlanWorkload`
    priced at per-rank knob values ``(R,)``: what the engine's record reads instead of rank sums.

    Returns: ``compute`` (slowest pipeline's makespan), ``mean_rank`` (mean makespan),
    ``rank_times`` ``(R,)`` makespans, ``device_idle`` (mean idle share of the R x P devices in
    the step, all-reduce excluded) and ``mb_imbalance`` (max / mean micro-batch time, the
    paper's imbalance).
    """
    r = work.num_ranks
    makespans = np.zeros(r)
    busy = np.zeros((r, num_stages))
    mb_times: list[np.ndarray] = []
    for g in work.groups:
        dens = work.knob.density(g.lengths, g.d0, values[g.ranks][:, None, None])
        for i, rank in enumerate(g.ranks.tolist()):
            st = stage_seconds(work.cost_model, g.lengths[i], dens[i], num_stages)
            res = one_f_one_b(*split_forward_backward(st, ratio))
            makespans[rank] = res.makespan
            busy[rank] = res.busy
            mb_times.append(st.sum(axis=1))
    compute = float(makespans.max())
    mbs = np.concatenate(mb_times) if mb_times else np.zeros(1)
    return {
        "compute": compute,
        "mean_rank": float(makespans.mean()),
        "rank_times": makespans,
        "device_idle": float(1.0 - busy.mean() / compute) if compute > 0 else 0.0,
        "mb_imbalance": float(mbs.max() / mbs.mean()) if mbs.mean() > 0 else 1.0,
    }
