"""Zero-bubble pipelines on the simulator (evaluation only: the trainer does not run them).

Zero-bubble schedules (Qi et al., 2023) split a stage's backward into the gradient of its input
(B, which the previous stage waits for) and of its weights (W, which nobody waits for), and run
the W's in what would be bubbles. ZB-H1 keeps 1F1B's activation memory (stage s holds at most
``P - s`` micro-batches between their forward and their B; a pending W keeps only its layers'
inputs and output gradients, which the paper counts apart) and, with equal op times, shrinks
1F1B's bubble ``(P - 1)(F + B + W)`` to ``(P - 1)(F + B - W)``: the list schedule below gives
exactly that with equal times (tested).

:func:`zb_h1_makespan` prices a heterogeneous step with an event-driven list schedule of that
kind: whenever a stage is idle it runs, in this priority, the next backward (B) whose input is
there, else the next forward whose input is there while fewer than ``P - s`` micro-batches are
held, else the oldest pending W. It is what :mod:`benchmarks.pipeline_interleaved` compares with
1F1B and interleaved 1F1B at the paper's setting (``docs/pipeline.md`` says why it is not built).
"""

from __future__ import annotations

import heapq

import numpy as np


def zb_h1_makespan(forward: np.ndarray, backward_input: np.ndarray, backward_weight: np.ndarray) -> float:
    """The makespan of one pipeline's step under the ZB-H1-like list schedule above.

    Args:
        forward, backward_input, backward_weight: float ``(M, P)`` seconds of micro-batch m's F, B
            and W on stage s (>= 0, finite).
    """
    f, bi, bw = (np.asarray(x, dtype=np.float64) for x in (forward, backward_input, backward_weight))
    if f.ndim != 2 or f.shape != bi.shape or f.shape != bw.shape or min(f.shape, default=0) < 1:
        raise ValueError(
            f"forward, backward_input and backward_weight must be (M, P), got {f.shape}, {bi.shape}, {bw.shape}"
        )
    if not all(np.all(np.isfinite(x)) and (x >= 0).all() for x in (f, bi, bw)):
        raise ValueError("forward and backward seconds must be finite and >= 0")
    m, p = f.shape
    end_f = np.full((m, p), np.inf)
    end_b = np.full((m, p), np.inf)
    next_f, next_b = [0] * p, [0] * p
    pending_w: list[list[int]] = [[] for _ in range(p)]  # micro-batches whose B ran, W not yet
    held = [0] * p  # micro-batches from their forward's start to their B's end (activations held)
    running: list[str | None] = [None] * p
    done_w, last = 0, 0.0
    events: list[tuple[float, int]] = [(0.0, -1)]  # (time, stage whose op ended; -1: the start)
    while events:
        now, ended = heapq.heappop(events)
        last = max(last, now)
        if ended >= 0:
            if running[ended] == "W":
                done_w += 1
            elif running[ended] == "B":
                held[ended] -= 1
            running[ended] = None
        for s in range(p):
            if running[s] is not None:
                continue
            j, took = next_b[s], None
            if j < next_f[s] and end_f[j, s] <= now and (end_f[j, s] if s == p - 1 else end_b[j, s + 1]) <= now:
                took, running[s] = bi[j, s], "B"
                end_b[j, s] = now + took
                next_b[s] += 1
                pending_w[s].append(j)
            elif next_f[s] < m and held[s] < p - s and (s == 0 or end_f[next_f[s], s - 1] <= now):
                j = next_f[s]
                took, running[s] = f[j, s], "F"
                end_f[j, s] = now + took
                next_f[s] += 1
                held[s] += 1
            elif pending_w[s]:  # the stage is idle, so the B before it has ended
                j = pending_w[s].pop(0)
                took, running[s] = bw[j, s], "W"
            if took is not None:
                heapq.heappush(events, (now + took, s))
    if done_w != m * p:
        raise AssertionError("the zero-bubble list schedule stalled")
    return last
