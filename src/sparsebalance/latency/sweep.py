"""Timing many micro-batches robustly on a shared machine, and choosing which ones to time.

Every micro-batch is prepared once (ids, positions, layouts) and timed in *interleaved rounds*:
round r times every micro-batch once, in a fresh random order. A burst of load from another job
then hits different micro-batches in different rounds, and the per-batch median over rounds
rejects it; the spread across rounds is the machine's timing noise (coefficient of variation).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..ops import random_layout
from ..timing import synchronize, time_once
from .proxy import ProxyModel

Batch = tuple[list[int], list[float]]


def prepare_microbatch(
    model: ProxyModel,
    lengths: Sequence[int],
    densities: Sequence[float],
    device: torch.device,
    backend: str,
    block_size: int,
    seed: int = 0,
) -> Callable[[], object]:
    """A closure running forward + backward of one packed micro-batch on the proxy model (its
    inputs and per-layer layouts built once, outside the timed call)."""
    s = model.s
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    positions = torch.cat([torch.arange(int(n)) for n in lengths]).to(device)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, s.vocab_size, (int(cu[-1]),), generator=gen).to(device)
    layouts = [
        random_layout(cu, s.num_heads, block_size, list(densities), seed=seed + i).to(device)
        for i in range(len(model.layers))
    ]
    cu = cu.to(device)
    return lambda: model.step(ids, positions, cu, layouts, block_size, backend)


@dataclass
class Timings:
    """Interleaved timings of M micro-batches."""

    seconds: np.ndarray
    """``(R, M)`` seconds of every round (R rounds actually run) and micro-batch."""
    wall_seconds: float
    """Wall time of the rounds (preparation excluded)."""

    @property
    def median(self) -> np.ndarray:
        """``(M,)`` robust time of each micro-batch: median over rounds."""
        return np.median(self.seconds, 0)

    @property
    def cv(self) -> np.ndarray:
        """``(M,)`` coefficient of variation of one timing (std / mean over rounds; 0 if R < 2)."""
        if self.seconds.shape[0] < 2:
            return np.zeros(self.seconds.shape[1])
        return self.seconds.std(0, ddof=1) / self.seconds.mean(0)

    def outliers(self, factor: float = 1.5) -> int:
        """Single timings more than ``factor`` x their micro-batch's median (rejected by it)."""
        return int((self.seconds > factor * self.median[None, :]).sum())

    def noise(self) -> dict:
        """The noise report stored with a profile."""
        cv = self.cv
        return {
            "cv_median": float(np.median(cv)),
            "cv_p90": float(np.quantile(cv, 0.9)),
            "rounds": int(self.seconds.shape[0]),
            "timings": int(self.seconds.size),
            "outliers_rejected": self.outliers(),
        }


def time_interleaved(
    fns: Sequence[Callable[[], object]],
    device: torch.device,
    rounds: int = 3,
    min_rounds: int = 2,
    budget_s: float | None = None,
    seed: int = 0,
    warmup: bool = True,
) -> Timings:
    """Time every ``fns[i]`` once per round, rounds in random order; stop after ``min_rounds``
    once the next round would overrun ``budget_s`` (None = always ``rounds``).

    With ``warmup`` every function first runs once untimed: a micro-batch's first call allocates
    its buffers for new shapes and is much slower, and with only 2-3 rounds that one call would
    move the median (it is not counted in ``wall_seconds`` nor in the budget)."""
    if not 1 <= min_rounds <= rounds:
        raise ValueError(f"need 1 <= min_rounds <= rounds, got {min_rounds}, {rounds}")
    rng = np.random.default_rng(seed)
    out = []
    if warmup:
        for fn in fns:
            fn()
    synchronize(device)
    t0 = time.perf_counter()
    for r in range(rounds):
        elapsed = time.perf_counter() - t0
        if r >= min_rounds and budget_s is not None and elapsed * (r + 1) / r > budget_s:
            break
        row = np.zeros(len(fns))
        for i in rng.permutation(len(fns)):
            row[i] = time_once(fns[i], device)
        out.append(row)
    return Timings(np.asarray(out), time.perf_counter() - t0)


def random_batches(
    count: int,
    max_tokens: int,
    min_len: int,
    seed: int,
    exclude: Sequence[int] = (),
    densities: tuple[float, float] = (0.04, 0.95),
) -> list[Batch]:
    """``count`` micro-batches of 1-4 documents: lengths log-uniform in ``[min_len, max_tokens]``
    (summing to at most ``max_tokens``, none in ``exclude``), densities uniform in ``densities``."""
    if max_tokens < min_len:
        raise ValueError(f"max_tokens ({max_tokens}) must be >= min_len ({min_len})")
    rng = np.random.default_rng(seed)
    banned = set(int(x) for x in exclude)
    out: list[Batch] = []
    while len(out) < count:
        n = int(rng.integers(1, 5))
        lengths = np.exp(rng.uniform(np.log(min_len), np.log(max_tokens), n)).astype(int)
        if lengths.sum() > max_tokens or banned.intersection(lengths.tolist()):
            continue
        dens = rng.uniform(*densities, n).round(3)
        out.append((lengths.tolist(), dens.tolist()))
    return out


def core_design(max_tokens: int, block_size: int) -> list[Batch]:
    """Micro-batches at the corners of the feature space: long sparse, long dense-ish, many small
    documents, a tiny one (overheads), mixed packs. Lengths are chosen off block multiples."""
    c, b = max_tokens, block_size
    pick = [
        ([c], [0.05]),
        ([c], [0.3]),
        ([max(b, c // 2 - 7)], [0.9]),
        ([max(b, c // 4 + 5)] * 3 + [max(b, c // 4 - 40)], [0.15, 0.85, 0.5, 0.3]),
        ([max(1, 2 * b - 3)], [0.6]),
        ([max(1, b + 9)] * 4, [0.2, 0.7, 0.4, 1.0]),
        ([max(b, c // 8 + 3)], [1.0]),
        ([max(b, c // 2 + 11), max(b, c // 8 - 5)], [0.1, 0.95]),
        ([max(b, c // 16 + 1), max(b, c // 32 + 3), max(b, c // 3)], [0.6, 0.35, 0.7]),
    ]
    return [(ls, ds) for ls, ds in pick if sum(ls) <= c]


def choose_design(
    max_tokens: int,
    block_size: int,
    cost: Callable[[Batch], float],
    budget_s: float,
    rounds: int,
    max_points: int = 32,
    min_points: int = 10,
    seed: int = 7,
) -> list[Batch]:
    """The core design (always: the corners must be covered, or the fit extrapolates) plus
    random micro-batches while their estimated cost (``cost(batch)`` seconds, x ``rounds``) fits
    in ``budget_s``; the cheapest random ones fill the design up to ``min_points``."""
    core = core_design(max_tokens, block_size)
    pool = core + random_batches(4 * max_points, max_tokens, max(1, block_size // 2), seed, (),
                                 (0.02, 1.0))  # fmt: skip
    costs = [rounds * cost(b) for b in pool]
    chosen = list(range(len(core)))
    spent = sum(costs[: len(core)])
    for i in range(len(core), len(pool)):
        if len(chosen) >= max_points:
            break
        if spent + costs[i] <= budget_s:
            chosen.append(i)
            spent += costs[i]
    for i in np.argsort(costs, kind="stable"):
        if len(chosen) >= min_points:
            break
        if i not in chosen:
            chosen.append(int(i))
    return [pool[i] for i in chosen]
