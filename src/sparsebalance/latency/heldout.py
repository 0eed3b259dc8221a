"""Held-out micro-batches for validating a profile (``sparsebalance profile --validate``): drawn
away from the design's lengths, timed in interleaved rounds, and the steps of online
recalibration a mis-scaled profile needs to predict them."""

from __future__ import annotations

import numpy as np
import torch

from ..models import ModelShapes
from ..timing import median_time
from .model import LatencyModel
from .profile import Profile
from .proxy import ProxyModel
from .sweep import Batch, Timings, prepare_microbatch, random_batches, time_interleaved, topk_batch


def heldout_batches(profile: Profile, count: int, max_tokens: int, seed: int = 1) -> list[Batch]:
    """Held-out micro-batches: 1-4 documents of 128 .. ``max_tokens`` tokens (none of the
    profile's design lengths), densities in [0.04, 0.95] (for a top-k profile: the realized
    densities of top-k layouts of those, :func:`sweep.topk_batch`)."""
    design = [n for point in profile.fit.get("design", []) for n in point["lengths"]]
    batches = random_batches(count, max_tokens, min(128, max_tokens), seed, design)
    if profile.fingerprint.get("layout") == "top-k":
        block = int(profile.fingerprint.get("block_size", 64))
        batches = [topk_batch(b, block) for b in batches]
    return batches


def measure_heldout(
    shapes: ModelShapes,
    batches: list[Batch],
    device: torch.device,
    dtype: str,
    backend: str,
    block_size: int,
    rounds: int = 3,
    layout: str = "threshold",
) -> Timings:
    """Median of ``rounds`` interleaved timings of each held-out micro-batch, and their noise."""
    torch.manual_seed(1)
    proxy = ProxyModel(shapes, precision=dtype).to(device)
    fns = [
        prepare_microbatch(proxy, b[0], b[1], device, backend, block_size, seed=1000 + i, layout=layout)
        for i, b in enumerate(batches)
    ]
    fns[0]()  # warm-up
    return time_interleaved(fns, device, rounds, rounds, seed=1)


def measure_microbatch(
    shapes: ModelShapes,
    lengths: list[int],
    densities: list[float],
    device: torch.device,
    dtype: str,
    backend: str,
    block_size: int,
    warmup: int = 1,
    repeats: int = 3,
    model=None,
) -> float:
    """End-to-end fwd+bwd seconds (median of ``repeats``) of one packed micro-batch."""
    model = model or ProxyModel(shapes, precision=dtype).to(device)
    fn = prepare_microbatch(model, lengths, densities, device, backend, block_size)
    return median_time(fn, device, warmup, repeats)


def recalibration_steps(
    profile: Profile, batches: list, measured: list[float], factor: float = 1.5, tol: float = 0.05
) -> tuple[int | None, float]:
    """Steps of online recalibration a profile scaled by ``factor`` needs to predict the measured
    set within ``max(tol, MAPE of the unscaled model)``; returns (steps or None, final MAPE)."""
    base = LatencyModel(profile)
    target = max(tol, mape(base, batches, measured))
    scaled = Profile.from_json(profile.to_json())
    for table in (scaled.attention.seconds, scaled.layer_other.seconds, scaled.head.seconds):
        for i, row in enumerate(table):
            table[i] = [x * factor for x in row] if isinstance(row, list) else row * factor
    model = LatencyModel(scaled)
    for step in range(1, 4 * len(batches) + 1):
        lengths, dens = batches[(step - 1) % len(batches)]
        model.update(lengths, dens, measured[(step - 1) % len(batches)])
        err = mape(model, batches, measured)
        if err <= target:
            return step, err
    return None, mape(model, batches, measured)


def mape(model: LatencyModel, batches: list, measured: list[float]) -> float:
    pred = np.array([model.predict(lengths, dens) for lengths, dens in batches])
    return float(np.mean(np.abs(pred - np.asarray(measured)) / np.asarray(measured)))
