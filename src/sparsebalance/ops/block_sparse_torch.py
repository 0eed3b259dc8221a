"""Block-sparse attention in plain PyTorch (the CPU training path; also runs on CUDA).

Three layers, flash-attention style: the raw kernel (:func:`block_pairs_forward`,
:func:`block_pairs_backward`) over a :class:`~.block_pairs.BlockPairs`, the autograd Function, the
thin public function. Work and memory are proportional to the kept block pairs. Softmax is exact
per row (all of a row's key blocks are in the same chunk); the backward recomputes the
probabilities from the saved log-sum-exp instead of storing them. The context-parallel ring calls
the same raw kernel once per ring step and merges the steps with :func:`merge_attention` (the
rhythm of ring-flash-attention's ``update_out_and_lse``).

Non-finite inputs. Positions a query does not see (other documents, causally later keys, pairs
outside the layout) contribute exact zeros to its output and to every gradient, even when they
hold NaN or inf: the products over partial blocks are masked on the value path, not only on the
scores. That masked path runs only when an operand is non-finite (checked once per call), so
finite inputs take the fast path. A non-finite value a query *does* see makes its output NaN
(or inf, through an interior block), as in dense attention.
"""

from __future__ import annotations

import math

import torch

from .block_pairs import (
    BlockPairs,
    blocks_to_tokens,
    query_rows,
    rows_to_tokens,
    token_blocks,
)
from .layout import BlockLayout


def _new_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialised output buffer; tests patch this to fill NaN and catch unwritten elements."""
    return torch.empty(shape, dtype=dtype, device=device)


def all_finite(*tensors: torch.Tensor) -> bool:
    """True when no element of the tensors is NaN or +-inf (one host sync)."""
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def merge_attention(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Merge a partial result into running accumulators, in place (log-sum-exp weights).

    Args:
        out: ``(..., D)`` normalised output so far; ``lse`` ``(...)`` its log-sum-exp, ``-inf``
            where a query has seen no key yet (then ``out`` is 0).
        block_out, block_lse: the same for another, disjoint set of keys.
    """
    new = torch.logaddexp(lse, block_lse)
    seen = new > -math.inf  # both -inf: nothing yet, keep zeros (and avoid -inf - -inf)
    w_old = torch.where(seen, (lse - new).exp(), 0.0)[..., None]
    w_new = torch.where(seen, (block_lse - new).exp(), 0.0)[..., None]
    out.mul_(w_old).add_(block_out * w_new)
    lse.copy_(new)


def _masked_bmm(a: torch.Tensor, ok: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` where entries of ``a`` outside ``ok`` contribute exact zeros, even against NaN or
    inf in ``b``; a non-finite ``b`` row read through an ``ok`` entry gives NaN.

    ``a`` ``(c, X, Y)``, ``ok`` bool ``(c, X, Y)``, ``b`` ``(c, Y, D)`` -> ``(c, X, D)``.
    """
    bad = ~torch.isfinite(b)
    out = torch.bmm(a.masked_fill(~ok, 0), b.masked_fill(bad, 0))
    hits = torch.bmm(ok.to(b.dtype), bad.to(b.dtype))
    return out.masked_fill_(hits > 0, math.nan)


def _cols(a, b, ok, masked: int) -> torch.Tensor:
    """``a (c, X, W*B) @ b (c, W*B, D)``; the last ``masked`` columns of ``a`` go through ``ok``."""
    if ok is None:
        return torch.bmm(a, b)
    f = a.shape[-1] - masked
    tail = _masked_bmm(a[..., f:], ok, b[:, f:])
    return tail if f == 0 else torch.bmm(a[..., :f], b[:, :f]).add_(tail)


def _rows(a_t, b, ok, masked: int) -> torch.Tensor:
    """``a_t (c, W*B, X) @ b (c, X, D)``; the last ``masked`` rows of ``a_t`` go through ``ok``."""
    if ok is None:
        return torch.bmm(a_t, b)
    f = a_t.shape[1] - masked
    tail = _masked_bmm(a_t[:, f:], ok.transpose(1, 2), b)
    return tail if f == 0 else torch.cat([torch.bmm(a_t[:, :f], b), tail], dim=1)


def block_pairs_forward(
    qr: torch.Tensor,
    kb: torch.Tensor,
    vb: torch.Tensor,
    pairs: BlockPairs,
    out: torch.Tensor,
    lse: torch.Tensor,
    merge: bool = False,
) -> None:
    """Raw forward over the pairs' chunks, writing (or merging into) ``out`` and ``lse``.

    Args:
        qr: query rows ``(R, g*B, D)`` with the softmax scale folded in.
        kb, vb: key and value blocks ``(Hkv*m, B*D)``.
        pairs: the block pairs; rows are ``R = H_layout * n``.
        out: ``(R, g*B, D)`` normalised outputs (any float dtype); ``lse`` ``(R, g*B)`` in the
            accumulation dtype, ``-inf`` for a query without keys (its output is 0).
        merge: False: write the chunk rows (rows in no chunk are left untouched);
            True: merge them into the running ``out``/``lse`` (:func:`merge_attention`).
    """
    acc, span = lse.dtype, pairs.B
    masked_values = not all_finite(vb)
    for c in pairs.chunks:
        vc = pairs.gather(vb, c)
        s = torch.bmm(qr.index_select(0, c.row), pairs.gather(kb, c).transpose(1, 2))
        s = s.to(acc)
        ok = pairs.masked_scores_(s, c)
        m = s.amax(-1, keepdim=True).nan_to_num_(neginf=0.0)
        p = s.sub_(m).exp_()
        denom = p.sum(-1, keepdim=True)
        ok = ok if masked_values else None
        o = _cols(p.to(vb.dtype), vc, ok, c.num_masked * span).to(acc)
        o = o.div_(denom.clamp_min(1e-30))
        step_lse = torch.where(denom > 0, m + denom.log(), -math.inf).squeeze(-1)
        if merge:
            o_old, l_old = out.index_select(0, c.row).to(acc), lse.index_select(0, c.row)
            merge_attention(o_old, l_old, o, step_lse)
            o, step_lse = o_old, l_old
        out[c.row] = o.to(out.dtype)
        lse[c.row] = step_lse


def block_pairs_backward(
    qr: torch.Tensor,
    dor: torch.Tensor,
    kb: torch.Tensor,
    vb: torch.Tensor,
    pairs: BlockPairs,
    lse: torch.Tensor,
    delta: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
) -> None:
    """Raw backward over the pairs' chunks; gradients are *added* to ``dq``, ``dk``, ``dv``.

    Args:
        qr: scaled query rows ``(R, g*B, D)``; ``dor``: output-gradient rows, same shape.
        kb, vb: key and value blocks ``(Hkv*m, B*D)``.
        lse: the *final* log-sum-exp ``(R, g*B)`` (``-inf`` or ``+inf``: the query has no key).
        delta: ``(R, g*B, 1)``, ``sum(dout * out)`` per query.
        dq: ``(R, g*B, D)`` accumulation dtype; gradient w.r.t. the *scaled* queries.
        dk, dv: ``(Hkv*m, B*D)`` accumulation dtype.
    """
    acc, span = lse.dtype, pairs.B
    lse = lse.masked_fill(lse == -math.inf, math.inf)  # no key: p = exp(-inf - inf) = 0
    safe = all_finite(qr, dor, kb, vb, delta) and not bool(lse.isnan().any())
    for c in pairs.chunks:
        qc, doc = qr.index_select(0, c.row), dor.index_select(0, c.row)
        kc, vc = pairs.gather(kb, c), pairs.gather(vb, c)
        s = torch.bmm(qc, kc.transpose(1, 2)).to(acc)
        ok = pairs.masked_scores_(s, c)
        ok = None if safe else ok
        p = s.sub_(lse.index_select(0, c.row)[:, :, None]).exp_()
        mb = c.num_masked * span
        if ok is not None:
            p[..., -mb:].masked_fill_(~ok, 0.0)
        flat = c.kv_row.reshape(-1)
        dv_c = _rows(p.to(qr.dtype).transpose(1, 2), doc, ok, mb)
        dv.index_add_(0, flat, dv_c.reshape(flat.numel(), -1).to(acc))
        dp = torch.bmm(doc, vc.transpose(1, 2)).to(acc)
        ds = p.mul_(dp.sub_(delta.index_select(0, c.row)))
        if ok is not None:
            ds[..., -mb:].masked_fill_(~ok, 0.0)
        ds = ds.to(qr.dtype)
        dq.index_add_(0, c.row, _cols(ds, kc, ok, mb).to(acc))
        dk_c = _rows(ds.transpose(1, 2), qc, ok, mb)  # q was pre-scaled: no extra factor
        dk.index_add_(0, flat, dk_c.reshape(flat.numel(), -1).to(acc))


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 inputs accumulate in fp64, everything else in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout: BlockLayout, scale: float):  # type: ignore[override]
        hl, b, t = layout.num_heads, layout.block_size, q.shape[0]
        blocks = torch.arange(layout.num_blocks, device=q.device)
        pairs = BlockPairs(layout, blocks, blocks, k.shape[1], q.device)
        acc = accumulation_dtype(q.dtype)
        qr = query_rows(q * scale, hl, b)  # the scale is folded into q once
        out = _new_output(qr.shape, q.dtype, q.device)
        out[pairs.empty_rows] = 0
        lse = torch.full(qr.shape[:2], -math.inf, dtype=acc, device=q.device)
        block_pairs_forward(qr, token_blocks(k, b), token_blocks(v, b), pairs, out, lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pairs, ctx.scale, ctx.hl, ctx.b = pairs, scale, hl, b
        return rows_to_tokens(out, hl, b)[:t]

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        hl, b, t = ctx.hl, ctx.b, q.shape[0]
        acc = lse.dtype
        qr = query_rows(q * ctx.scale, hl, b)
        dor = query_rows(grad_out.to(q.dtype), hl, b)
        kb, vb = token_blocks(k, b), token_blocks(v, b)
        delta = (dor.to(acc) * out.to(acc)).sum(-1, keepdim=True)  # (rows, g*B, 1)
        dq = torch.zeros(qr.shape, dtype=acc, device=q.device)
        dk = torch.zeros(kb.shape, dtype=acc, device=q.device)
        dv = torch.zeros_like(dk)
        block_pairs_backward(qr, dor, kb, vb, ctx.pairs, lse, delta, dq, dk, dv)
        hkv = k.shape[1]
        dq = rows_to_tokens(dq.mul_(ctx.scale), hl, b)[:t]
        dk, dv = blocks_to_tokens(dk, hkv, b)[:t], blocks_to_tokens(dv, hkv, b)[:t]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def torch_block_sparse_attention(q, k, v, layout: BlockLayout, scale: float) -> torch.Tensor:
    """``q (T, Hq, D)``, ``k``/``v (T, Hkv, D)`` -> ``(T, Hq, D)``; differentiable in q, k, v."""
    return BlockSparseAttention.apply(q, k, v, layout, scale)
