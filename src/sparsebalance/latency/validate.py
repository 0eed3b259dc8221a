"""Validation of a latency profile: end-to-end timings of held-out random micro-batches (off-grid
lengths and densities) against the model's predictions, how many online recalibration steps a
profile scaled by 1.5x needs to recover, and the cost of one batched prediction."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import numpy as np
import torch

from ..models import ModelShapes
from .measure import DTYPES, measure_microbatch, random_microbatches, recalibration_steps
from .model import LatencyModel
from .profile import Profile


def validate_profile(
    profile: Profile,
    shapes: ModelShapes,
    device: torch.device,
    dtype: str,
    backend: str,
    block_size: int,
    num_batches: int = 30,
    max_tokens: int = 4096,
    progress: Callable[[Iterable], Iterable] = iter,
) -> dict:
    """JSON-ready: ``mape``, ``max_error``, ``recalibration_steps_from_1.5x``,
    ``recalibrated_mape``, ``predict_many_10k_seconds`` and every held-out ``batches`` entry
    (``lengths``, ``densities``, ``measured`` and ``predicted`` seconds).

    ``progress`` wraps the iteration over held-out micro-batches (e.g. a tqdm bar).
    """
    from .proxy import ProxyModel

    if num_batches < 1:
        raise ValueError(f"--num-batches must be >= 1, got {num_batches}")
    model = LatencyModel(profile)
    batches = random_microbatches(profile, num_batches, max_tokens, seed=1)
    proxy = ProxyModel(shapes).to(device, DTYPES[dtype])
    measured, predicted = [], []
    for lengths, dens in progress(batches):
        measured.append(measure_microbatch(
            shapes, lengths, dens, device, dtype, backend, block_size, model=proxy
        ))  # fmt: skip
        predicted.append(model.predict(lengths, dens))
    meas, pred = np.asarray(measured), np.asarray(predicted)
    err = np.abs(pred - meas) / meas
    steps, final = recalibration_steps(profile, batches, measured)
    return {
        "num_batches": len(batches),
        "mape": float(err.mean()),
        "max_error": float(err.max()),
        "recalibration_steps_from_1.5x": steps,
        "recalibrated_mape": final,
        "predict_many_10k_seconds": time_predict_many(model, profile),
        "batches": [
            {"lengths": b[0], "densities": b[1], "measured": m, "predicted": p}
            for b, m, p in zip(batches, measured, predicted, strict=True)
        ],
    }


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
