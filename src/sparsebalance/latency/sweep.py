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

from ..ops import random_layout, topk_density
from ..ops.layout import topk_width
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
    layout: str = "threshold",
    dense_from: float | None = None,
) -> Callable[[], object]:
    """A closure running forward + backward of one packed micro-batch on the proxy model (its
    inputs and per-layer layouts built once, outside the timed call). ``layout``: the shape of
    the random layouts, ``threshold`` or ``top-k`` (see :func:`~sparsebalance.ops.random_layout`;
    give top-k densities through :func:`topk_batch` so they are the realized ones)."""
    s = model.s
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    positions = torch.cat([torch.arange(int(n)) for n in lengths]).to(device)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, s.vocab_size, (int(cu[-1]),), generator=gen).to(device)
    layouts = [
        random_layout(
            cu,
            s.num_heads,
            block_size,
            list(densities),
            seed=seed + i,
            shape=layout,
            dense_from=dense_from,
        ).to(device)
        for i in range(len(model.layers))
    ]
    cu = cu.to(device)
    return lambda: model.step(ids, positions, cu, layouts, block_size, backend, layout)


def topk_batch(batch: Batch, block_size: int) -> Batch:
    """The micro-batch with each density replaced by what a top-k layout of that density really
    keeps (whole rows: :func:`~sparsebalance.ops.layout.topk_width`), so a profile's features
    describe the layouts it times."""
    lengths, dens = batch
    ls = torch.tensor(lengths, dtype=torch.int64)
    width = topk_width(ls, torch.tensor(dens, dtype=torch.float64), block_size).numpy()
    real = topk_density(np.asarray(lengths), width - 2, block_size)
    return list(lengths), [round(float(x), 6) for x in real]


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
    tick: Callable[[], None] | None = None,
) -> Timings:
    """Time every ``fns[i]`` once per round, rounds in random order; stop after ``min_rounds``
    once the next round would overrun ``budget_s`` (None = always ``rounds``).

    With ``warmup`` every function first runs once untimed: a micro-batch's first call allocates
    its buffers for new shapes and is much slower, and with only 2-3 rounds that one call would
    move the median (it is not counted in ``wall_seconds`` nor in the budget). ``tick`` is called
    after every call (a progress bar)."""
    if not 1 <= min_rounds <= rounds:
        raise ValueError(f"need 1 <= min_rounds <= rounds, got {min_rounds}, {rounds}")
    rng = np.random.default_rng(seed)
    out = []
    tick = tick or (lambda: None)
    if warmup:
        for fn in fns:
            fn()
            tick()
    synchronize(device)
    t0 = time.perf_counter()
    for r in range(rounds):
        elapsed = time.perf_counter() - t0
        if r >= min_rounds and budget_s is not None and elapsed * (r + 1) / r > budget_s:
            break
        row = np.zeros(len(fns))
        for i in rng.permutation(len(fns)):
            row[i] = time_once(fns[i], device)
            tick()
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


def core_design(max_tokens: int, block_size: int) -> tuple[list[Batch], list[Batch]]:
    """``(corners, mixes)``. Corners are always timed: the capacity at low density (selection
    and per-token work at their largest), a long dense document, a tiny micro-batch (overheads),
    many short documents. Mixes are good candidates (mixed packs, a long moderately dense one);
    lengths are chosen off block multiples."""
    c, b = max_tokens, block_size
    corners = [
        ([c], [0.05]),
        ([max(b, c // 2 - 7)], [0.9]),
        ([max(1, 2 * b - 3)], [0.6]),
        ([max(1, b + 9)] * 4, [0.2, 0.7, 0.4, 1.0]),
    ]
    mixes = [
        ([c], [0.3]),
        ([max(b, c // 4 + 5)] * 3 + [max(b, c // 4 - 40)], [0.15, 0.85, 0.5, 0.3]),
        ([max(b, c // 8 + 3)], [1.0]),
        ([max(b, c // 2 + 11), max(b, c // 8 - 5)], [0.1, 0.95]),
        ([max(b, c // 16 + 1), max(b, c // 32 + 3), max(b, c // 3)], [0.6, 0.35, 0.7]),
    ]
    fits = [(ls, ds) for ls, ds in corners + mixes if sum(ls) <= c]
    return [p for p in fits if p in corners], [p for p in fits if p not in corners]


def prediction_variance(rows: np.ndarray, info: np.ndarray) -> float:
    """Mean relative prediction variance ``r M^-1 r`` (in units of the timing noise) over
    reference ``rows (K, k)`` for the information matrix ``info (k, k)`` of a design."""
    return float(np.mean(np.einsum("ij,jk,ik->i", rows, np.linalg.inv(info), rows)))


def choose_design(
    max_tokens: int,
    block_size: int,
    cost: Callable[[Batch], float],
    budget_s: float,
    rounds: int,
    featurize: Callable[[Sequence[Batch]], np.ndarray] | None = None,
    max_points: int = 32,
    min_points: int = 10,
    seed: int = 7,
    prep_s: float = 0.05,
) -> list[Batch]:
    """The core design (always: the corners must be covered, or the fit extrapolates) plus
    candidates while their cost (``rounds x cost(batch) + prep_s`` seconds) fits in ``budget_s``;
    the cheapest ones fill the design up to ``min_points``.

    With ``featurize`` (micro-batches -> ``(M, k)`` features of the fitted form) candidates are
    added greedily by *I-optimality per second*: the one that most lowers the mean relative
    prediction variance over micro-batches like the run's (random ones, 1-4 documents up to
    ``max_tokens``) per second it costs. The relative fit weighs row ``x_i / t_i``, so a cheap
    micro-batch of the right mix teaches as much as an expensive one; the corners stay in to
    guard against what the form misses. Without ``featurize``: random candidates in order."""
    core, mixes = core_design(max_tokens, block_size)
    # Candidates (and the reference micro-batches) look like the run's: 1-4 documents of 128 ..
    # max_tokens tokens. Tiny ones would be cheaper still, but per-token cost is not constant
    # down there (small matmuls are less efficient), and the corners already pin the overhead.
    min_len = min(128, max_tokens)
    pool = core + mixes + random_batches(4 * max_points, max_tokens, min_len, seed, (), (0.02, 1.0))
    t = np.array([cost(b) for b in pool])
    spend = rounds * t + prep_s
    chosen = list(range(len(core)))
    spent = float(spend[chosen].sum())
    if featurize is None:
        _add_in_order(chosen, spend, spent, budget_s, max_points)
    else:
        ref = random_batches(64, max_tokens, min_len, seed + 1)
        _add_i_optimal(chosen, pool, t, spend, spent, budget_s, max_points, max_tokens, ref, featurize, cost)
    for i in np.argsort(spend, kind="stable"):
        if len(chosen) >= min_points:
            break
        if i not in chosen:
            chosen.append(int(i))
    return [pool[i] for i in chosen]


def _add_in_order(chosen: list[int], spend: np.ndarray, spent: float, budget_s: float, max_points: int) -> None:
    """Append to ``chosen`` the candidates after it, in order, while their cost fits the budget."""
    for i in range(len(chosen), len(spend)):
        if len(chosen) >= max_points:
            break
        if spent + spend[i] <= budget_s:
            chosen.append(i)
            spent += spend[i]


def _add_i_optimal(
    chosen: list[int],
    pool: list[Batch],
    t: np.ndarray,
    spend: np.ndarray,
    spent: float,
    budget_s: float,
    max_points: int,
    max_tokens: int,
    ref: list[Batch],
    featurize: Callable[[Sequence[Batch]], np.ndarray],
    cost: Callable[[Batch], float],
) -> None:
    """Append to ``chosen`` the candidates of ``pool`` (rough seconds ``t``, cost ``spend``) that
    most lower the relative prediction variance over ``ref`` per second, while they fit."""
    x, xr = featurize(pool), featurize(ref)
    scale = np.maximum((x / t[:, None]).max(0), 1e-300)  # unit columns: a conditioned M
    rows = x / t[:, None] / scale
    refs = xr / np.array([cost(b) for b in ref])[:, None] / scale
    info = rows[chosen].T @ rows[chosen] + 1e-6 * np.eye(x.shape[1])
    tokens = np.array([sum(b[0]) for b in pool])
    # Coverage first (the form may miss something at some size): the best point of every
    # octave of micro-batch tokens down to max_tokens / 16; then the best anywhere.
    octaves = [(max_tokens / 2 ** (k + 1), max_tokens / 2**k) for k in range(4)]
    masks = [(tokens > lo) & (tokens <= hi) for lo, hi in octaves] + [np.ones(len(pool), bool)]
    for mask in masks:
        if mask is not masks[-1] and any(mask[i] for i in chosen):
            continue
        while len(chosen) < max_points:
            i = _best_candidate(rows, refs, info, mask, chosen, spend, spent, budget_s)
            if i is None:
                break
            chosen.append(i)
            spent += spend[i]
            info += np.outer(rows[i], rows[i])
            if mask is not masks[-1]:
                break


def _best_candidate(rows, refs, info, mask, chosen, spend, spent: float, budget_s: float) -> int | None:
    """The row in ``mask``, not yet chosen and within budget, that most lowers the mean relative
    prediction variance over ``refs`` per second it costs; None when there is none."""
    inv = np.linalg.inv(info)
    # Sherman-Morrison: adding row r lowers sum_j r_j' M^-1 r_j by
    # sum_j (r_j' M^-1 r)^2 / (1 + r' M^-1 r).
    cross = refs @ inv @ rows.T  # (K, M)
    drop = (cross**2).mean(0) / (1.0 + np.einsum("ij,jk,ik->i", rows, inv, rows))
    score = np.where(mask, drop / spend, -np.inf)
    score[chosen] = -np.inf
    score[spent + spend > budget_s] = -np.inf
    i = int(np.argmax(score))
    return i if np.isfinite(score[i]) else None
