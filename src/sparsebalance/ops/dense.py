"""Dense document-causal attention at dense speed: documents whose budget keeps every causal block.

A short document under a top-k budget, or any document under ``gamma=1``, needs exact attention,
and a block-sparse kernel at density 1 is slower than FlashAttention (measured on an H100: flex
2.3-4.4x SDPA at density 1, ``../shared/gpu/README.md``). Such documents run here instead:

- CUDA, fp16/bf16: FlashAttention varlen through ``torch.nn.attention.varlen.varlen_attn`` (one
  call for a run of documents, ``cu_seqlens`` as given; GQA native where the installed torch
  takes ``enable_gqa``, else K/V expanded; torch 2.10's ``is_causal`` and 2.11+'s
  ``window_size=(-1, 0)`` both handled);
- elsewhere (CPU, fp32 on CUDA, torch without varlen): ``scaled_dot_product_attention`` once
  per document (``is_causal``, ``enable_gqa``), lengths read from the host.

Exact attention either way: equal to the reference on the documents' full causal masks, forward
and backward (CPU: ``tests/ops/test_dense.py``; CUDA: the gpu tier).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence

import torch
import torch.nn.functional as F

FLASH_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def varlen_api() -> dict | None:
    """The installed ``varlen_attn`` and which keywords it takes, or None (no such API, or no way
    to ask it for causal attention)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = next((p for p in ("window_size", "is_causal") if p in params), None)
    if causal is None:
        return None
    return {"fn": varlen_attn, "causal": causal, "gqa": "enable_gqa" in params, "scale": "scale" in params}


def uses_varlen(q: torch.Tensor, scale: float) -> bool:
    """Whether :func:`dense_attention` runs FlashAttention varlen for ``q`` (else SDPA per
    document)."""
    api = varlen_api()
    d = q.shape[-1]
    default_scale = abs(scale - d**-0.5) <= 1e-12 * d**-0.5
    return (
        api is not None
        and q.is_cuda
        and q.dtype in FLASH_DTYPES
        and d % 8 == 0
        and d <= 256
        and (api["scale"] or default_scale)
    )


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    lengths: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """Exact document-causal attention of a run of whole documents.

    Args:
        q: ``(T, Hq, D)``; k, v: ``(T, Hkv, D)``, ``Hq % Hkv == 0``.
        cu_seqlens: int32 ``(N + 1,)`` offsets of the documents, on q's device, ``0 .. T``.
        lengths: the ``N`` document lengths on the host (``sum == T``).
        scale: softmax scale.

    Returns:
        ``(T, Hq, D)`` in q's dtype, differentiable in q, k and v.
    """
    if uses_varlen(q, scale):
        return varlen_kernel(q, k, v, cu_seqlens, max(lengths), scale)
    outs, gqa, sizes = [], q.shape[1] != k.shape[1], [int(n) for n in lengths]
    # split: views whose backward is one concatenation (slicing each document would allocate a
    # zero tensor of the whole run per document in the backward)
    for qd, kd, vd in zip(q.split(sizes), k.split(sizes), v.split(sizes), strict=True):
        out = F.scaled_dot_product_attention(
            qd.transpose(0, 1), kd.transpose(0, 1), vd.transpose(0, 1), is_causal=True, scale=scale, enable_gqa=gqa
        )
        outs.append(out.transpose(0, 1))  # (H, L, D) -> (L, H, D)
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def varlen_kernel(q, k, v, cu_seqlens, max_len: int, scale: float) -> torch.Tensor:
    """FlashAttention varlen over the documents of ``cu_seqlens`` (causal), as the installed
    torch names its keywords (the module docstring); ``q (T, Hq, D)``, ``k``/``v (T, Hkv, D)``."""
    api = varlen_api()
    hq, hkv = q.shape[1], k.shape[1]
    kwargs = {"scale": scale} if api["scale"] else {}
    if api["causal"] == "window_size":
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if hq != hkv:
        if api["gqa"]:
            kwargs["enable_gqa"] = True
        else:
            k, v = (x.repeat_interleave(hq // hkv, dim=1) for x in (k, v))
    # The kernel wants (total, H, D) rows one after the other; the model's q/k/v come as views
    # of heads-first tensors (a copy only where they are not already laid out that way).
    q, k, v = (x.contiguous() for x in (q, k, v))
    return api["fn"](q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, **kwargs)
