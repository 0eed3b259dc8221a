"""The zero-bubble schedule ZB-H1 (``--pp-schedule zb-h1``; Qi et al., 2023, "Zero Bubble
Pipeline Parallelism") and its exact makespan, shared by the planner (SAB), DST, the simulator and
the trainer's stages.

Each stage's backward is split in two: **B**, the gradient of the stage's input, which the stage
before waits for, and **W**, the gradient of its weights, which nobody waits for
(:mod:`sparsebalance.engine.deferred_weights` defers the linear layers' weight GEMMs from B to W).
B is sent upstream as soon as it is done, so the backward chain through the stages is
``P - 1`` B's long instead of ``P - 1`` whole backwards, and the W's fill what would have been
bubbles.

Order of stage s (:func:`zb_order`): 1F1B's forwards and backwards in 1F1B's order
(:func:`~.schedule.schedule_order`), each ``W_j`` right after ``B_{j+s}``: stage 0 runs a W right
after its B, stage P-1 lags its W's by P-1, and each stage's last s W's end its step. In the steady
state stage s runs ``(F_x, B_{x-(P-1-s)}, W_{x-(P-1)})``. Every stage holds at most P micro-batches
between a forward and its W: 1F1B's peak (stage 0 holds P there); of them, up to ``P - s`` between
a forward and its B (1F1B's) and up to ``s + 1`` between a B and its W (:func:`pending_weights`),
each keeping its linear layers' inputs and output gradients, which under activation
checkpointing is more than a micro-batch's saved activations (the memory model prices both).
With equal op times F, B, W, W <= min(F, B) and M >= P the makespan is
``M (F + B + W) + (P - 1) (F + B - W)`` against 1F1B's ``(M + P - 1) (F + B + W)`` (tested). With
uneven times ZB-H1 can be longer than 1F1B (a W put before a B that 1F1B ran at once: rare, and
SAB's order search and DST price the schedule that runs).

An op starts when its stage's previous op has finished and its input is there (a forward: the
stage before's forward; a B: the stage after's B, or its own forward on the last stage; a W: its
own B, which runs before it on the same stage). :func:`makespans` solves that recurrence exactly
for many pipelines of the same (M, P) at once (one numpy step per dependency level,
:mod:`.levels`).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from .levels import Levels, compile_levels, solve
from .schedule import BACKWARD_RATIO, scaled_stages, schedule_order, split_forward_backward

SCHEDULES = ("1f1b", "zb-h1")
"""``--pp-schedule``: plain (or, with ``--pp-virtual``, interleaved) 1F1B, or zero-bubble ZB-H1."""

WEIGHT_SHARE = 1 / 3
"""W's share of a stage's backward until a run has measured it (``PlanConfig.weight_share``; the
trainer's stages learn it, :mod:`sparsebalance.engine.stage_calibration`). W is the linear layers'
weight GEMMs: half of their backward (an input and a weight GEMM per forward GEMM), none of
attention's, so about 0.5 when attention is cheap and less as documents grow; an estimate."""

Op = tuple[str, int, int]
"""``(kind, micro-batch, chunk)``: ``("F" | "B" | "W", m, 0)`` on a stage (one chunk)."""


def check_schedule(schedule: str, num_stages: int, num_chunks: int = 1) -> None:
    """Refuse, in one line naming ``--pp-schedule``, an unknown schedule, or ``zb-h1`` without a
    pipeline or with ``--pp-virtual`` (interleaved zero bubble is not built)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"--pp-schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if schedule == "zb-h1" and num_stages < 2:
        raise ValueError(f"--pp-schedule zb-h1 needs a pipeline (--pp >= 2), got --pp {num_stages}")
    if schedule == "zb-h1" and num_chunks > 1:
        raise ValueError(
            f"--pp-schedule zb-h1 cannot run with --pp-virtual {num_chunks} (interleaved zero bubble is not "
            "built): use one of them"
        )


def zb_order(num_stages: int, num_micro_batches: int, stage: int) -> list[Op]:
    """Stage ``stage``'s ops in ZB-H1 order (the module docstring)."""
    lag = stage
    out: list[Op] = []
    for kind, m in schedule_order(num_stages, num_micro_batches, stage):
        out.append((kind, m, 0))
        if kind == "B" and m >= lag:
            out.append(("W", m - lag, 0))
    out += [("W", m, 0) for m in range(max(0, num_micro_batches - lag), num_micro_batches)]
    return out


def pending_weights(num_stages: int, num_micro_batches: int, stage: int) -> int:
    """The most micro-batches stage ``stage`` holds at once between a B and its W (``s + 1``
    once M > s: W lags B by the stage index; the memory model prices each by its deferred GEMMs'
    inputs and output gradients). Between a forward and its B it holds what 1F1B holds (the same
    F/B order): ``P - s``."""
    pending = peak = 0
    for kind, _, _ in zb_order(num_stages, num_micro_batches, stage):
        pending += 1 if kind == "B" else -1 if kind == "W" else 0
        peak = max(peak, pending)
    return peak


def held_micro_batches(num_stages: int, num_micro_batches: int, stage: int) -> int:
    """The most micro-batches stage ``stage`` holds at once between a forward and its W (P once
    M >= P: 1F1B's peak, on every stage; 1F1B itself holds ``P - s``)."""
    held = peak = 0
    for kind, _, _ in zb_order(num_stages, num_micro_batches, stage):
        held += 1 if kind == "F" else -1 if kind == "W" else 0
        peak = max(peak, held)
    return peak


@lru_cache(maxsize=64)
def dependency_order(num_stages: int, num_micro_batches: int) -> tuple[tuple[str, int, int], ...]:
    """Every op ``(kind, micro-batch, stage)`` once, each after its stage's previous op and its
    input (independent of the ops' durations). Asserts the orders cannot wait on each other."""
    p, m = num_stages, num_micro_batches
    orders = [zb_order(p, m, s) for s in range(p)]
    done: set[tuple[str, int, int]] = set()
    nxt, out = [0] * p, []
    total = sum(len(o) for o in orders)
    while len(out) < total:
        progressed = False
        for s in range(p):
            while nxt[s] < len(orders[s]):
                kind, mb, _ = orders[s][nxt[s]]
                if kind == "F":
                    need = ("F", mb, s - 1) if s > 0 else None
                elif kind == "B":
                    need = ("F", mb, s) if s == p - 1 else ("B", mb, s + 1)
                else:
                    need = ("B", mb, s)
                if need is not None and need not in done:
                    break
                done.add((kind, mb, s))
                out.append((kind, mb, s))
                nxt[s] += 1
                progressed = True
        assert progressed, f"ZB-H1 deadlocks at P={p}, M={m}"  # cannot happen: 1F1B's F/B order
    return tuple(out)


@lru_cache(maxsize=64)
def _levels(num_stages: int, num_micro_batches: int) -> Levels:
    order = dependency_order(num_stages, num_micro_batches)
    return compile_levels(order, num_micro_batches, num_stages, num_stages)


def makespans(forward: np.ndarray, backward_input: np.ndarray, backward_weight: np.ndarray) -> np.ndarray:
    """``(n,)`` exact ZB-H1 makespans of n pipelines with the same (M, P).

    Args:
        forward, backward_input, backward_weight: float ``(n, M, P)`` seconds of micro-batch m's
            F, B and W on stage s, >= 0 and finite.
    """
    f, b, w = (np.asarray(x, dtype=np.float64) for x in (forward, backward_input, backward_weight))
    if f.ndim != 3 or f.shape != b.shape or f.shape != w.shape or min(f.shape[1:], default=0) < 1:
        raise ValueError(
            f"forward, backward_input and backward_weight must all be (n, M, P), got {f.shape}, {b.shape}, {w.shape}"
        )
    if not all(np.all(np.isfinite(x)) and (x >= 0).all() for x in (f, b, w)):
        raise ValueError("forward and backward seconds must be finite and >= 0")
    _, m, p = f.shape
    return solve(_levels(p, m), f, b, w)


def split_backward(backward: np.ndarray, weight_share: float) -> tuple[np.ndarray, np.ndarray]:
    """A stage's backward seconds as (B, W): ``(1 - weight_share)`` and ``weight_share`` of it."""
    if not 0.0 <= weight_share < 1.0:
        raise ValueError(f"weight_share must be in [0, 1), got {weight_share}")
    backward = np.asarray(backward, dtype=np.float64)
    return backward * (1.0 - weight_share), backward * weight_share


def layered_makespans(
    times: np.ndarray,
    head: np.ndarray,
    layers: np.ndarray,
    ratio: float = BACKWARD_RATIO,
    scales: np.ndarray | None = None,
    weight_share: float = WEIGHT_SHARE,
) -> np.ndarray:
    """``(n,)`` ZB-H1 makespans of n pipelines from their micro-batch times ``(n, M)``: as
    :func:`~.schedule.layered_makespans` (spread over the stages by ``layers`` ``(P,)``, the head
    on the last, each stage times its scale, backward = ``ratio`` x forward), each stage's backward
    split into B and W at ``weight_share``."""
    forward, backward = split_forward_backward(scaled_stages(times, head, layers, scales), ratio)
    return makespans(forward, *split_backward(backward, weight_share))
