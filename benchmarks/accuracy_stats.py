"""Paired-by-seed statistics for ``benchmarks/accuracy.py``: difference, 95 % interval, and an
exact one-sided sign-flip permutation test.

Variant A and B trained with the same seed saw the same documents in the same order, so
``d_s = A_s - B_s`` is the comparison and the seeds are the replicates. Reported per comparison:

- the mean difference and its 95 % t-interval (``mean ± t_{0.975, n-1} sd / sqrt(n)``);
- the exact one-sided sign-flip (randomization) test of the mean difference: under H0 (no
  effect, differences symmetric about 0) every one of the ``2^n`` sign patterns of ``|d_s|`` is
  equally likely; ``p = #{patterns with sum <= observed sum} / 2^n`` for H1 "A < B" (``>=`` for
  "A > B"). With 5 seeds the smallest reachable p is 1/32 = 0.031 (all five differences in the
  hypothesised direction), so the test *can* reach p < 0.05 at 5 seeds; a two-sided version
  (min 2/32 = 0.0625) and the sign test cannot;
- the paired t-test's two-sided p (weak evidence at these seed counts: df = n - 1).
"""

from __future__ import annotations

import itertools
import math
import statistics

import numpy as np

MAX_EXACT = 20
"""Up to this many pairs the sign-flip test enumerates every pattern (2^20 sums)."""


def t_two_sided_p(t: float, df: int) -> float:
    """Two-sided p-value of Student's t with integer ``df`` (Abramowitz & Stegun 26.7.3-4)."""
    if df < 1:
        return float("nan")
    if math.isinf(t):
        return 0.0
    theta = math.atan(abs(t) / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2:  # odd
        total, term = 0.0, math.cos(theta)
        for k in range(1, (df - 1) // 2 + 1):
            if k > 1:
                term *= c2 * (2 * k - 2) / (2 * k - 1)
            total += term
        a = 2 / math.pi * (theta + math.sin(theta) * total) if df > 1 else 2 * theta / math.pi
    else:
        total, term = 1.0, 1.0
        for k in range(1, df // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        a = math.sin(theta) * total
    return max(0.0, min(1.0, 1.0 - a))


def t_quantile(q: float, df: int) -> float:
    """The ``q`` quantile (``q`` in (0.5, 1)) of Student's t with ``df``, by bisection on
    :func:`t_two_sided_p` (1e-10)."""
    if not 0.5 < q < 1.0 or df < 1:
        raise ValueError(f"need 0.5 < q < 1 and df >= 1, got q={q}, df={df}")
    target = 2 * (1 - q)
    lo, hi = 0.0, 1e6
    while hi - lo > 1e-10 * max(1.0, hi):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_two_sided_p(mid, df) > target else (lo, mid)
    return 0.5 * (lo + hi)


def sign_flip_p(d: list[float], alternative: str = "less") -> float:
    """Exact one-sided sign-flip permutation p-value of ``sum(d)`` (``alternative``: ``"less"``,
    H1 mean < 0, or ``"greater"``). Exact for up to :data:`MAX_EXACT` pairs."""
    if alternative not in ("less", "greater"):
        raise ValueError(f"alternative must be 'less' or 'greater', got {alternative!r}")
    n = len(d)
    if n == 0:
        return float("nan")
    if n > MAX_EXACT:
        raise ValueError(f"sign_flip_p enumerates 2^n patterns: at most {MAX_EXACT} pairs, got {n}")
    a = np.abs(np.asarray(d, dtype=np.float64))
    signs = np.array(list(itertools.product((1.0, -1.0), repeat=n)))  # (2^n, n)
    sums = signs @ a
    observed = float(np.sum(d))
    eps = 1e-12 * max(1.0, float(a.sum()))  # equal sums up to rounding count as ties
    hits = sums <= observed + eps if alternative == "less" else sums >= observed - eps
    return float(hits.mean())


def paired(a: list[float], b: list[float], alternative: str = "less") -> dict:
    """Paired comparison of ``a - b`` over seeds (same order): mean, std, 95 % interval,
    wins/losses/ties, exact one-sided sign-flip p (``alternative`` about ``a - b``) and its
    two-sided form (twice the smaller tail), paired t p."""
    d = [x - y for x, y in zip(a, b, strict=True)]
    n = len(d)
    mean = statistics.mean(d)
    sd = statistics.stdev(d) if n > 1 else float("nan")
    if n > 1:
        half = t_quantile(0.975, n - 1) * sd / math.sqrt(n)
        t_p = t_two_sided_p(mean / (sd / math.sqrt(n)), n - 1) if sd > 0 else float(mean == 0)
    else:
        half, t_p = float("nan"), float("nan")
    wins = sum(x > 1e-12 for x in d)
    losses = sum(x < -1e-12 for x in d)
    return {
        "n": n,
        "diffs": d,
        "mean": mean,
        "std": sd,
        "ci95": (mean - half, mean + half),
        "wins": wins,
        "losses": losses,
        "ties": n - wins - losses,
        "alternative": alternative,
        "p_perm": sign_flip_p(d, alternative),
        "p_perm_two_sided": min(1.0, 2 * min(sign_flip_p(d, "less"), sign_flip_p(d, "greater"))),
        "p_t": t_p,
    }


def min_p(n: int) -> float:
    """The smallest one-sided sign-flip p reachable with ``n`` pairs: ``2^-n``."""
    return 2.0**-n
