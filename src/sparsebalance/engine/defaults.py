"""Per-device defaults, resolved once for every front end (``sparsebalance train``, ``attach``,
``hf.enable``, the plain loop): the block size, the attention backend and the compute precision.

- block: 128 tokens on CUDA (FlexAttention's tile), 64 elsewhere
  (:func:`~sparsebalance.ops.flex_config.resolve_block_size`);
- backend: flex on CUDA, torch elsewhere (:func:`~sparsebalance.ops.resolve_backend`);
- precision: bf16 on CUDA, fp32 on CPU (:func:`~sparsebalance.precision.resolve_precision`).

A front end that leaves one of them unset gets the device's; what it sets is checked here (a
block flex cannot compile on this device is refused before anything compiles).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops import resolve_backend
from ..ops.flex_config import check_flex_block_size, resolve_block_size
from ..precision import resolve_precision


@dataclass(frozen=True)
class Kernel:
    """How the attention runs on one device (every field resolved: nothing is ``auto``)."""

    device: torch.device
    block_size: int
    backend: str
    """flex | torch | reference."""
    precision: str
    """fp32 | bf16 | fp16."""


def resolve_kernel(
    device: torch.device | str,
    block_size: int | None = None,
    backend: str = "auto",
    precision: str = "auto",
) -> Kernel:
    """The :class:`Kernel` for ``device`` with the given settings, the device's defaults for the
    rest (``None`` / ``"auto"``)."""
    device = torch.device(device)
    block = resolve_block_size(block_size, device)
    name = resolve_backend(backend, device)
    if name == "flex":
        check_flex_block_size(block, device)
    return Kernel(device, block, name, resolve_precision(precision, device).name)
