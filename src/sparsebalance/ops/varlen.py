"""Validation of the packed (flash-attn varlen) inputs and the per-token document bookkeeping.

Convention: ``q`` ``(T, Hq, D)``, ``k``/``v`` ``(T, Hkv, D)``, ``cu_seqlens`` int32 ``(N + 1,)``
starting at 0, strictly increasing, ending at ``T``. Attention is causal inside a document and
never crosses documents, so query token ``i`` may see exactly the keys ``doc_start[i] <= j <= i``.
"""

from __future__ import annotations

import math
import os

import torch

DEBUG_ENV = "SPARSEBALANCE_DEBUG_CHECKS"


def debug_checks() -> bool:
    """``SPARSEBALANCE_DEBUG_CHECKS=1``: also run the checks that read a device tensor's values
    on the host (one sync each, inside every attention layer); off by default on CUDA."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int | None = None, values: bool | None = None) -> None:
    """Raise ``ValueError``/``TypeError`` unless ``cu_seqlens`` is a valid varlen offset vector.

    Type and shape always; the values (0 first, increasing, ``total`` last) if ``values``, by
    default where reading them costs no host sync: ``cu_seqlens`` on the CPU, or on a device
    under :func:`debug_checks`. The trainer builds its offsets from document lengths on the host
    (and checks those: ``values=False`` where they come with them)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be int32 (or int64), got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with N + 1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if values is None:
        values = cu_seqlens.device.type == "cpu" or debug_checks()
    if not values:
        return
    cpu = cu_seqlens.detach().to("cpu", torch.int64)
    if int(cpu[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {int(cpu[0])}")
    if not bool((cpu[1:] > cpu[:-1]).all()):
        raise ValueError("cu_seqlens must be strictly increasing (no empty documents)")
    if total is not None and int(cpu[-1]) != total:
        raise ValueError(f"cu_seqlens must end at T={total} (the packed length), got {int(cpu[-1])}")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
    """Check shapes, dtypes and devices of ``q (T, Hq, D)``, ``k``/``v (T, Hkv, D)``."""
    named = [("q", q), ("k", k)] + ([("v", v)] if v is not None else [])
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D (T, H, D), got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    for name, t in named[1:]:
        if t.dtype != q.dtype:
            raise TypeError(f"{name}.dtype {t.dtype} differs from q.dtype {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
        if t.shape[0] != q.shape[0]:
            raise ValueError(f"{name} has T={t.shape[0]} tokens but q has T={q.shape[0]}")
        if t.shape[2] != q.shape[2]:
            raise ValueError(f"{name} has head dim {t.shape[2]} but q has {q.shape[2]}")
    if v is not None and v.shape != k.shape:
        raise ValueError(f"v shape {tuple(v.shape)} differs from k shape {tuple(k.shape)}")
    if q.shape[2] == 0:
        raise ValueError("q, k and v need a head dim D >= 1, got D=0")
    hq, hkv = q.shape[1], k.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"Hq % Hkv must be 0 (grouped-query attention), got Hq={hq}, Hkv={hkv}")


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """The softmax scale: ``head_dim ** -0.5`` by default, else finite and > 0."""
    if head_dim <= 0:
        raise ValueError(f"the head dim D must be >= 1, got D={head_dim}")
    if scale is None:
        return head_dim**-0.5
    try:
        value = float(scale)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"scale must be a number or None, got {scale!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"scale must be finite and > 0 (or None for D ** -0.5), got {scale}")
    return value


def doc_ids(cu_seqlens: torch.Tensor, total: int, device: torch.device | None = None) -> torch.Tensor:
    """Document index of every token: int64 ``(T,)``."""
    cu = cu_seqlens.to(device or cu_seqlens.device, torch.int64)
    pos = torch.arange(total, device=cu.device)
    return torch.searchsorted(cu[1:], pos, right=True)


def doc_starts(cu_seqlens: torch.Tensor, total: int, device: torch.device | None = None) -> torch.Tensor:
    """First token of each token's document: int64 ``(T,)``. Token i sees keys [start_i, i]."""
    cu = cu_seqlens.to(device or cu_seqlens.device, torch.int64)
    return cu[doc_ids(cu, total)]


def token_mask(cu_seqlens: torch.Tensor, total: int, device: torch.device | None = None) -> torch.Tensor:
    """The document-causal token mask, bool ``(T, T)``: ``[i, j]`` is True iff i may attend to j."""
    start = doc_starts(cu_seqlens, total, device)
    pos = torch.arange(total, device=start.device)
    return (pos[None, :] <= pos[:, None]) & (pos[None, :] >= start[:, None])
