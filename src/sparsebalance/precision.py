"""The compute precision of a run (``--precision``): one setting, the same code on CPU and CUDA.

Parameters, gradients and the optimizer state stay float32 (the *master* weights); ``bf16`` and
``fp16`` run the forward and backward under ``torch.autocast`` on the run's device
(``torch.autocast("cpu")`` on CPU, ``torch.autocast("cuda")`` on CUDA), ``fp32`` runs without it.
Defaults (``auto``): fp32 on CPU, so CPU figures stay comparable with earlier runs; bf16 on CUDA.
``fp16`` adds dynamic loss scaling (``torch.amp.GradScaler``): its 5-bit exponent underflows
small gradients otherwise; bf16 has float32's exponent and needs none.

Inside autocast, what autocast does not cast is the model's business: a rotary embedding that
multiplies bf16 projections by float32 cos/sin returns float32 q and k next to a bf16 v. The
attention (:func:`sparsebalance.models.attention.sparsebalance_attention`) brings q and k back to
v's dtype (:func:`compute_dtype`), so the op never sees mixed dtypes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    """A resolved precision on one device type."""

    name: str
    """``bf16``, ``fp16`` or ``fp32``."""
    device_type: str
    """``cpu`` or ``cuda``: where autocast applies."""

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype of matrix products (float32 for ``fp32``)."""
        return DTYPES[self.name]

    @property
    def mixed(self) -> bool:
        """Low-precision compute under autocast (``bf16``/``fp16``)."""
        return self.name != "fp32"

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context every forward of the run (micro-batches, fillers, profiling) runs in."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """Dynamic loss scaling for ``fp16``; None otherwise."""
        if self.name != "fp16":
            return None
        return torch.amp.GradScaler(self.device_type)


def default_precision(device: torch.device | str) -> str:
    """``fp32`` on CPU, ``bf16`` on CUDA."""
    return "bf16" if torch.device(device).type == "cuda" else "fp32"


def resolve_precision(precision: str, device: torch.device | str) -> Precision:
    """``--precision`` (``auto`` included) on ``device``, checked."""
    if precision not in PRECISIONS:
        raise ValueError(f"--precision must be one of {PRECISIONS}, got {precision!r}")
    device = torch.device(device)
    name = default_precision(device) if precision == "auto" else precision
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--precision: autocast runs on cpu or cuda, not {device.type}")
    if device.type == "cuda" and name == "bf16" and not torch.cuda.is_bf16_supported():
        raise ValueError("--precision bf16 needs a GPU with bfloat16 (Ampere or newer); use fp16")
    return Precision(name, device.type)


def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (``cpu`` / ``cuda``: the devices a run trains
    on; torch has no autocast state for others, e.g. the ``meta`` stand-in device of the tests)."""
    return device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type)


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype q, k and v share in the attention: autocast's where it is on for their device,
    else the lowest-precision floating dtype among them (a projection's output)."""
    device_type = tensors[0].device.type
    if autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return min((t.dtype for t in tensors), key=lambda d: torch.finfo(d).bits)
