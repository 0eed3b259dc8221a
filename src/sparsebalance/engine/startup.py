"""Latency start-up, one implementation for every front end: rank 0 loads ``--profile`` (checked
against the model's shapes, the block size, the device kind and the running fingerprint) or
reuses the cached default profile for this setup, or measures one (said first in one line on
stderr: what, about how long, where it is cached, how to skip it), and every rank gets rank 0's
copy, so all ranks plan with the same model (even across nodes with different caches). A
refusal on rank 0 is raised on every rank (none waits in the gather).

The profile times the layouts the run will use: top-k-shaped for top-k budgets, threshold-shaped
for gamma (the integrations profiled threshold-shaped layouts under the default top-k budget
before this was shared).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..latency import (
    LatencyModel,
    Profile,
    check_profile_fits,
    default_latency_model,
    fingerprint,
    load_profile,
)
from ..models import ModelShapes
from .defaults import Kernel


def layout_kind(budget_kind: str) -> str:
    """The layouts a profile for budgets of ``budget_kind`` (``top-k`` | ``gamma``) times."""
    return "top-k" if budget_kind == "top-k" else "threshold"


def load_latency_model(
    shapes: ModelShapes,
    kernel: Kernel,
    budget_kind: str,
    profile: str | Path | None,
    max_len: int,
    is_main: bool,
    all_gather: Callable[[object], list],
    flag: str = "--profile",
) -> LatencyModel:
    """The run's :class:`LatencyModel` (see the module docstring).

    Args:
        shapes: the model's shapes.
        kernel: the device, block size, backend and precision it runs with.
        budget_kind: ``top-k`` or ``gamma`` (the layouts to profile).
        profile: a profile JSON to load, or None for the default (cached or measured now).
        max_len: the longest micro-batch a measured profile must cover (tokens).
        is_main: this is rank 0 (the one that loads or measures).
        all_gather: ``obj -> [obj of every rank]``.
        flag: how the caller names ``profile`` in a refusal, a warning and the line said
            before a profile is measured (``--profile``, or ``profile`` for a keyword).
    """
    layout = layout_kind(budget_kind)
    data = None
    if is_main:
        try:
            if profile is not None:
                loaded = load_profile(profile)
                check_profile_fits(loaded, shapes, kernel.block_size, kernel.device.type, f"{flag} {profile}")
                loaded.check_fingerprint(
                    fingerprint(
                        shapes, kernel.device, kernel.precision, kernel.backend, kernel.block_size, layout=layout
                    ),
                    where=f"{flag} {profile}",
                )
            else:
                given = f"{flag} PATH" if flag.startswith("-") else f"{flag}=PATH"
                loaded = default_latency_model(
                    shapes,
                    kernel.device,
                    kernel.precision,
                    kernel.backend,
                    kernel.block_size,
                    max_len=max_len,
                    layout=layout,
                    given=given,
                ).profile
            data = loaded.to_json()
        except ValueError as err:  # every rank raises it (rank 0 says it), none waits on
            data = {"error": str(err)}
    data = all_gather(data)[0]
    if "error" in data:
        raise ValueError(data["error"])
    return LatencyModel(Profile.from_json(data))
