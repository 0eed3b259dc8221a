"""Latency model: profile the hardware, predict micro-batch times, recalibrate online.

```python
model = LatencyModel(load_profile("profile.json"))       # or default_latency_model(shapes, device)
model.predict([4096, 1000], [0.2, 0.6])                  # seconds, fwd+bwd of one micro-batch
model.update([4096, 1000], [0.2, 0.6], measured_seconds)  # online recalibration
```
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

from ..models import ModelShapes, load_shapes
from .analytic import ACCELERATORS, allreduce_seconds, analytic_profile
from .context import ContextCost, Links, analytic_links, context_cost, links_from_profile
from .model import LatencyModel, OutsideGridWarning
from .profile import (
    SCHEMA,
    Profile,
    ProfileMismatchWarning,
    check_profile_fits,
    fingerprint,
    load_profile,
)

SHIPPED_DIR = Path(__file__).parent / "profiles"
CACHE_DIR = Path.home() / ".cache" / "sparsebalance" / "profiles"


def default_latency_model(
    shapes: ModelShapes,
    device: torch.device,
    dtype: str = "fp32",
    backend: str = "torch",
    block_size: int = 64,
    cache_dir: Path | None = None,
    max_len: int | None = None,
    budget_s: float = 50.0,
    threads: int | None = None,
    layout: str = "threshold",
) -> LatencyModel:
    """A latency model for the running setup with no manual step.

    Order: a cached profile with this exact fingerprint; a profile shipped with the package with
    this fingerprint; otherwise a profile for micro-batches up to ``max_len`` tokens (default: the
    model's context) is measured now (under a minute on a 2-core CPU, see :mod:`.measure`), its
    noise line printed, and cached. The fingerprint, hence the cache key, holds the CPU
    ``threads`` the profile is for (default: this process's count, which is what a trainer rank
    runs with) and the profile schema: a profile for other threads, or of an older schema, is
    not reused. ``layout``: ``top-k`` for top-k budgets (a profile of top-k layouts).
    """
    from .measure import measure_profile, noise_line

    running = fingerprint(shapes, device, dtype, backend, block_size, threads, layout)
    running["max_len"] = max_len or shapes.max_context
    running["schema"] = SCHEMA
    key = hashlib.sha1(json.dumps(running, sort_keys=True).encode()).hexdigest()[:12]
    cache = Path(cache_dir or CACHE_DIR) / f"{shapes.name.replace('/', '_')}-{key}.json"
    for path in [cache, *sorted(SHIPPED_DIR.glob("*.json"))]:
        if path.is_file():
            try:
                profile = load_profile(path)
            except ValueError:
                continue
            if profile.fingerprint == running:
                return LatencyModel(profile)
    profile = measure_profile(
        shapes, device, dtype, backend, block_size, running["max_len"], budget_s, quiet=True,
        threads=running["threads"], layout=layout,
    )  # fmt: skip
    print(noise_line(profile), file=sys.stderr)
    profile.fingerprint["max_len"] = running["max_len"]
    profile.fingerprint["schema"] = SCHEMA
    profile.save(cache)
    return LatencyModel(profile)


def load_cost_model(
    profile: str | None, model: str = "tiny", accelerator: str = "h100"
) -> tuple[LatencyModel, str]:
    """``(LatencyModel, one-line description)``: from the measured ``profile`` file (``--profile``)
    if given, else from the analytic (FLOP-count) profile of ``model`` (``--model``) on
    ``accelerator`` (``--accelerator``)."""
    if profile is not None:
        return LatencyModel(load_profile(profile)), f"LatencyModel(profile {profile})"
    desc = f"LatencyModel(analytic profile: {model} on {accelerator})"
    return LatencyModel(analytic_profile(load_shapes(model), accelerator)), desc


__all__ = [
    "ACCELERATORS",
    "ContextCost",
    "LatencyModel",
    "Links",
    "OutsideGridWarning",
    "Profile",
    "ProfileMismatchWarning",
    "allreduce_seconds",
    "analytic_links",
    "analytic_profile",
    "check_profile_fits",
    "context_cost",
    "default_latency_model",
    "fingerprint",
    "links_from_profile",
    "load_cost_model",
    "load_profile",
]
