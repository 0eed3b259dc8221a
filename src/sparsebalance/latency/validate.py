"""Held-out validation of a profile: errors, a bootstrap confidence interval, and a breakdown
that says *what* is mispredicted (attention by length and density, the per-token part, the
fixed overheads), and the error split into *level* and *shape*.

Level and shape: ``level`` is the median of prediction / measured - 1, one global scale; the
*shape* error is what remains once it is divided out (``shape_mape``, ``shape_max_error``). The
trainer's online recalibration fixes the level within 1-2 steps, so the shape error is what
decides which rank a step's plan makes the straggler. On a shared machine the level also
carries the machine's own drift between profiling and validation (other tenants, clocks).

The breakdown splits every prediction into three parts with the model's own per-layer units:
attention (``num_layers * sum layer_attention_seconds``), the fixed part (``microbatch_overhead``)
and the rest (token-proportional: projections, MLP, head). The relative error of micro-batch i is
then regressed on those shares, ``err_i ~ sum_c share_ic * delta_c``: ``delta_c`` is how far off
component c is on its own (+0.10 = predicted 10 % too high).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from ..models import ModelShapes
from .heldout import heldout_batches, measure_heldout, recalibration_steps
from .model import LatencyModel
from .profile import Profile
from .sweep import Batch

COMPONENTS = ("attention", "per_token", "overhead")


def bootstrap_ci(
    errors: np.ndarray, stat=np.mean, draws: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of ``stat(|errors|)`` over micro-batches."""
    e = np.abs(np.asarray(errors, float))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, e.size, (draws, e.size))
    vals = stat(e[idx], axis=1)
    lo, hi = np.quantile(vals, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def shares(model: LatencyModel, batches: Sequence[Batch]) -> np.ndarray:
    """``(M, 3)`` fraction of each prediction that is attention, per-token work, fixed overhead."""
    out = []
    for lengths, dens in batches:
        total = model.predict(lengths, dens)
        attn = model.num_layers * float(
            np.sum(model.layer_attention_seconds(np.asarray(lengths, float), np.asarray(dens)))
        )
        fixed = min(model.microbatch_overhead(), max(total - attn, 0.0))
        out.append([attn, total - attn - fixed, fixed])
    arr = np.asarray(out)
    return arr / arr.sum(1, keepdims=True)


def _group(name: str, mask: np.ndarray, err: np.ndarray) -> dict:
    n = int(mask.sum())
    return {
        "group": name,
        "n": n,
        "mape": float(np.mean(np.abs(err[mask]))) if n else None,
        "bias": float(np.mean(err[mask])) if n else None,
    }


def breakdown(model: LatencyModel, batches: Sequence[Batch], err: np.ndarray) -> dict:
    """Per-component errors (see module docstring) and MAPE by length, density, documents."""
    err = np.asarray(err, float)
    sh = shares(model, batches)
    used = sh.max(0) > 0.02  # a component that is ~0 everywhere cannot be judged
    delta = np.full(3, np.nan)
    if used.sum() and len(err) > used.sum():
        delta[used] = np.linalg.lstsq(sh[:, used], err, rcond=None)[0]
    longest = np.array([max(b[0]) for b in batches])
    mean_d = np.array([np.average(b[1], weights=b[0]) for b in batches])
    ndocs = np.array([len(b[0]) for b in batches])
    groups = [
        _group("longest doc <= 512", longest <= 512, err),
        _group("longest doc 513-2048", (longest > 512) & (longest <= 2048), err),
        _group("longest doc > 2048", longest > 2048, err),
        _group("density < 0.3", mean_d < 0.3, err),
        _group("density 0.3-0.7", (mean_d >= 0.3) & (mean_d <= 0.7), err),
        _group("density > 0.7", mean_d > 0.7, err),
        _group("1 document", ndocs == 1, err),
        _group("2-4 documents", ndocs > 1, err),
        _group("attention-dominated (> 50 %)", sh[:, 0] > 0.5, err),
        _group("per-token / overhead-dominated", sh[:, 0] <= 0.5, err),
    ]
    return {
        "component_error": {c: (None if np.isnan(d) else float(d)) for c, d in zip(COMPONENTS, delta, strict=True)},
        "mean_share": {c: float(s) for c, s in zip(COMPONENTS, sh.mean(0), strict=True)},
        "groups": groups,
    }


def validation_summary(model: LatencyModel, batches: Sequence[Batch], measured: Sequence[float]) -> dict:
    """MAPE with a 95 % bootstrap interval, max error, bias, level and shape errors (module
    docstring) and the breakdown."""
    meas = np.asarray(measured, float)
    pred = np.array([model.predict(lengths, dens) for lengths, dens in batches])
    err = pred / meas - 1.0
    lo, hi = bootstrap_ci(err)
    level = float(np.median(pred / meas))
    shape = pred / (meas * level) - 1.0
    return {
        "num_batches": len(batches),
        "mape": float(np.mean(np.abs(err))),
        "mape_ci95": [lo, hi],
        "max_error": float(np.max(np.abs(err))),
        "bias": float(np.mean(err)),
        "level": level - 1.0,
        "shape_mape": float(np.mean(np.abs(shape))),
        "shape_max_error": float(np.max(np.abs(shape))),
        "breakdown": breakdown(model, batches, err),
        "batches": [
            {
                "lengths": list(b[0]),
                "densities": list(b[1]),
                "measured": float(m),
                "predicted": float(p),
                "error": float(e),
            }
            for b, m, p, e in zip(batches, meas, pred, err, strict=True)
        ],
    }


def validate_profile(
    profile: Profile,
    shapes: ModelShapes,
    device: torch.device,
    dtype: str,
    backend: str,
    block_size: int,
    num_batches: int = 30,
    max_tokens: int | None = None,
    rounds: int = 3,
) -> dict:
    """Time ``num_batches`` held-out micro-batches (:func:`heldout.heldout_batches`, up to
    ``max_tokens``, default the profile's max length; median of ``rounds`` interleaved rounds)
    and return :func:`validation_summary` plus ``recalibration_steps_from_1.5x``,
    ``recalibrated_mape``, ``predict_many_10k_seconds``, ``validation_noise``, ``profile_noise``.
    """
    if num_batches < 2:
        raise ValueError(f"--num-batches must be >= 2, got {num_batches}")
    max_tokens = max_tokens or int(profile.meta.get("max_len", 4096))
    if max_tokens < 128:
        raise ValueError(f"--max-tokens must be >= 128, got {max_tokens}")
    model = LatencyModel(profile)
    batches = heldout_batches(profile, num_batches, max_tokens, seed=1)
    layout = profile.fingerprint.get("layout", "threshold")
    timings = measure_heldout(shapes, batches, device, dtype, backend, block_size, rounds, layout)
    measured = timings.median.tolist()
    result = {"max_tokens": max_tokens, **validation_summary(model, batches, measured)}
    steps, final = recalibration_steps(profile, batches, measured)
    result["recalibration_steps_from_1.5x"] = steps
    result["recalibrated_mape"] = final
    result["predict_many_10k_seconds"] = time_predict_many(model, profile)
    result["validation_noise"] = timings.noise()
    result["profile_noise"] = profile.noise
    return result


def time_predict_many(model: LatencyModel, profile: Profile, count: int = 10_000) -> float:
    """Seconds to predict ``count`` random in-grid micro-batches of 1-4 documents at once."""
    rng = np.random.default_rng(0)
    lo, hi = profile.attention.lengths[0], profile.attention.lengths[-1] // 4
    lengths = rng.integers(lo, max(lo + 1, hi), (count, 4)) * (rng.random((count, 4)) < 0.7)
    lengths[:, 0] = np.maximum(lengths[:, 0], lo)
    dens = rng.uniform(profile.attention.densities[0], 1.0, (count, 4))
    t0 = time.perf_counter()
    model.predict_many(lengths, dens)
    return time.perf_counter() - t0
