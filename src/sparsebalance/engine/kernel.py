"""The attention kernel of a run, resolved once per device for every front end (``sparsebalance
train`` through :class:`~sparsebalance.train.TrainConfig`, ``eval``, ``bench-attn``, ``profile``,
``memory``, ``ring-balance``, the memory probe, ``attach`` and ``hf.enable``): the block size, the
attention backend and the compute precision.

- block: 128 tokens on CUDA (FlexAttention's tile), 64 elsewhere
  (:func:`~sparsebalance.ops.flex_config.resolve_block_size`, the one block-size resolution,
  used here and by the analyses below the engine: the simulator, the analytic cost model);
- backend: flex on CUDA, torch elsewhere (:func:`~sparsebalance.ops.resolve_backend`);
- precision: bf16 on CUDA, fp32 on CPU (:func:`~sparsebalance.precision.resolve_precision`);
- GQA mode: how flex handles grouped-query attention, ``expand`` K/V to the query heads (the
  default of a flex call on every device, :class:`~sparsebalance.ops.flex_config.FlexSettings`)
  or ``native`` (:func:`resolve_gqa`).

The dense path (which documents run as dense attention) is not part of the kernel: it is the
latency profile's crossover density, known only after the profile loads
(:mod:`sparsebalance.engine.startup`).

A front end that leaves one of them unset gets the device's; what it sets is checked here (a
block flex cannot compile on this device is refused before anything compiles). Every command
with a block size declares it with :func:`add_block_size_argument` (default None: the device's),
and everything below this module takes ``block_size`` without a default, so the block size a run
uses has one road: from here to the knob, the planner and the kernel.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from ..ops import resolve_backend
from ..ops.flex_config import GQA_MODES, FlexSettings, resolve_block_size
from ..precision import resolve_precision

BLOCK_SIZE_HELP = "sparse block in tokens (default: the device's, 128 on CUDA, 64 on CPU)"


@dataclass(frozen=True)
class Kernel:
    """How the attention runs on one device (every field resolved: nothing is ``auto``)."""

    device: torch.device
    block_size: int
    backend: str
    """flex | torch | reference."""
    precision: str
    """fp32 | bf16 | fp16."""
    gqa: str
    """expand | native: flex's grouped-query attention (the other backends ignore it)."""


def add_block_size_argument(p: argparse.ArgumentParser, help: str = BLOCK_SIZE_HELP) -> None:
    """``--block-size`` as every command declares it: default None, the device's
    (:func:`~sparsebalance.ops.flex_config.resolve_block_size`)."""
    p.add_argument("--block-size", type=int, default=None, help=help)


def local_device() -> torch.device:
    """This machine's training device: CUDA where it is visible, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_kernel(
    device: torch.device | str,
    block_size: int | None = None,
    backend: str = "auto",
    precision: str = "auto",
    gqa: str | None = None,
) -> Kernel:
    """The :class:`Kernel` for ``device`` with the given settings, the device's defaults for the
    rest (``None`` / ``"auto"``)."""
    device = torch.device(device)
    name = resolve_backend(backend, device)
    block = resolve_block_size(device, block_size, name)
    return Kernel(device, block, name, resolve_precision(precision, device).name, resolve_gqa(gqa, block))


def resolve_gqa(gqa: str | None, block_size: int) -> str:
    """``--gqa`` checked (``expand`` or ``native``), or None: the mode a flex call with blocks of
    ``block_size`` tokens gets by default (:class:`~sparsebalance.ops.flex_config.FlexSettings`)."""
    if gqa is not None and gqa not in GQA_MODES:
        raise ValueError(f"--gqa must be one of {', '.join(GQA_MODES)}, got {gqa!r}")
    return FlexSettings(block_size).gqa if gqa is None else gqa
