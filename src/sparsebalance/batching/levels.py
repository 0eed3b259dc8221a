"""A pipeline schedule's makespan recurrence, compiled once per shape into dependency levels.

A schedule's op (a forward, backward or, zero-bubble, weight gradient of micro-batch m on
virtual stage k) ends at
``max(end of its rank's previous op, end of its input) + its duration``. Solving that op by op
(one numpy step per op, over n pipelines at once) costs ~2 M S Python steps per call, and the
planner and DST make hundreds of calls per training step (issue 54: 3-4 % of the paper's step
at DP2 PP4). Ops whose two predecessors are both in earlier levels do not depend on one another:
:func:`compile_levels` groups them (an op's level = 1 + the larger of its predecessors'), so
:func:`solve` runs one vectorised step per level (about ``2 (M + S)`` of them instead of
``2 M S``), each op computed with exactly the same two operations on exactly the same values as
op by op: the makespans are bit for bit the same.

:func:`join_levels` joins the schedules of many pipelines of different micro-batch counts (one
plan's ranks) into one program, so :func:`solve_joined` prices all of them, and any number of
variants of their times (the columns), in one pass of about ``2 (M + S)`` steps: DST prices a
plan's pipelines hundreds of times per step, and a pass per micro-batch count cost up to four
times more at DP8 PP4 (issue 54). Each op is still computed from the same two ends and the same
duration: bit for bit the makespans of :func:`solve`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Levels:
    """A schedule of ``num_ops`` ops compiled for :func:`solve` (ops renumbered in level order)."""

    source: np.ndarray
    """``(ops,)`` each op's row in the stacked durations ``[forward; backward; weight]`` flattened
    ``(3 M S,)`` (kind, micro-batch, virtual stage)."""
    steps: tuple[tuple[int, int, np.ndarray, np.ndarray], ...]
    """Per level: ``(first, stop, previous, input)``: ops ``first..stop-1`` and the ops (or the
    zero row ``ops``) they wait for."""
    last: np.ndarray
    """Each rank's last op."""
    level: np.ndarray
    """``(ops,)`` each op's level (non-decreasing: ops are in level order)."""
    previous: np.ndarray
    """``(ops,)`` the op each one waits for on its rank (``ops``: none)."""
    inputs: np.ndarray
    """``(ops,)`` the op whose output each one waits for (``ops``: none)."""


def compile_levels(order: Sequence[tuple[str, int, int]], num_micro_batches: int, num_stages: int, num_ranks: int):
    """:class:`Levels` of a schedule from its ops ``(kind, micro-batch, virtual stage)`` in a
    dependency order (each after its rank's previous op and its input; virtual stage ``k`` runs
    on rank ``k % num_ranks``; ``num_stages`` virtual stages S). The input of ``("F", m, k)`` is
    ``("F", m, k - 1)`` (none at k = 0); of ``("B", m, k)``, ``("B", m, k + 1)``, or its own
    forward on the last virtual stage; of ``("W", m, k)`` (zero bubble: the weights' gradient),
    its own ``("B", m, k)``."""
    m, s = num_micro_batches, num_stages
    index = {op: i for i, op in enumerate(order)}
    n = len(order)
    prev = np.full(n, n, dtype=np.int64)
    inp = np.full(n, n, dtype=np.int64)
    level = np.zeros(n, dtype=np.int64)
    last = {}
    for i, (kind, mb, k) in enumerate(order):
        rank = k % num_ranks
        if rank in last:
            prev[i] = last[rank]
        last[rank] = i
        if kind == "F":
            need = ("F", mb, k - 1) if k > 0 else None
        elif kind == "W":
            need = ("B", mb, k)
        else:
            need = ("F", mb, k) if k == s - 1 else ("B", mb, k + 1)
        if need is not None:
            inp[i] = index[need]
        level[i] = 1 + max(level[prev[i]] if prev[i] < n else -1, level[inp[i]] if inp[i] < n else -1)
    row = {"F": 0, "B": 1, "W": 2}
    source = np.array([row[kind] * m * s + mb * s + k for kind, mb, k in order], dtype=np.int64)
    new, renum, steps = _level_steps(level, prev, inp)
    last = renum[np.array(sorted(last.values()), dtype=np.int64)]
    return Levels(source[new], steps, last, level[new], renum[prev[new]], renum[inp[new]])


def _level_steps(level: np.ndarray, prev: np.ndarray, inp: np.ndarray):
    """Ops (``prev`` / ``inp``: their predecessors, ``n`` for none) sorted by level:
    ``(new, renum, steps)``: the old index of each new op, the new index of each old one (``n``
    kept), and :attr:`Levels.steps`."""
    n = level.size
    new = np.argsort(level, kind="stable")  # ops in level order: old index of each new one
    renum = np.empty(n + 1, dtype=np.int64)
    renum[new], renum[n] = np.arange(n), n
    bounds = np.searchsorted(level[new], np.arange(int(level.max(initial=-1)) + 2))
    steps = tuple(
        (int(a), int(b), renum[prev[new[a:b]]], renum[inp[new[a:b]]])
        for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)
    )
    return new, renum, steps


@dataclass(frozen=True)
class JoinedLevels:
    """The schedules of n pipelines (micro-batch counts ``M_i``, one schedule and stage count)
    compiled into one program for :func:`solve_joined`; their micro-batches are ``E = sum M_i``
    entries, pipeline by pipeline."""

    source: np.ndarray
    """``(ops,)`` each op's row in the stacked durations ``(kinds, E, S)`` flattened."""
    steps: tuple[tuple[int, int, np.ndarray, np.ndarray], ...]
    """As :attr:`Levels.steps`, over every pipeline's ops."""
    last: np.ndarray
    """``(n, ranks)`` each pipeline's ranks' last ops."""
    num_entries: int
    """E, the micro-batches of all pipelines."""


def join_levels(levels: Sequence[Levels], counts: Sequence[int], num_stages: int) -> JoinedLevels:
    """One program of pipelines ``i`` run by ``levels[i]`` (compiled for ``counts[i]`` >= 1
    micro-batches and ``num_stages`` virtual stages S); pipeline i's micro-batches are the
    entries ``sum(counts[:i]) ..`` of the stacked durations."""
    counts = np.asarray(counts, dtype=np.int64)
    starts = np.cumsum(counts) - counts
    entries = int(counts.sum())
    classes: dict[int, list[int]] = {}  # pipelines by compiled schedule (one per micro-batch count)
    for i, lv in enumerate(levels):
        classes.setdefault(id(lv), []).append(i)
    total = sum(levels[i].source.size for i in range(len(levels)))
    parts, last, offset = [], np.zeros((len(levels), levels[0].last.size if levels else 0), dtype=np.int64), 0
    for members in classes.values():
        lv, rows = levels[members[0]], np.asarray(members, dtype=np.int64)
        n, m = lv.source.size, int(counts[rows[0]])
        base = offset + n * np.arange(rows.size)[:, None]  # (pipelines, 1): each one's first op

        def shift(ops, base=base, n=n):
            return np.where(ops < n, base + ops, total)  # "none" (n) -> the joined zero row

        kind, rest = np.divmod(lv.source, m * num_stages)
        source = kind * entries * num_stages + starts[rows][:, None] * num_stages + rest
        parts.append(
            (np.broadcast_to(lv.level, base.shape[:1] + lv.level.shape), shift(lv.previous), shift(lv.inputs), source)
        )
        last[rows] = base + lv.last
        offset += n * rows.size
    level, prev, inp, source = (np.concatenate([p[k].reshape(-1) for p in parts]) for k in range(4))
    new, renum, steps = _level_steps(level, prev, inp)
    return JoinedLevels(source[new], steps, renum[last], entries)


CHUNK_ROWS = 1024
"""Pipelines solved at once: a chunk's end times (``2 M S + 1`` rows of this many) stay in the
CPU's cache; the rows are independent, so chunks change no value (3x faster at 30,000 rows)."""


def solve(levels: Levels, forward: np.ndarray, backward: np.ndarray, weight: np.ndarray | None = None) -> np.ndarray:
    """``(n,)`` makespans (the latest end of any rank's last op) of n pipelines: ``forward`` and
    ``backward`` float ``(n, M, S)`` seconds (checked by the caller); ``weight``: the same shape,
    the zero-bubble schedules' W ops (``backward`` then their B ops); None: no W ops."""
    n = forward.shape[0]
    if n > CHUNK_ROWS:
        out = []
        for i in range(0, n, CHUNK_ROWS):
            rows = slice(i, i + CHUNK_ROWS)
            out.append(solve(levels, forward[rows], backward[rows], None if weight is None else weight[rows]))
        return np.concatenate(out)
    ops = forward.shape[1] * forward.shape[2]
    kinds = (forward, backward) if weight is None else (forward, backward, weight)
    stacked = np.empty((len(kinds) * ops, n))  # (kind, micro-batch, stage) rows of n: one transposing copy
    for i, times in enumerate(kinds):
        stacked[i * ops : (i + 1) * ops] = times.reshape(n, ops).T
    durations = stacked[levels.source]
    end = np.zeros((durations.shape[0] + 1, n))
    for a, b, prev, inp in levels.steps:
        step = end[a:b]
        np.maximum(end[prev], end[inp], out=step)
        step += durations[a:b]
    return end[levels.last].max(axis=0)


def solve_joined(levels: JoinedLevels, durations: np.ndarray) -> np.ndarray:
    """``(n, C)`` makespans of :func:`join_levels`' n pipelines for C columns of stacked
    durations ``(kinds E S, C)`` (rows: (kind, entry, stage) with kinds forward, backward and,
    zero bubble, weight; checked by the caller): each column priced as :func:`solve` prices a
    pipeline, the same ops on the same values."""
    times = durations[levels.source]
    end = np.zeros((times.shape[0] + 1, durations.shape[1]))
    for a, b, prev, inp in levels.steps:
        step = end[a:b]
        np.maximum(end[prev], end[inp], out=step)
        step += times[a:b]
    return end[levels.last].max(axis=1)
