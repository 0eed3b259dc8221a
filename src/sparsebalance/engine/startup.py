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

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ..latency import (
    LatencyModel,
    Profile,
    check_profile_fits,
    default_latency_model,
    fingerprint,
    load_profile,
)
from ..models import ModelShapes
from .kernel import Kernel


def check_global_batch(global_batch: int, num_docs: int, world_size: int, flag: str = "--global-batch") -> None:
    """Refuse a global batch that exceeds the dataset's ``num_docs`` documents or leaves one of
    the ``world_size`` ranks without a document (checked before anything is profiled); ``flag``:
    how the caller names it (``--global-batch``, or ``global_batch`` for a keyword)."""
    if global_batch > num_docs:
        raise ValueError(f"{flag} {global_batch} exceeds the dataset's {num_docs} documents")
    if global_batch < world_size:
        raise ValueError(
            f"{flag} {global_batch} is smaller than the {world_size} ranks: every rank needs at "
            "least one document per step"
        )


def profile_length(
    capacity: int | None, lengths: Sequence[int] | np.ndarray, global_batch: int, max_len: int | None = None
) -> int:
    """Longest micro-batch a measured latency profile must cover (tokens), what every front end
    asks :func:`load_latency_model` for: the ``capacity``, but never more than the
    ``global_batch`` longest documents together (a capacity of 10^6 with short documents must not
    profile 10^6 tokens); without a capacity the longest document (or ``max_len``, the crop,
    when longer); at least 256 tokens (the quick profile needs two lengths; a capacity of 64 is
    valid)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if capacity is not None:
        top = min(int(capacity), int(np.sort(lengths)[-global_batch:].sum()))
    else:
        top = max(max_len or 0, int(lengths.max()))
    return max(top, 256)


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
                    block_size=kernel.block_size,
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
