"""The physical form of a micro-batch's forward+backward time, and its least-squares fit.

One micro-batch of N documents (lengths ``L_i``, attention densities ``d_i``, ``T = sum L_i``
tokens) on a model of ``n_layers`` layers, block size ``B``::

    t = a * n_layers * sum_i pairs(L_i, d_i)      # block-sparse attention: kept block pairs
      + b * T                                     # projections, MLP, norms, head: per token
      + c * n_layers * (T / B)^2                  # block selection scores every segment pair
      + e * n_layers * N                          # per-document work (segments, masks)
      + f                                         # per-call overheads (launches, optimizer-free)

``pairs(L, d)`` is the number of (query block, key block) pairs the budget keeps per head:
``sum_{q=1..L/B} max(1, round(d * q))`` (the rule of :func:`sparsebalance.ops.random_layout`),
linear between whole blocks. The five coefficients are fitted on measured whole micro-batches
by non-negative least squares on *relative* errors (every micro-batch counts the same, whatever
its size: that is the error validation and balancing care about).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

FEATURES = ("attention_pairs", "tokens", "selection_pairs", "documents", "constant")


def kept_pairs(lengths: np.ndarray, densities: np.ndarray, block_size: int) -> np.ndarray:
    """Kept (query block, key block) pairs per head, elementwise: float ``lengths.shape``."""
    lengths, densities = np.broadcast_arrays(np.asarray(lengths, float), np.asarray(densities, float))
    nb = lengths / block_size
    lo = np.floor(nb).astype(np.int64)
    top = int(lo.max(initial=0)) + 1
    q = np.arange(1, top + 1, dtype=float)  # query block index inside the document
    flat_d = densities.reshape(-1)
    per_row = np.maximum(1.0, np.round(flat_d[:, None] * q[None, :]))  # (n, top)
    cum = np.concatenate([np.zeros((flat_d.size, 1)), np.cumsum(per_row, 1)], 1)  # S(0..top)
    flat_lo = lo.reshape(-1)
    rows = np.arange(flat_d.size)
    s_lo, s_hi = cum[rows, flat_lo], cum[rows, np.minimum(flat_lo + 1, top)]
    frac = nb.reshape(-1) - flat_lo
    return (s_lo + frac * (s_hi - s_lo)).reshape(lengths.shape)


def effective_density(densities, dense_from: float | None) -> np.ndarray:
    """What a document of each density costs, as a density of the sparse kernel: the density
    itself, or ``dense_from`` from there on (such documents run whole on the dense kernel, which
    costs what the sparse one does at the crossover)."""
    d = np.asarray(densities, float)
    return d if dense_from is None else np.minimum(d, dense_from)


def features(
    batches: Sequence[tuple[Sequence[int], Sequence[float]]],
    num_layers: int,
    block_size: int,
    dense_from: float | None = None,
) -> np.ndarray:
    """``(M, 5)`` design matrix (columns :data:`FEATURES`) of M micro-batches ``(lengths,
    densities)``; multiply by the coefficients for seconds. ``dense_from``: the profile's
    crossover (:func:`effective_density`)."""
    rows = []
    for lengths, dens in batches:
        lengths = np.asarray(lengths, float)
        dens = effective_density(np.broadcast_to(np.asarray(dens, float), lengths.shape), dense_from)
        tokens = float(lengths.sum())
        rows.append(
            [
                num_layers * float(kept_pairs(lengths, dens, block_size).sum()),
                tokens,
                num_layers * (tokens / block_size) ** 2,
                num_layers * float(lengths.size),
                1.0,
            ]
        )
    return np.asarray(rows, float)


def nnls(a: np.ndarray, b: np.ndarray, iters: int = 200) -> np.ndarray:
    """Non-negative least squares ``min |a x - b|, x >= 0`` (Lawson-Hanson active set)."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(iters):
        grad = a.T @ (b - a @ x)
        if passive.all() or grad[~passive].max(initial=-np.inf) <= 1e-12 * max(1.0, abs(b).max()):
            break
        passive[np.argmax(np.where(passive, -np.inf, grad))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if z[passive].min() > 0:
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / np.maximum(x[neg] - z[neg], 1e-300))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
    return x


@dataclass
class FormFit:
    """Fitted coefficients of the form (seconds per feature unit, :data:`FEATURES` order)."""

    coefficients: list[float]
    """``[a, b, c, e, f]`` of the module docstring, each >= 0."""
    loo_errors: list[float]
    """Leave-one-out relative error of every fitted micro-batch (prediction / measured - 1)."""

    @property
    def loo_mape(self) -> float:
        return float(np.mean(np.abs(self.loo_errors))) if self.loo_errors else float("nan")

    def predict(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x, float) @ np.asarray(self.coefficients)


def fit_form(x: np.ndarray, seconds: np.ndarray, ridge: float = 1e-3, floor: Sequence[float] | None = None) -> FormFit:
    """Relative-error NNLS of ``seconds (M,)`` on features ``x (M, 5)``, with leave-one-out errors.

    Columns are scaled to unit size first; a small ridge toward the floor keeps coefficients that
    the design does not pin down (collinear columns) from taking extreme values. ``floor``: the
    least each coefficient may be (zeros by default; see :func:`attention_floor`).
    """
    x, y = np.asarray(x, float), np.asarray(seconds, float)
    lo = np.zeros(x.shape[1] if x.ndim == 2 else 0) if floor is None else np.asarray(floor, float)
    if x.ndim != 2 or x.shape[0] != y.shape[0] or x.shape[0] < 2:
        raise ValueError(f"fit_form: need (M, k) features and (M,) times, M >= 2; got {x.shape}")
    if not np.all(np.isfinite(y) & (y > 0)):
        raise ValueError("fit_form: measured times must be finite and > 0")

    def solve(rows: np.ndarray) -> np.ndarray:
        a = x[rows] / y[rows, None]
        scale = np.maximum(np.abs(a).max(0), 1e-300)
        a_s = a / scale
        k = a.shape[1]
        a_aug = np.vstack([a_s, np.sqrt(ridge) * np.eye(k)])
        b_aug = np.concatenate([1.0 - a @ lo, np.zeros(k)])  # fit what is above the floor
        return lo + nnls(a_aug, b_aug) / scale

    coef = solve(np.arange(len(y)))
    loo = []
    if len(y) > x.shape[1]:
        for i in range(len(y)):
            c = solve(np.delete(np.arange(len(y)), i))
            loo.append(float(x[i] @ c / y[i] - 1.0))
    return FormFit(coef.tolist(), loo)


def fit_form_robust(
    x: np.ndarray,
    seconds: np.ndarray,
    noise: float = 0.0,
    threshold: float = 3.5,
    max_share: float = 0.2,
    floor: Sequence[float] | None = None,
) -> tuple[FormFit, list[int]]:
    """:func:`fit_form`, then drop the micro-batches whose relative residual is beyond
    ``threshold`` x a robust scale (1.4826 x the median absolute residual, at least ``noise``,
    the expected relative spread of one measured time) and refit. At most ``max_share`` of the
    points go (the worst first), and never so many that fewer than ``k + 2`` remain. Returns the
    fit and the dropped indices (a burst of load that hit every round of one micro-batch passes
    the median over rounds; it does not pass this)."""
    x, y = np.asarray(x, float), np.asarray(seconds, float)
    fit = fit_form(x, y, floor=floor)
    resid = fit.predict(x) / y - 1.0
    scale = max(1.4826 * float(np.median(np.abs(resid))), noise, 1e-12)
    limit = min(int(max_share * len(y)), len(y) - x.shape[1] - 2)
    worst = [int(i) for i in np.argsort(-np.abs(resid)) if abs(resid[i]) > threshold * scale]
    dropped = sorted(worst[: max(limit, 0)])
    if not dropped:
        return fit, []
    keep = np.setdiff1d(np.arange(len(y)), dropped)
    return fit_form(x[keep], y[keep], floor=floor), dropped


def attention_floor(per_token_seconds: float, token_flops: float, heads: int, head_dim: int, block_size: int) -> float:
    """The least the attention coefficient ``a`` (seconds per kept block pair and layer) can be:
    a kept pair is ``14 B^2 d H`` FLOPs forward + backward (two matmuls forward, five backward),
    and attention is taken to run at no more than 4x the FLOP rate the rest of the model reaches
    (``token_flops`` per token in ``per_token_seconds``). Timing noise can hide the attention
    term of a short, quick profile entirely (NNLS puts it at 0); a profile that prices attention
    at nothing would let DST raise every budget for free."""
    if per_token_seconds <= 0 or token_flops <= 0:
        return 0.0
    pair_flops = 14.0 * block_size * block_size * head_dim * heads
    return 0.25 * pair_flops * per_token_seconds / token_flops


def density_grid() -> list[float]:
    """Densities the profile tables are evaluated at (dense where the keep-one floor bends)."""
    low = [0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.125, 0.15, 0.175]
    return low + [round(0.2 + 0.05 * i, 3) for i in range(17)]


def length_grid(max_len: int, per_octave: int = 8) -> list[int]:
    """Lengths 1 .. ``max_len``, ``per_octave`` geometric steps per doubling (integers)."""
    n = int(np.ceil(np.log2(max(max_len, 2)) * per_octave)) + 1
    return sorted({round(x) for x in np.geomspace(1, max_len, n)} | {max_len})


def form_tables(
    coefficients: Sequence[float],
    num_layers: int,
    block_size: int,
    max_len: int,
    layer_token_share: float,
    dense_from: float | None = None,
) -> dict:
    """The fitted form written as the profile's tables (what :class:`LatencyModel` reads).

    Per layer and document: ``attention(L, d) = a pairs(L, d) + e``; per layer and micro-batch:
    ``layer_other(T) = share b T / num_layers + c (T/B)^2 + f / num_layers``; once:
    ``head(T) = (1 - share) b T``. ``layer_token_share`` splits the per-token term between the
    layers and the head (it cannot be told apart from micro-batch times: both grow with T).
    ``dense_from``: the crossover; the attention table is flat from it (:func:`effective_density`).
    """
    a, b, c, e, f = (float(x) for x in coefficients)
    lengths = np.asarray(length_grid(max_len), float)
    dens = np.asarray(density_grid())
    cost_dens = effective_density(dens, dense_from)
    attention = a * kept_pairs(lengths[:, None], cost_dens[None, :], block_size) + e
    other = layer_token_share * b * lengths / num_layers + c * (lengths / block_size) ** 2
    other += f / num_layers
    head = (1.0 - layer_token_share) * b * lengths
    return {
        "lengths": lengths.astype(int).tolist(),
        "densities": dens.tolist(),
        "attention": attention.tolist(),
        "layer_other": other.tolist(),
        "head": head.tolist(),
    }
