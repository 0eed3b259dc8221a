"""The 1F1B pipeline schedule and its exact makespan, shared by the planner (SAB), DST and the
simulator.

A data-parallel rank with P pipeline stages runs each of its M micro-batches forward on stage
0, 1, ..., P-1 and backward on P-1, ..., 0. Every stage runs its ops in the non-interleaved 1F1B
order (PyTorch's ``Schedule1F1B``, Megatron-LM's default): a warm-up of ``min(P - s - 1, M)``
forwards, then alternately one forward and one backward, then the remaining backwards.

An op starts when the previous op of its stage has finished and its input is there: the forward
of micro-batch m on stage s-1 (a forward) or its backward on stage s+1 (a backward; on the last
stage, its own forward). The recurrence is solved exactly, so heterogeneous micro-batches make
the bubbles they make; with equal times f and b the makespan is ``(M + P - 1) (f + b)``.
:func:`one_f_one_b` solves it for one pipeline; :func:`makespans` for many pipelines of the same
(M, P) at once (one numpy pass per op, in a dependency order computed once per (M, P)).

The layers are split into P contiguous stages. The even split (:func:`stage_layers`: ``L // P``
each, the first ``L % P`` stages one more) ignores the LM head on the last stage; the balanced one
(:func:`balanced_layers`, weighing the head by :func:`head_layers`) gives the last stage fewer
layers when the head costs more than a layer (Qwen2.5-3B at P = 4: 10/10/10/6, not 9/9/9/9).
Everything that prices or runs a pipeline takes one split (a ``stage_layers`` tuple; empty =
even; :func:`resolve_layers`). Forward : backward is a fixed ratio, backward = 2 x forward by
default (:data:`BACKWARD_RATIO`), since latency models predict their sum; a training run learns
the ratio and a time scale per stage from its measured stages
(:mod:`sparsebalance.engine.stage_calibration`) and prices with those.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..models import ModelShapes
from ..workload import CostModel, ManyOtherCost
from .levels import Levels, compile_levels, solve

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


def settled_sends(num_stages: int, num_micro_batches: int, stage: int) -> dict[tuple[str, int], list[tuple[str, int]]]:
    """Which of stage ``stage``'s sends each of its receives proves received, so a stage keeps
    only the sends still in flight (not every micro-batch's). Keys: this stage's receiving ops
    (``("F", m)``: the activations of m from ``stage - 1``; ``("B", m)``: their gradient from
    ``stage + 1``); values: its earlier sends, named by the op that sent them (``("F", j)``: j's
    activations to ``stage + 1``; ``("B", j)``: j's input gradient to ``stage - 1``), that the
    sender's own order received before sending this message."""
    p, m = num_stages, num_micro_batches
    out: dict[tuple[str, int], list[tuple[str, int]]] = {}
    sent: set[tuple[str, int]] = set()
    for op in schedule_order(p, m, stage):
        kind = op[0]
        peer = stage - 1 if kind == "F" else stage + 1  # who sends what this op receives
        if 0 <= peer < p:
            theirs = schedule_order(p, m, peer)
            before = theirs[: theirs.index(op)]
            mine = "B" if kind == "F" else "F"  # what we sent the peer: it received it at the same op
            out[op] = [k for k in before if k[0] == mine and k in sent]
            sent.difference_update(out[op])
        if (kind == "F" and stage < p - 1) or (kind == "B" and stage > 0):
            sent.add(op)
    return out


@lru_cache(maxsize=64)
def dependency_order(num_stages: int, num_micro_batches: int) -> tuple[tuple[str, int, int], ...]:
    """Every op ``(kind, micro-batch, stage)`` once, in an order where each op comes after the
    previous op of its stage and after its input (the sweep of :func:`one_f_one_b`; it does not
    depend on the ops' durations)."""
    p, m = num_stages, num_micro_batches
    orders = [schedule_order(p, m, s) for s in range(p)]
    done = {"F": np.zeros((m, p), dtype=bool), "B": np.zeros((m, p), dtype=bool)}
    nxt, out = [0] * p, []
    while len(out) < 2 * m * p:
        progressed = False
        for s in range(p):
            while nxt[s] < len(orders[s]):
                kind, mb = orders[s][nxt[s]]
                if kind == "F":
                    ready = s == 0 or done["F"][mb, s - 1]
                else:  # the last stage's backward follows its own forward
                    ready = done["F"][mb, s] if s == p - 1 else done["B"][mb, s + 1]
                if not ready:
                    break
                done[kind][mb, s] = True
                out.append((kind, mb, s))
                nxt[s] += 1
                progressed = True
        assert progressed, "1F1B dependencies form a cycle"  # cannot happen for this order
    return tuple(out)


def _check_times(f: np.ndarray, b: np.ndarray, ndim: int) -> None:
    if f.ndim != ndim or f.shape != b.shape or min(f.shape[-2:], default=0) < 1:
        shape = "(M, P)" if ndim == 2 else "(n, M, P)"
        raise ValueError(f"forward and backward must both be {shape} with M, P >= 1, got {f.shape} and {b.shape}")
    if not (np.all(np.isfinite(f)) and np.all(np.isfinite(b)) and (f >= 0).all() and (b >= 0).all()):
        raise ValueError("forward and backward seconds must be finite and >= 0")


def one_f_one_b(forward: np.ndarray, backward: np.ndarray) -> PipelineResult:
    """Exact makespan of the non-interleaved 1F1B schedule.

    Args:
        forward, backward: float ``(M, P)`` seconds of micro-batch m's forward / backward on stage
            s (>= 0, finite).

    Returns:
        :class:`PipelineResult`; O(M P).
    """
    f = np.asarray(forward, dtype=np.float64)
    b = np.asarray(backward, dtype=np.float64)
    _check_times(f, b, 2)
    makespan = float(makespans(f[None], b[None])[0])
    busy = f.sum(axis=0) + b.sum(axis=0)
    return PipelineResult(makespan, busy, makespan - busy)


def makespans(forward: np.ndarray, backward: np.ndarray) -> np.ndarray:
    """``(n,)`` exact 1F1B makespans of n pipelines with the same (M, P): ``forward`` and
    ``backward`` float ``(n, M, P)`` seconds. One vectorised step per dependency level (about
    ``2 (M + P)`` of them, :mod:`.levels`: the op-by-op recurrence's values, bit for bit), whatever
    n is."""
    f = np.asarray(forward, dtype=np.float64)
    b = np.asarray(backward, dtype=np.float64)
    _check_times(f, b, 3)
    _, m, p = f.shape
    return solve(_levels(p, m), f, b)


@lru_cache(maxsize=64)
def _levels(num_stages: int, num_micro_batches: int) -> Levels:
    return compile_levels(dependency_order(num_stages, num_micro_batches), num_micro_batches, num_stages, num_stages)


def stage_layers(num_layers: int, num_stages: int) -> np.ndarray:
    """``(P,)`` layers per stage: ``L // P`` each, the first ``L % P`` stages one more."""
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"--pp must be an integer >= 1, got {num_stages!r}")
    if num_stages > num_layers:
        raise ValueError(f"--pp {num_stages}: more pipeline stages than the model's {num_layers} layers")
    out = np.full(num_stages, num_layers // num_stages, dtype=np.int64)
    out[: num_layers % num_stages] += 1
    return out


def head_layers(shapes: ModelShapes) -> float:
    """The LM head's weight in decoder layers, as FLOPs per token: the head GEMM ``H x V`` over
    one layer's projections (q, k, v, o) and MLP (gate, up, down),
    ``H (Hq D) + 2 H (Hkv D) + (Hq D) H + 3 H I``.

    Attention's own FLOPs are left out: they are sparse and depend on the documents' lengths, so
    no fixed number stands for them (leaving them out slightly overweights the head for long
    documents). Shapes, not a measured latency profile, so the split is fixed by the model alone:
    a resumed run may change ``--profile`` but not its per-stage optimizer states. The embedding
    lookup (first stage) and the final norm are negligible and not counted. Qwen2.5-3B: ~4.04;
    the tiny model: ~1.33.
    """
    h, d = shapes.hidden_size, shapes.head_dim
    q, kv = shapes.num_heads * d, shapes.num_kv_heads * d
    layer = h * q + 2 * h * kv + q * h + 3 * h * shapes.intermediate_size
    return float(h * shapes.vocab_size) / float(layer)


def balanced_layers(num_layers: int, num_stages: int, head_layers: float) -> np.ndarray:
    """``(P,)`` layers per stage, contiguous, minimising the largest stage cost: its layers, plus
    ``head_layers`` on the last stage; every stage >= 1 layer.

    The first P - 1 stages share what the last leaves as :func:`stage_layers` does. Among splits
    of equal largest cost: the even split (:func:`stage_layers`) first, so a head of under a layer
    changes nothing; then the one with more layers on the last stage. O(L).
    """
    even = stage_layers(num_layers, num_stages)  # validates --pp against the layers
    if not (np.isfinite(head_layers) and head_layers >= 0):
        raise ValueError(f"head_layers must be finite and >= 0, got {head_layers!r}")
    p = num_stages
    if p == 1:
        return even

    def cost(last: int) -> float:
        return max(-(-(num_layers - last) // (p - 1)), last + head_layers)

    best = int(even[-1])
    for last in range(num_layers - p + 1, 0, -1):  # more layers on the last stage first
        if cost(last) < cost(best) - 1e-9:
            best = last
    if best == even[-1]:
        return even
    return np.append(stage_layers(num_layers - best, p - 1), best)


def resolve_layers(num_layers: int, num_stages: int, split: tuple[int, ...] = ()) -> np.ndarray:
    """``(P,)`` layers per stage: ``split`` checked against the model (P entries, each >= 1,
    summing to ``num_layers``), or the even split (:func:`stage_layers`) when it is empty."""
    even = stage_layers(num_layers, num_stages)
    if not split:
        return even
    out = np.asarray(split, dtype=np.int64)
    if out.shape != (num_stages,) or (out < 1).any() or int(out.sum()) != num_layers:
        raise ValueError(
            f"stage_layers {tuple(split)}: need {num_stages} stages of >= 1 layer summing to the "
            f"model's {num_layers} layers"
        )
    return out


def split_forward_backward(seconds: np.ndarray, ratio: float = BACKWARD_RATIO) -> tuple[np.ndarray, np.ndarray]:
    """``seconds`` (forward + backward) -> (forward, backward) at backward = ``ratio`` x forward."""
    if not (np.isfinite(ratio) and ratio >= 0):
        raise ValueError(f"backward ratio must be finite and >= 0, got {ratio}")
    forward = np.asarray(seconds, dtype=np.float64) / (1.0 + ratio)
    return forward, forward * ratio


def spread_stages(times: np.ndarray, head: np.ndarray, layers: np.ndarray) -> np.ndarray:
    """``(..., P)`` each micro-batch's seconds per stage: ``(times - head) x layers[s] / L``, plus
    ``head`` on the last stage (``times`` float ``(...)``, ``head`` broadcastable to it, ``layers``
    int ``(P,)``): what :func:`sparsebalance.simulate.pipeline.stage_seconds` gives for a latency
    model whose head term depends on tokens only."""
    t = np.asarray(times, dtype=np.float64)
    h = np.broadcast_to(np.asarray(head, dtype=np.float64), t.shape)
    per_layer = (t - h) / float(layers.sum())
    stages = per_layer[..., None] * layers.astype(np.float64)
    stages[..., -1] += h
    return stages


def scaled_stages(
    times: np.ndarray, head: np.ndarray, layers: np.ndarray, scales: np.ndarray | None, virtual: int = 1
) -> np.ndarray:
    """``(..., P V)`` each micro-batch's seconds per (virtual) stage as the pipelines price them:
    :func:`spread_stages`'s share times its rank's scale (``scales`` ``(P,)``, None: 1)."""
    stages = spread_stages(times, head, layers)
    if scales is not None:
        stages = stages * np.tile(np.asarray(scales, dtype=np.float64), virtual)
    return stages


def layered_makespans(
    times: np.ndarray,
    head: np.ndarray,
    layers: np.ndarray,
    ratio: float = BACKWARD_RATIO,
    scales: np.ndarray | None = None,
    virtual: int = 1,
):
    """``(n,)`` 1F1B makespans of n pipelines from their micro-batch times.

    Args:
        times: float ``(n, M)`` forward + backward seconds of each micro-batch (the cost model's).
        head: float ``(n, M)`` (or broadcastable) seconds of each micro-batch not spread over the
            layers (the LM head and loss, on the last stage); 0 spreads all of it.
        layers: int ``(P V,)`` layers per (virtual) stage (:func:`stage_layers`).
        ratio: backward seconds per forward second.
        scales: float ``(P,)`` multiplies each rank's share (a run's measured stage scales,
            :mod:`sparsebalance.engine.stage_calibration`); None: 1.
        virtual: V chunks per rank (``--pp-virtual``): the interleaved schedule
            (:mod:`.interleaved`), virtual stage k on rank ``k % P``; 1: plain 1F1B.

    A stage's share is :func:`spread_stages`'s, times its rank's scale. Zero bubble:
    :func:`~.zero_bubble.layered_makespans`.
    """
    stages = scaled_stages(times, head, layers, scales, virtual)
    if virtual == 1:
        return makespans(*split_forward_backward(stages, ratio))
    from .interleaved import makespans as interleaved_makespans

    return interleaved_makespans(*split_forward_backward(stages, ratio), virtual)


def head_seconds(cost_model: CostModel, lengths: np.ndarray, densities: np.ndarray, totals: np.ndarray) -> np.ndarray:
    """What of each micro-batch's predicted time is not spread over the layers (the LM head and
    loss, priced on the last stage): ``max(totals - L x per-layer seconds, 0)``, per-layer =
    the documents' attention plus the rest of a layer (``layer_other_seconds`` of the pack).

    Args:
        lengths: int ``(..., K)`` documents per micro-batch (0 = empty slot); densities the same.
        totals: ``(...)`` the micro-batches' ``predict_many`` seconds at those densities.
    """
    lengths = np.asarray(lengths)
    valid = lengths > 0
    attn = np.zeros(lengths.shape)
    attn[valid] = cost_model.layer_attention_seconds(lengths[valid], np.asarray(densities, dtype=np.float64)[valid])
    tokens = lengths.sum(axis=-1)
    if isinstance(cost_model, ManyOtherCost):  # one call, the same values (issue 54)
        rest = np.asarray(cost_model.layer_other_seconds_many(tokens), dtype=np.float64).reshape(tokens.shape)
    else:
        rest = np.array([cost_model.layer_other_seconds(int(t)) for t in tokens.reshape(-1).tolist()])
        rest = rest.reshape(tokens.shape)
    per_layer = attn.sum(axis=-1) + rest
    return np.maximum(np.asarray(totals, dtype=np.float64) - cost_model.num_layers * per_layer, 0.0)
