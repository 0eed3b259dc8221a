"""The interleaved 1F1B schedule (``--pp-virtual V``, Megatron-LM's virtual pipeline stages) and
its exact makespan, shared by the planner (SAB), DST, the simulator and the trainer's stages.

Each of the P ranks of a pipeline holds V chunks of layers: the model's layers are split into
``P V`` *virtual stages* in model order, and virtual stage ``k`` runs on rank ``k % P`` as its
chunk ``k // P`` (rank 0 holds virtual stages 0, P, 2P, ...: non-adjacent chunks). A micro-batch's
forward crosses the ranks V times (rank P-1 sends to rank 0 between chunks), its backward the same
way back. With equal op times the makespan is ``M (f + b) + (P - 1) (f + b) / V``: the bubble
shrinks V-fold, for V times as many sends.

Per-rank order (:func:`virtual_order`; Megatron-core's ``get_schedule_table``): forward slots run
micro-batches in groups of G, chunk after chunk within a group (chunk 0 of micro-batches 0..G-1,
chunk 1 of the same, ...; the last group takes the rest); backward slots run the same table with
chunks reversed. Rank s runs ``2 (P - s - 1) + (V - 1) G`` forwards of warm-up (at most all
``M V``), then one forward and one backward alternately, then the rest of the backwards.

G (:func:`group_size`) is Megatron's default P. Megatron refuses ``M < P`` with interleaving, and
when P does not divide M a short last group can make the order wait on itself (P = 4, V = 3,
M = 5: a cycle, whatever the op times). Packed plans give each pipeline its own M per step, so G
is the smallest of ``min(P, M) .. M`` whose order is free of deadlock (checked by the dependency
sweep, once per (P, V, M); G = M always is).

An op starts when its rank's previous op has finished and its input is there: the forward of the
same micro-batch on the virtual stage before, or its backward on the virtual stage after (the last
virtual stage: its own forward). :func:`makespans` solves the recurrence exactly for many
pipelines of the same (M, P, V) at once (one numpy step per dependency level, :mod:`.levels`).
Times are given per virtual stage, ``(n, M, P V)``, in model order; V = 1 is
:func:`~.schedule.makespans` itself.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from .levels import Levels, compile_levels, solve

Op = tuple[str, int, int]
"""``(kind, micro-batch, chunk)``: ``("F", m, c)`` / ``("B", m, c)`` on a rank."""


def check_virtual(num_stages: int, num_chunks: int, num_layers: int | None = None) -> None:
    """Refuse, in one line naming ``--pp-virtual``, a V that is not an integer >= 1, V > 1 without a
    pipeline, or more virtual stages than layers (V = 1: what ``--pp`` refuses is said there)."""
    v = num_chunks
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"--pp-virtual must be an integer >= 1, got {v!r}")
    if v > 1 and num_stages < 2:
        raise ValueError(f"--pp-virtual {v} needs a pipeline (--pp >= 2), got --pp {num_stages}")
    if v > 1 and num_layers is not None and num_stages * v > num_layers:
        raise ValueError(
            f"--pp-virtual {v}: --pp {num_stages} x {v} = {num_stages * v} virtual stages, more than the "
            f"model's {num_layers} layers"
        )


@lru_cache(maxsize=256)
def group_size(num_stages: int, num_chunks: int, num_micro_batches: int) -> int:
    """G: micro-batches run chunk after chunk in groups of G: P (Megatron-core's default), all M
    when M < P, else the smallest larger G whose order cannot deadlock (module docstring)."""
    p, v, m = num_stages, num_chunks, num_micro_batches
    low = max(1, min(p, m))
    for g in range(low, max(m, low) + 1):
        if _sweep(p, v, m, g) is not None:
            return g
    raise AssertionError(f"no interleaved 1F1B order without deadlock at P={p}, V={v}, M={m}")  # G = M never waits


def _order(p: int, v: int, m: int, stage: int, g: int) -> list[Op]:
    table = [(mb, c) for lo in range(0, m, g) for c in range(v) for mb in range(lo, min(lo + g, m))]
    forwards = [("F", mb, c) for mb, c in table]
    backwards = [("B", mb, v - 1 - c) for mb, c in table]
    warm = min(p - stage - 1, m) if v == 1 else min(2 * (p - stage - 1) + (v - 1) * g, m * v)
    order = forwards[:warm]
    for i in range(m * v - warm):
        order += [forwards[warm + i], backwards[i]]
    return order + backwards[m * v - warm :]


def virtual_order(num_stages: int, num_chunks: int, num_micro_batches: int, stage: int) -> list[Op]:
    """Rank ``stage``'s ops in interleaved 1F1B order (the module docstring); with one chunk, the
    non-interleaved 1F1B order (:func:`~.schedule.schedule_order`) with chunk 0."""
    p, v, m = num_stages, num_chunks, num_micro_batches
    g = max(1, min(p, m)) if v == 1 else group_size(p, v, m)
    return _order(p, v, m, stage, g)


def input_of(op: Op, stage: int, num_stages: int, num_chunks: int) -> tuple[str, int, int] | None:
    """The op ``(kind, micro-batch, virtual stage)`` whose output ``op`` of rank ``stage`` reads;
    None for the first virtual stage's forward."""
    kind, mb, c = op
    k, last = c * num_stages + stage, num_stages * num_chunks - 1
    if kind == "F":
        return None if k == 0 else ("F", mb, k - 1)
    return ("F", mb, k) if k == last else ("B", mb, k + 1)


@lru_cache(maxsize=64)
def dependency_order(num_stages: int, num_chunks: int, num_micro_batches: int) -> tuple[tuple[str, int, int], ...]:
    """Every op ``(kind, micro-batch, virtual stage)`` once, each after its rank's previous op and
    after its input (independent of the ops' durations). Asserts the schedule cannot deadlock:
    every rank reaches its last op when sends never wait."""
    p, v, m = num_stages, num_chunks, num_micro_batches
    g = max(1, min(p, m)) if v == 1 else group_size(p, v, m)
    out = _sweep(p, v, m, g)
    assert out is not None, f"interleaved 1F1B deadlocks at P={p}, V={v}, M={m}"
    return out


def _sweep(p: int, v: int, m: int, g: int) -> tuple[tuple[str, int, int], ...] | None:
    """The ops in a dependency order for groups of ``g``; None if the orders wait on each other."""
    orders = [_order(p, v, m, s, g) for s in range(p)]
    done: set[tuple[str, int, int]] = set()
    nxt, out = [0] * p, []
    while len(out) < 2 * m * p * v:
        progressed = False
        for s in range(p):
            while nxt[s] < len(orders[s]):
                kind, mb, c = orders[s][nxt[s]]
                need = input_of((kind, mb, c), s, p, v)
                if need is not None and need not in done:
                    break
                op = (kind, mb, c * p + s)
                done.add(op)
                out.append(op)
                nxt[s] += 1
                progressed = True
        if not progressed:
            return None
    return tuple(out)


def _check(f: np.ndarray, b: np.ndarray, num_chunks: int) -> None:
    if f.ndim != 3 or f.shape != b.shape or min(f.shape[1:], default=0) < 1 or f.shape[2] % num_chunks:
        raise ValueError(
            f"forward and backward must both be (n, M, P x V) with M >= 1 and V = {num_chunks} dividing the "
            f"virtual stages, got {f.shape} and {b.shape}"
        )
    if not (np.all(np.isfinite(f)) and np.all(np.isfinite(b)) and (f >= 0).all() and (b >= 0).all()):
        raise ValueError("forward and backward seconds must be finite and >= 0")


def makespans(forward: np.ndarray, backward: np.ndarray, num_chunks: int) -> np.ndarray:
    """``(n,)`` exact interleaved 1F1B makespans of n pipelines with the same (M, P, V).

    Args:
        forward, backward: float ``(n, M, P V)`` seconds of micro-batch m's forward / backward on
            virtual stage k (rank ``k % P``, chunk ``k // P``), >= 0 and finite.
        num_chunks: V (>= 1); 1 is the non-interleaved schedule.
    """
    f = np.asarray(forward, dtype=np.float64)
    b = np.asarray(backward, dtype=np.float64)
    _check(f, b, num_chunks)
    _, m, stages = f.shape
    return solve(_levels(stages // num_chunks, num_chunks, m), f, b)


@lru_cache(maxsize=64)
def _levels(num_stages: int, num_chunks: int, num_micro_batches: int) -> Levels:
    """The interleaved order compiled into dependency levels (:mod:`.levels`: one numpy step per
    level, the op-by-op recurrence's values bit for bit)."""
    order = dependency_order(num_stages, num_chunks, num_micro_batches)
    return compile_levels(order, num_micro_batches, num_stages * num_chunks, num_stages)


def rank_busy(forward: np.ndarray, backward: np.ndarray, num_chunks: int) -> np.ndarray:
    """``(..., P)`` each rank's busy seconds: its chunks' forwards and backwards
    (``forward``, ``backward``: ``(..., M, P V)``)."""
    work = np.asarray(forward, dtype=np.float64) + np.asarray(backward, dtype=np.float64)
    per_stage = work.sum(axis=-2)
    return per_stage.reshape(*per_stage.shape[:-1], num_chunks, -1).sum(axis=-2)


def chunk_layers(split: np.ndarray, num_stages: int, stage: int) -> list[range]:
    """Rank ``stage``'s chunks as ranges of decoder layers, chunk order (= model order), from the
    layers per virtual stage ``split`` ``(P V,)``."""
    starts = np.concatenate([[0], np.cumsum(split)])
    return [range(int(starts[k]), int(starts[k + 1])) for k in range(stage, split.size, num_stages)]


HELD_LIMIT = 512
"""Micro-batches per pipeline and step over which :func:`held_stages` maximises by default (the
trainer: up to its global batch, at most this). The most is not always reached early: a group G
larger than P keeps more warm-up forwards, and G depends on M (rank 0 with equal chunks: P = 7,
V = 3 first keeps its most at M = 281, P = 8, V = 2 at M = 453; every other P <= 8, V <= 4 by M =
74). Beyond this many the most found up to here is used, which can be short by a chunk. Cost: the
deadlock sweep of every M, a few seconds at P = 8 (once, at start, with ``--capacity auto``)."""


def held_stages(
    split: tuple[int, ...], num_stages: int, stage: int, micro_batches: range = range(1, HELD_LIMIT + 1)
) -> float:
    """The most activations rank ``stage`` keeps at once for the backward, in whole stages (1 = one
    micro-batch's activations of all its layers), over the micro-batch counts ``micro_batches``:
    along :func:`virtual_order` a chunk's forward keeps its layers' activations until that chunk's
    backward frees them. Plain 1F1B keeps ``P - s`` (:class:`~sparsebalance.latency.memory.
    StageShare`); interleaving keeps more, warm-up forwards of several chunks (P = 4, V = 2, rank
    0: 5.5 stages at G = P, Megatron-LM's ``1 + (P - 1) / (P V)`` factor), and a group G larger than
    P (an M that P does not divide) more still. ``split``: layers per virtual stage ``(P V,)``."""
    p = num_stages
    v = len(split) // p
    layers = [split[c * p + stage] for c in range(v)]
    total = sum(layers)
    most = max((_held(p, v, m, stage, tuple(layers)) for m in micro_batches), default=None)
    return float(p - stage) if most is None else most / total


@lru_cache(maxsize=4096)
def _held(p: int, v: int, m: int, stage: int, layers: tuple[int, ...]) -> int:
    held = peak = 0
    for kind, _, c in virtual_order(p, v, m, stage):
        held += layers[c] if kind == "F" else -layers[c]
        peak = max(peak, held)
    return peak


def settled_sends(num_stages: int, num_chunks: int, num_micro_batches: int, stage: int) -> dict[Op, list[Op]]:
    """Which of rank ``stage``'s sends each of its receives proves received (the interleaved
    :func:`~.schedule.settled_sends`). Keys: this rank's receiving ops; values: its earlier sends,
    named by the op that sent them (``("F", m, c)``: activations; ``("B", m, c)``: an input
    gradient), that the sender of this receive had itself received before sending it.

    A send of ours is proven received when the peer that received it ran the receiving op before
    the op that sent what we now receive, or is that op (an op receives its input, then sends its
    output: with P = 2 one op receives from and sends to the same peer)."""
    p, v, m = num_stages, num_chunks, num_micro_batches
    last = p * v - 1
    orders = [virtual_order(p, v, m, s) for s in range(p)]
    position = [{op: i for i, op in enumerate(order)} for order in orders]

    def where(kind: str, mb: int, k: int) -> tuple[int, Op]:
        return k % p, (kind, mb, k // p)

    def sent_to(op: Op) -> tuple[int, Op] | None:
        """Who receives what ``op`` of this rank sends, and at which of its ops."""
        kind, mb, c = op
        k = c * p + stage
        if kind == "F":
            return None if k == last else where("F", mb, k + 1)
        return None if k == 0 else where("B", mb, k - 1)

    out: dict[Op, list[Op]] = {}
    pending: list[Op] = []
    for op in orders[stage]:
        need = input_of(op, stage, p, v)
        if need is not None and need[0] == op[0]:  # a receive (the last stage's backward reads its own forward)
            peer, theirs = where(*need)
            if peer == stage:  # P = 1 cannot interleave; a chunk never feeds its own rank
                raise AssertionError("a virtual stage's input is on its own rank")
            before = position[peer][theirs]
            settled = []
            for mine in pending:
                dest = sent_to(mine)
                if dest is not None and dest[0] == peer and position[peer][dest[1]] <= before:
                    settled.append(mine)
            out[op] = settled
            pending = [x for x in pending if x not in settled]
        if sent_to(op) is not None:
            pending.append(op)
    return out
