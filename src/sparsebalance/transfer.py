"""Host arrays to the training device without making the host wait.

A copy to a CUDA device from pageable memory is synchronous: the host waits until the device has
run everything queued before it, so the host can no longer run ahead of the device. From pinned
(page-locked) memory with ``non_blocking=True`` the copy is queued on the stream and the host
goes on; PyTorch's pinned-memory allocator keeps the buffer until the copy has run. On the CPU
the arrays are used where they are (no copy at all).
"""

from __future__ import annotations

import numpy as np
import torch

from .launches import copied

ALIGN = 64
"""Bytes each array of a shared upload starts on (a cache line; Triton/Inductor specialise
kernels on 16-byte aligned inputs)."""


def upload(array: np.ndarray, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``array`` as a tensor on ``device`` (``dtype``: its torch dtype, default numpy's): one
    pinned, non-blocking copy on CUDA, never a read back."""
    host = torch.as_tensor(np.ascontiguousarray(array), dtype=dtype)
    copied(host.numel() * host.element_size())
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def upload_many(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Several host arrays on ``device`` in one copy (CUDA: one pinned buffer, one non-blocking
    copy, then views of their dtypes and shapes on the device); each array keeps its dtype."""
    copied(sum(np.asarray(a).nbytes for a in arrays))
    if device.type != "cuda":
        return [torch.as_tensor(np.ascontiguousarray(a)).to(device) for a in arrays]
    offsets, at = [], 0
    for a in arrays:
        a = np.ascontiguousarray(a)
        at = -(-at // ALIGN) * ALIGN  # every dtype's view valid, kernels' loads aligned
        offsets.append((at, a))
        at += a.nbytes
    host = torch.empty(at, dtype=torch.uint8).pin_memory()
    flat = host.numpy()
    for start, a in offsets:
        flat[start : start + a.nbytes] = a.view(np.uint8).reshape(-1)
    on_device = host.to(device, non_blocking=True)
    out = []
    for start, a in offsets:
        dtype = torch.from_numpy(a[:0]).dtype
        out.append(on_device[start : start + a.nbytes].view(dtype).view(a.shape))
    return out
