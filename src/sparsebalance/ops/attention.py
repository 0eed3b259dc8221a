"""The public block-sparse attention op: validation and backend dispatch."""

from __future__ import annotations

import functools

import torch

from ..launches import kernel
from .block_sparse_flex import flex_block_sparse_attention
from .block_sparse_torch import torch_block_sparse_attention
from .layout import BlockLayout
from .reference import reference_attention
from .varlen import check_cu_seqlens, check_qkv, resolve_scale

BACKENDS = ("reference", "torch", "flex", "triton")


def flex_available(device: torch.device) -> bool:
    """FlexAttention trains (forward and backward, honouring block lists) only on CUDA."""
    return device.type == "cuda" and _flex_importable()


@functools.cache
def _flex_importable() -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask  # noqa: F401
    except ImportError:
        return False
    return True


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Backends that can run (forward and backward) on ``device``."""
    device = torch.device(device)
    return ["reference", "torch"] + (["flex"] if flex_available(device) else [])


def resolve_backend(backend: str, device: torch.device, forward_only: bool = False) -> str:
    """Map ``"auto"`` to the fastest available backend; reject unavailable ones loudly.
    ``forward_only``: no gradient is needed, so flex runs on the CPU too (forward only there)."""
    if backend == "auto":
        return "flex" if flex_available(device) else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {(*BACKENDS, 'auto')}, got {backend!r}")
    if backend == "triton":
        raise ValueError("backend='triton' is not implemented yet; use 'auto', 'torch' or 'flex'")
    if (
        backend == "flex"
        and not flex_available(device)
        and not (forward_only and device.type == "cpu" and _flex_importable())
    ):
        raise ValueError(
            f"backend='flex' needs CUDA (FlexAttention on {device.type} cannot train with block "
            "lists); use backend='torch' or 'auto'"
        )
    return backend


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: BlockLayout,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    backend: str = "auto",
    gqa: str | None = None,
) -> torch.Tensor:
    """Attention over the (query block, key block) pairs of ``layout``, document-causal.

    Args:
        q: ``(T, Hq, D)`` queries.
        k: ``(T, Hkv, D)`` keys, ``Hq % Hkv == 0``; same dtype and device as ``q``.
        v: ``(T, Hkv, D)`` values.
        layout: a :class:`BlockLayout` built for this pack (``select_blocks``).
        cu_seqlens: int32 ``(N + 1,)`` document offsets, ``0 ... T``.
        scale: softmax scale, default ``D ** -0.5``.
        backend: ``"auto"`` (flex on CUDA, else torch), ``"torch"``, ``"flex"`` (on the CPU
            without gradients only: FlexAttention has no backward there) or ``"reference"``.
        gqa: flex's grouped-query attention, ``"expand"`` or ``"native"`` (the run's
            :class:`~sparsebalance.engine.kernel.Kernel`); None: the flex call's default
            (:class:`~sparsebalance.ops.flex_config.FlexSettings`). The other backends ignore it.

    Returns:
        ``(T, Hq, D)`` in ``q.dtype``, differentiable in q, k and v. Query token i attends to the
        keys j with ``doc_start_i <= j <= i`` whose block pair is in ``layout``.
    """
    check_qkv(q, k, v)
    if not isinstance(layout, BlockLayout):
        raise TypeError(f"layout must be a BlockLayout, got {type(layout).__name__}")
    if cu_seqlens is not layout.cu_seqlens:  # the layout's own offsets were checked when built
        check_cu_seqlens(cu_seqlens, q.shape[0])
    layout.check_compatible(q, k, cu_seqlens)
    if layout.device != q.device:
        layout = layout.to(q.device)
    scale = resolve_scale(scale, q.shape[-1])
    forward_only = not (torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)))
    backend = resolve_backend(backend, q.device, forward_only)
    if backend == "reference":
        return kernel(reference_attention, q, k, v, layout, cu_seqlens, scale, like=q)
    if backend == "flex":
        return flex_block_sparse_attention(q, k, v, layout, scale, gqa)
    return kernel(torch_block_sparse_attention, q, k, v, layout, scale, like=q)
