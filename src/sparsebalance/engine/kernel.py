"""The attention kernel of a run, resolved once per device for every front end (``sparsebalance
train`` through :class:`~sparsebalance.train.TrainConfig`, ``eval``, ``bench-attn``, ``profile``,
``memory``, ``ring-balance``, the memory probe, ``attach`` and ``hf.enable``): the block size, the
attention backend and the compute precision.

- block: 128 tokens on CUDA (FlexAttention's tile), 64 elsewhere
  (:func:`~sparsebalance.ops.flex_config.resolve_block_size`, the one block-size resolution,
  used here and by the analyses below the engine: the simulator, the analytic cost model);
- backend: flex on CUDA, torch elsewhere (:func:`~sparsebalance.ops.resolve_backend`);
- precision: bf16 on CUDA, fp32 on CPU (:func:`~sparsebalance.precision.resolve_precision`).

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
from ..ops.flex_config import resolve_block_size
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
) -> Kernel:
    """The :class:`Kernel` for ``device`` with the given settings, the device's defaults for the
    rest (``None`` / ``"auto"``)."""
    device = torch.device(device)
    name = resolve_backend(backend, device)
    block = resolve_block_size(device, block_size, name)
    return Kernel(device, block, name, resolve_precision(precision, device).name)
