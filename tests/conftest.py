"""Shared test configuration: the ``gpu`` marker skips without CUDA; small tensor helpers."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def make_qkv(total, hq, hkv, dim, dtype=torch.float64, device="cpu", seed=0, requires_grad=True):
    """Random ``q (T, Hq, D)``, ``k``/``v (T, Hkv, D)``."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for h in (hq, hkv, hkv):
        x = torch.randn(total, h, dim, generator=g, dtype=torch.float64).to(device, dtype)
        out.append(x.requires_grad_(requires_grad))
    return out


def cu_from_lengths(lengths, device="cpu"):
    """int32 ``cu_seqlens`` from document lengths."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS difference ||a - b|| / ||b|| (fla style)."""
    return float(
        (a.double() - b.double()).pow(2).mean().sqrt()
        / b.double().pow(2).mean().sqrt().clamp_min(1e-30)
    )
