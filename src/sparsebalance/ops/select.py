"""Dynamic block selection: estimate block attention mass cheaply, keep blocks reaching ``gamma``.

Estimator. The packed buffer is cut into *segments* = (block ∩ document), so a block that holds the
end of one document and the start of the next is scored per document. Queries and keys are
mean-pooled per segment; the logit of (query segment i, key segment j) is
``scale * q̄_i · k̄_j + log(n_j)`` (a segment of ``n_j`` similar keys carries ``n_j`` times the mass
of one; the diagonal segment counts ``(n_j + 1) / 2`` as half of it is causally hidden), softmaxed
over the causal key segments of i's document. Cost: O(S^2 * D) per head with S ≈ T/B + N segments,
a few percent of the attention itself (O(T^2 * D)).

Rule. Per query segment, keep the fewest key segments whose estimated mass reaches ``gamma``, then
add anchors (first ``sink_blocks`` blocks of the document, ``local_blocks`` diagonal blocks), apply
the ``min_blocks`` floor and ``max_density`` cap; a query block keeps the union over its segments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .budget import Budget
from .layout import BlockLayout, causal_block_mask, document_density, num_blocks
from .varlen import check_cu_seqlens, check_qkv, doc_ids, token_mask

# Bound on (heads x S x S) elements processed at once, so long contexts do not blow up memory.
_MAX_SCORE_ELEMS = 1 << 26


def _segments(cu_seqlens: torch.Tensor, total: int, block_size: int):
    """Cut [0, T) at block and document boundaries. Returns start, length, block, doc (all (S,))."""
    dev = cu_seqlens.device
    cuts = torch.cat([torch.arange(0, total, block_size, device=dev), cu_seqlens[:-1].long()])
    start = torch.unique(cuts)  # sorted
    length = torch.diff(start, append=torch.tensor([total], device=dev))
    return start, length, start // block_size, doc_ids(cu_seqlens, total)[start]


def _pool(x: torch.Tensor, seg_of_token: torch.Tensor, seg_len: torch.Tensor) -> torch.Tensor:
    """Mean of ``x (T, H, D)`` per segment -> ``(S, H, D)`` in float32 (float64 kept)."""
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = torch.zeros(seg_len.numel(), *x.shape[1:], dtype=dtype, device=x.device)
    out.index_add_(0, seg_of_token, x.to(dtype))
    return out / seg_len.to(dtype)[:, None, None]


def _sort_rows(prob: torch.Tensor):
    """Per row: descending order, the mass ranked above each entry, each entry's rank."""
    sorted_p, order = torch.sort(prob, dim=-1, descending=True, stable=True)
    before = sorted_p.cumsum(-1) - sorted_p
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return before, rank


def _keep_by_mass(prob, allowed, budget: Budget, sorted_rows=None) -> torch.Tensor:
    """Threshold rule on ``prob (H, S, S)``: bool keep mask of the fewest entries reaching gamma.
    ``sorted_rows`` (from :func:`_sort_rows`) lets many budgets share one sort."""
    if budget.is_dense:
        return allowed.expand_as(prob).clone()
    before, rank = sorted_rows if sorted_rows is not None else _sort_rows(prob)
    n_allowed = allowed.sum(-1, keepdim=True)
    keep_n = (before < budget.gamma).sum(-1, keepdim=True) if budget.gamma < 1.0 else n_allowed
    keep_n = torch.maximum(keep_n, torch.clamp(n_allowed, max=budget.min_blocks))
    if budget.max_density is not None:
        keep_n = torch.minimum(keep_n, torch.ceil(n_allowed * budget.max_density).long())
    return (rank < keep_n) & allowed


@dataclass(frozen=True)
class BlockMassEstimate:
    """Estimated attention mass between segments (block ∩ document) of one pack, for one layer.

    Computed once per layer by :func:`estimate_block_mass`; any number of budgets can then be
    turned into layouts (:meth:`layout`) or densities (:meth:`density`) without recomputing it,
    which is what run-time budget tuning needs.
    """

    prob: torch.Tensor
    """``(H_layout, S, S)``: estimated mass of key segment j for query segment i (rows sum to 1)."""
    allowed: torch.Tensor
    """bool ``(S, S)``: key segment j is causal for query segment i (same document, j <= i)."""
    seg_block: torch.Tensor
    """int64 ``(S,)``: block of each segment."""
    first_block_of_doc: torch.Tensor
    """int64 ``(S,)``: first block of each segment's document."""
    cu_seqlens: torch.Tensor
    seq_len: int
    block_size: int
    num_q_heads: int
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def block_mask(self, budget: Budget) -> torch.Tensor:
        """Bool ``(H_layout, nb, nb)``: the block pairs this budget keeps."""
        if not isinstance(budget, Budget):
            raise TypeError(
                f"budget must be a sparsebalance.ops.Budget, got {type(budget).__name__}"
            )
        if "rows" not in self._cache and not budget.is_dense:
            self._cache["rows"] = _sort_rows(self.prob)  # shared by every later budget
        sb = self.seg_block
        anchors = (sb - self.first_block_of_doc < budget.sink_blocks)[None, :] | (
            sb[:, None] - sb[None, :] < budget.local_blocks
        )
        keep = _keep_by_mass(self.prob, self.allowed, budget, self._cache.get("rows"))
        keep_seg = keep | (anchors & self.allowed)
        # Segments -> blocks: a query block keeps the union over its query segments.
        h, n_seg = self.prob.shape[0], sb.numel()
        nb = num_blocks(self.seq_len, self.block_size)
        by_qblock = torch.zeros(h, nb, n_seg, dtype=torch.int32, device=sb.device)
        by_qblock.index_add_(1, sb, keep_seg.to(torch.int32))
        block_keep = torch.zeros(h, nb, nb, dtype=torch.int32, device=sb.device)
        block_keep.index_add_(2, sb, by_qblock)
        return block_keep > 0

    def layout(self, budget: Budget) -> BlockLayout:
        """The :class:`BlockLayout` this budget keeps."""
        mask = self.block_mask(budget)
        return BlockLayout.from_block_mask(mask, self.cu_seqlens, self.block_size, self.num_q_heads)

    def document_density(self, budget: Budget) -> torch.Tensor:
        """float64 ``(N,)``: per-document density of :meth:`layout`, without building it."""
        return document_density(self.block_mask(budget), self.cu_seqlens, self.block_size)

    def density(self, budget: Budget) -> float:
        """Density of :meth:`layout` for this budget."""
        mask = self.block_mask(budget)
        causal = causal_block_mask(self.cu_seqlens, self.seq_len, self.block_size)
        return float((mask & causal).sum()) / float(causal.sum() * mask.shape[0])


def estimate_block_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_size: int = 64,
    share_kv_groups: bool = False,
    scale: float | None = None,
) -> BlockMassEstimate:
    """The estimator half of :func:`select_blocks` (same arguments, no budget)."""
    check_qkv(q, k)
    check_cu_seqlens(cu_seqlens, q.shape[0])
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    total = q.shape[0]
    cu = cu_seqlens.to(q.device)
    with torch.no_grad():
        start, length, _, _ = _segments(cu, total, block_size)
        tokens = torch.arange(total, device=q.device)
        seg_of_token = torch.searchsorted(start, tokens, right=True) - 1
        qp = _pool(q.detach(), seg_of_token, length)  # (S, Hq, D)
        kp = _pool(k.detach(), seg_of_token, length)  # (S, Hkv, D)
    return estimate_from_pooled(qp, kp, cu, block_size, share_kv_groups, scale)


def estimate_from_pooled(
    qp: torch.Tensor,
    kp: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_size: int,
    share_kv_groups: bool = False,
    scale: float | None = None,
) -> BlockMassEstimate:
    """:func:`estimate_block_mass` from the per-segment means ``qp (S, Hq, D)``, ``kp (S, Hkv, D)``.

    The segments are those of ``_segments(cu_seqlens, T, block_size)`` in order. Context
    parallelism gathers the (small) pooled tensors from the ranks and calls this, so every rank
    gets the layout one device would.
    """
    total = int(cu_seqlens[-1])
    hq, dim = qp.shape[1:]
    hkv = kp.shape[1]
    group = hq // hkv
    scale = dim**-0.5 if scale is None else scale
    cu = cu_seqlens.to(qp.device)
    with torch.no_grad():
        _, length, seg_block, seg_doc = _segments(cu, total, block_size)
        n_seg = length.numel()
        qp, kp = qp.permute(1, 0, 2), kp.permute(1, 0, 2)  # (Hq, S, D), (Hkv, S, D)

        idx = torch.arange(n_seg, device=qp.device)
        allowed = (seg_doc[:, None] == seg_doc[None, :]) & (idx[None, :] <= idx[:, None])
        bias = torch.log(length.to(qp.dtype))[None, :].expand(n_seg, n_seg).clone()
        bias.diagonal().copy_(torch.log((length.to(qp.dtype) + 1) / 2))
        bias = bias.masked_fill(~allowed, -math.inf)

        n_layout = hkv if share_kv_groups else hq
        per_layout = hq // n_layout  # query heads per layout head
        prob = torch.empty(n_layout, n_seg, n_seg, dtype=qp.dtype, device=qp.device)
        chunk = max(1, _MAX_SCORE_ELEMS // max(1, n_seg * n_seg * per_layout))
        for h0 in range(0, n_layout, chunk):
            h1 = min(n_layout, h0 + chunk)
            qh = qp[h0 * per_layout : h1 * per_layout]  # (chunk*per_layout, S, D)
            kv_head = torch.arange(h0 * per_layout, h1 * per_layout, device=qp.device) // group
            logits = torch.baddbmm(bias, qh, kp[kv_head].transpose(1, 2), alpha=scale)
            p = torch.softmax(logits, dim=-1)
            prob[h0:h1] = p.view(h1 - h0, per_layout, n_seg, n_seg).mean(1)
    return BlockMassEstimate(
        prob,
        allowed,
        seg_block,
        seg_block[torch.searchsorted(seg_doc, seg_doc)],
        cu.to(torch.int32),
        total,
        block_size,
        hq,
    )


def select_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens: torch.Tensor,
    budget: Budget,
    block_size: int = 64,
    share_kv_groups: bool = False,
    scale: float | None = None,
) -> BlockLayout:
    """Choose the key blocks each query block computes.

    Args:
        q: ``(T, Hq, D)`` queries (any float dtype; scored in fp32, or fp64 if given fp64).
        k: ``(T, Hkv, D)`` keys, ``Hq % Hkv == 0``.
        cu_seqlens: int32 ``(N + 1,)`` document offsets of the pack.
        budget: the :class:`Budget` (gamma, anchors, floor, cap).
        block_size: tokens per block (> 0).
        share_kv_groups: one layout per KV head (the query heads of a group share it, averaging
            their estimated probabilities): fewer, larger block products, faster on CPU.
        scale: softmax scale, default ``D ** -0.5``.

    Returns:
        A :class:`BlockLayout` with ``Hq`` heads (or ``Hkv`` with ``share_kv_groups``).
    """
    if not isinstance(budget, Budget):
        raise TypeError(f"budget must be a sparsebalance.ops.Budget, got {type(budget).__name__}")
    est = estimate_block_mass(q, k, cu_seqlens, block_size, share_kv_groups, scale)
    return est.layout(budget)


def attention_recall(
    q: torch.Tensor,
    k: torch.Tensor,
    layout: BlockLayout,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """True attention mass covered by the layout: float64 ``(Hq,)``, mean over query tokens.

    Exact (dense softmax over every doc-causal key), so memory is ``Hq * T^2``: small T only.
    1.0 means the selected blocks hold all of the attention.
    """
    check_qkv(q, k)
    check_cu_seqlens(cu_seqlens, q.shape[0])
    layout.check_compatible(q, k, cu_seqlens)
    total, hq, dim = q.shape
    scale = dim**-0.5 if scale is None else scale
    with torch.no_grad():
        kk = k.double().repeat_interleave(hq // k.shape[1], dim=1)
        logits = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
        logits = logits.masked_fill(~token_mask(cu_seqlens, total, q.device)[None], -math.inf)
        prob = torch.softmax(logits, dim=-1)
        covered = (prob * layout.to_mask(cu_seqlens).to(prob.dtype)).sum(-1)
    return covered.mean(-1)
