"""Dynamic block selection: estimate block attention mass cheaply, keep blocks by the budget.

Estimator (the *gate*). The packed buffer is cut into *segments* = (block ∩ document), so a block
that holds the end of one document and the start of the next is scored per document. Queries and
keys are mean-pooled per segment; the logit of (query segment i, key segment j) is
``scale * q̄_i · k̄_j + log(n_j)`` (a segment of ``n_j`` similar keys carries ``n_j`` times the mass
of one; the diagonal segment counts ``(n_j + 1) / 2`` as half of it is causally hidden), softmaxed
over the causal key segments of i's document. For whole blocks (every block but a document's
first, last and diagonal ones) the ranking is MoBA's gate on mean-pooled keys, here with the
query block's mean query (per-query-block gating: what block kernels run; see the README for the
per-token variant's recall and cost). A document only scores its own segments: documents with a
similar segment count ``s_d`` are batched together (padded to the batch's largest), so the cost is
O(sum_d s_d^2 * D) per head with ``sum_d s_d ≈ T/B + N`` — linear in the number of documents, a
few percent of the attention itself (O(T^2 * D)) for long ones.

Rules. Per query segment the anchors are kept (first ``sink_blocks`` blocks of the document,
``local_blocks`` diagonal blocks), and then

- ``Budget(top_k=K)``: the ``K`` non-anchor causal key segments of highest estimated mass;
- ``Budget(gamma=g)``: the fewest key segments whose estimated mass reaches ``g`` (at least
  ``min_blocks``);

then the ``max_density`` cap applies to the total, anchors included (see
:class:`~.budget.Budget`); a query block keeps the union over its segments.

Coverage. The estimated mass of the kept segments, per query segment (rows sum to 1), averaged
over heads and query tokens (:meth:`BlockMassEstimate.coverage`): ``C(k)``, what DST's coverage
bound ``C(k_base) - C(k) <= p`` is measured with.

Non-finite input. A query segment whose estimate is NaN/inf (a NaN or inf in its queries or in a
causal key of its document) keeps every causal block, whatever the budget: the NaN then reaches the
attention output as it would with dense attention, instead of being hidden by the selection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from .budget import Budget
from .layout import BlockLayout, causal_block_mask, document_density, num_blocks
from .varlen import check_cu_seqlens, check_qkv, doc_ids, resolve_scale, token_mask

# Bound on (heads x documents x s x s) elements processed at once, so long contexts fit in memory.
_MAX_SCORE_ELEMS = 1 << 26


def segments(cu_seqlens: torch.Tensor, total: int, block_size: int):
    """Cut [0, T) at block and document boundaries.

    Returns int64 ``(S,)`` tensors: start token, length, block and document of every segment,
    in token order.
    """
    dev = cu_seqlens.device
    cuts = torch.cat([torch.arange(0, total, block_size, device=dev), cu_seqlens[:-1].long()])
    start = torch.unique(cuts)  # sorted
    length = torch.diff(start, append=torch.tensor([total], device=dev))
    return start, length, start // block_size, doc_ids(cu_seqlens, total)[start]


def pool_segments(
    x: torch.Tensor, seg_of_token: torch.Tensor, seg_len: torch.Tensor
) -> torch.Tensor:
    """Mean of ``x (T, H, D)`` per segment -> ``(S, H, D)`` in float32 (float64 kept).

    ``seg_of_token`` int64 ``(T,)`` is each token's segment, ``seg_len`` ``(S,)`` the lengths;
    segments are contiguous runs of tokens in order, so a segmented sum does it (about 20x
    faster on CPU than a scattered ``index_add_``).
    """
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    flat = x.to(dtype).reshape(x.shape[0], -1)
    out = torch.segment_reduce(flat, "sum", lengths=seg_len.to(x.device), axis=0)
    return out.view(-1, *x.shape[1:]) / seg_len.to(dtype)[:, None, None]


def _sort_rows(prob: torch.Tensor):
    """Per row: descending order, the mass ranked above each entry, each entry's rank."""
    sorted_p, order = torch.sort(prob, dim=-1, descending=True, stable=True)
    before = sorted_p.cumsum(-1) - sorted_p
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return before, rank, order


def _keep_by_mass(prob, allowed, anchors, budget: Budget, sorted_rows) -> torch.Tensor:
    """The gamma rule on ``prob (H, n, s, s)``: bool keep mask (anchors included)."""
    if budget.is_dense:
        return allowed.expand_as(prob)
    before, rank, order = sorted_rows
    n_allowed = allowed.sum(-1, keepdim=True)
    keep_n = (before < budget.gamma).sum(-1, keepdim=True) if budget.gamma < 1.0 else n_allowed
    floor_n = torch.clamp(n_allowed, max=budget.min_blocks)
    keep = (rank < torch.maximum(keep_n, floor_n)) & allowed
    return _cap(keep, anchors & allowed, n_allowed, floor_n, budget, order)


def _top_k_rows(prob, allowed, anchors):
    """Per row, each non-anchor causal segment's rank by estimated mass (0 = highest; anchors
    and non-causal segments rank last) and the descending order."""
    candidate = allowed & ~anchors
    key = prob.masked_fill(~candidate, -1.0)  # masses are >= 0: non-candidates sort last
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return rank, order


def _keep_top_k(allowed, anchors, budget: Budget, rows) -> torch.Tensor:
    """The top-k rule: the anchors plus the ``top_k`` best non-anchor causal segments."""
    rank, order = rows
    anchors = anchors & allowed
    n_allowed = allowed.sum(-1, keepdim=True)
    floor_n = torch.clamp(n_allowed, max=budget.min_blocks)
    extra_n = torch.clamp(floor_n - anchors.sum(-1, keepdim=True), min=budget.top_k)
    keep = (rank < extra_n) & allowed & ~anchors
    return _cap(keep | anchors, anchors, n_allowed, floor_n, budget, order)


def _cap(keep, anchors, n_allowed, floor_n, budget: Budget, order) -> torch.Tensor:
    """``max_density``: the cap counts every kept block, anchors included; the floors (anchors,
    ``min_blocks``) win. ``order``: the rows' preference order for what the cap keeps."""
    if budget.max_density is None:
        return keep | anchors
    limit = torch.maximum(torch.floor(n_allowed * budget.max_density + 1e-9).long(), floor_n)
    quota = (limit - anchors.sum(-1, keepdim=True)).clamp_min(0)
    extra = keep & ~anchors
    extra_sorted = extra.gather(-1, order).long()
    extra_rank = torch.empty_like(order).scatter_(-1, order, extra_sorted.cumsum(-1) - extra_sorted)
    return anchors | (extra & (extra_rank < quota))


@dataclass(frozen=True)
class DocumentBatch:
    """The segments of documents with similar segment counts, padded to ``s`` per document."""

    prob: torch.Tensor
    """``(H_layout, n, s, s)``: estimated mass of key segment j for query segment i of a document
    (rows sum to 1; padded rows are 0)."""
    allowed: torch.Tensor
    """bool ``(n, s, s)``: key segment j is causal for query segment i (j <= i, both real)."""
    seg_block: torch.Tensor
    """int64 ``(n, s)``: block of each segment (padding repeats the first)."""
    non_finite: torch.Tensor
    """bool ``(H_layout, n, s, 1)``: the row's estimate is NaN/inf (keeps every causal block)."""
    seg_tokens: torch.Tensor
    """float ``(n, s)``: tokens of each segment (0 for padding): a query row's weight."""
    docs: torch.Tensor
    """int64 ``(n,)``: the pack's index of each document of the batch."""

    def anchors(self, budget: Budget) -> torch.Tensor:
        """Bool ``(n, s, s)``: the anchor segments (sink, local) of every query segment."""
        sb = self.seg_block
        return (sb - sb[:, :1] < budget.sink_blocks)[:, None, :] | (
            sb[:, :, None] - sb[:, None, :] < budget.local_blocks
        )

    def keep(self, budget: Budget, cache: dict) -> torch.Tensor:
        """Bool ``(H_layout, n, s, s)``: the kept segment pairs under ``budget``."""
        anchors = self.anchors(budget)
        if budget.top_k is not None:
            key = ("top-k", budget.sink_blocks, budget.local_blocks)
            if key not in cache:  # the ranking depends on the anchors only, not on k
                cache[key] = _top_k_rows(self.prob, self.allowed, anchors)
            keep = _keep_top_k(self.allowed, anchors, budget, cache[key])
        else:
            if "rows" not in cache and not budget.is_dense:
                cache["rows"] = _sort_rows(self.prob)  # shared by every later budget
            keep = _keep_by_mass(self.prob, self.allowed, anchors, budget, cache.get("rows"))
        return torch.where(self.non_finite, self.allowed, keep)

    def topk_covered(
        self, budget: Budget, cache: dict, ks: torch.Tensor | None = None
    ) -> torch.Tensor:
        """float64 ``(n,)``: :meth:`covered` of the top-k rule without a cap, read off one sorted
        cumulative sum per row (cached per anchor setting): what any k keeps of a row is its
        anchors' mass plus its ``k`` largest other masses. With ``ks`` (int64 ``(K,)``): the
        same for every k at once, ``(K, n)``."""
        key = ("top-k coverage", budget.sink_blocks, budget.local_blocks)
        if key not in cache:
            anchors = self.anchors(budget) & self.allowed
            prob = torch.nan_to_num(self.prob.double(), nan=0.0)
            base = (prob * anchors).sum(-1)  # (H, n, s)
            cand = prob.masked_fill(~(self.allowed & ~anchors), 0.0)
            cums = torch.sort(cand, dim=-1, descending=True).values.cumsum(-1)  # (H, n, s, s)
            cums = torch.cat([torch.zeros_like(cums[..., :1]), cums], -1)
            cache[key] = (base, cums)
        base, cums = cache[key]
        if ks is None:
            k = min(int(budget.top_k), cums.shape[-1] - 1)
            mass = torch.where(self.non_finite[..., 0], 1.0, base + cums[..., k])
            return (mass * self.seg_tokens.double()[None]).sum((0, 2))
        kept = cums[..., ks.clamp(max=cums.shape[-1] - 1)]  # (H, n, s, K)
        mass = torch.where(self.non_finite, 1.0, base[..., None] + kept)
        return torch.einsum("hnsk,ns->kn", mass, self.seg_tokens.double())

    def covered(self, keep: torch.Tensor) -> torch.Tensor:
        """float64 ``(n,)``: per document, the estimated mass the kept pairs cover, summed over
        layout heads and query tokens (divide by heads x tokens for the mean coverage)."""
        mass = torch.nan_to_num((self.prob * keep).sum(-1), nan=1.0)  # (H, n, s)
        return (mass.double() * self.seg_tokens.double()[None]).sum((0, 2))


@dataclass(frozen=True)
class BlockMassEstimate:
    """Estimated attention mass between segments (block ∩ document) of one pack, for one layer.

    Computed once per layer by :func:`estimate_block_mass`; any number of budgets can then be
    turned into layouts (:meth:`layout`) or densities (:meth:`density`) without recomputing it,
    which is what run-time budget tuning needs.
    """

    batches: tuple[DocumentBatch, ...]
    """The documents, batched by segment count."""
    cu_seqlens: torch.Tensor
    seq_len: int
    block_size: int
    num_q_heads: int
    num_layout_heads: int
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def block_mask(self, budget: Budget) -> torch.Tensor:
        """Bool ``(H_layout, nb, nb)``: the block pairs this budget keeps."""
        if not isinstance(budget, Budget):
            raise TypeError(
                f"budget must be a sparsebalance.ops.Budget, got {type(budget).__name__}"
            )
        nb = num_blocks(self.seq_len, self.block_size)
        h = self.num_layout_heads
        dev = self.cu_seqlens.device
        out = torch.zeros(h, nb * nb, dtype=torch.bool, device=dev)
        for i, batch in enumerate(self.batches):
            keep = batch.keep(budget, self._cache.setdefault(i, {}))
            # Segments -> blocks: a query block keeps the union over its query segments.
            heads, docs, qs, ks = keep.nonzero(as_tuple=True)
            sb = batch.seg_block
            flat = heads * (nb * nb) + sb[docs, qs] * nb + sb[docs, ks]
            out.view(-1).index_fill_(0, flat, True)  # ~100x faster than out[h, i] = True
        return out.view(h, nb, nb)

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

    def document_coverage(self, budget: Budget) -> torch.Tensor:
        """float64 ``(N,)``: per document, the estimated attention mass the budget keeps, mean
        over layout heads and query tokens (each query's estimated masses sum to 1): ``C`` of the
        paper's coverage bound. 1.0 when every causal block is kept."""
        num_docs = self.cu_seqlens.numel() - 1
        out = torch.zeros(num_docs, dtype=torch.float64, device=self.cu_seqlens.device)
        for i, batch in enumerate(self.batches):
            cache = self._cache.setdefault(i, {})
            if budget.top_k is not None and budget.max_density is None:
                out[batch.docs] = batch.topk_covered(budget, cache)
            else:
                out[batch.docs] = batch.covered(batch.keep(budget, cache))
        tokens = torch.diff(self.cu_seqlens.long()).double().clamp_min(1)
        return out / (tokens * self.num_layout_heads)

    def coverage_curve(self, budget: Budget, ks) -> np.ndarray:
        """float64 ``(K,)``: the pack's :meth:`coverage` of ``budget`` (a top-k budget without a
        cap: its anchors) at every k of ``ks``, computed together and read back once (one host
        sync, however many k a decision looks at)."""
        if budget.top_k is None or budget.max_density is not None:
            return np.array([self.coverage(budget.with_value(k)) for k in ks])
        dev = self.cu_seqlens.device
        ks_t = torch.as_tensor(np.asarray(ks), dtype=torch.int64, device=dev)
        total = torch.zeros(ks_t.numel(), dtype=torch.float64, device=dev)
        for i, batch in enumerate(self.batches):
            total += batch.topk_covered(budget, self._cache.setdefault(i, {}), ks_t).sum(-1)
        return (total / (self.seq_len * self.num_layout_heads)).cpu().numpy()

    def coverage(self, budget: Budget) -> float:
        """The pack's coverage: :meth:`document_coverage` weighted by document tokens."""
        tokens = torch.diff(self.cu_seqlens.long()).double()
        return float((self.document_coverage(budget) * tokens).sum() / tokens.sum())


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
        start, length, _, _ = segments(cu, total, block_size)
        tokens = torch.arange(total, device=q.device)
        seg_of_token = torch.searchsorted(start, tokens, right=True) - 1
        qp = pool_segments(q.detach(), seg_of_token, length)  # (S, Hq, D)
        kp = pool_segments(k.detach(), seg_of_token, length)  # (S, Hkv, D)
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

    The segments are those of :func:`segments` ``(cu_seqlens, T, block_size)`` in order. Context
    parallelism gathers the (small) pooled tensors from the ranks and calls this, so every rank
    gets the layout one device would.
    """
    total = int(cu_seqlens[-1])
    hq, dim = qp.shape[1:]
    hkv = kp.shape[1]
    scale = resolve_scale(scale, dim)
    cu = cu_seqlens.to(qp.device)
    n_layout = hkv if share_kv_groups else hq
    with torch.no_grad():
        _, length, seg_block, seg_doc = segments(cu, total, block_size)
        num_docs = cu.numel() - 1
        first = torch.searchsorted(seg_doc, torch.arange(num_docs, device=qp.device))
        count = torch.diff(first, append=first.new_tensor([seg_doc.numel()]))  # s_d, all >= 1
        # Documents whose segment counts share a power of two are scored together.
        group = torch.floor(torch.log2(count.double())).long().cpu()
        batches = []
        for g in torch.unique(group).tolist():
            docs = torch.nonzero(group == g).flatten().to(qp.device)
            batches.append(
                _score_documents(
                    qp, kp, length, seg_block, docs, first[docs], count[docs], scale, n_layout
                )
            )
    return BlockMassEstimate(tuple(batches), cu.to(torch.int32), total, block_size, hq, n_layout)


def _score_documents(qp, kp, length, seg_block, docs, first, count, scale, n_layout):
    """The :class:`DocumentBatch` of ``n`` documents ``docs (n,)``: their first segment
    ``first (n,)`` and segment counts ``count (n,)``; ``qp (S, Hq, D)``, ``kp (S, Hkv, D)``
    pooled means."""
    hq, hkv = qp.shape[1], kp.shape[1]
    s = int(count.max())
    n = first.numel()
    slot = torch.arange(s, device=qp.device)
    real = slot[None, :] < count[:, None]  # (n, s)
    seg = torch.where(real, first[:, None] + slot, first[:, None])  # (n, s) segment ids
    allowed = (slot[None, :] <= slot[:, None])[None] & real[:, None, :] & real[:, :, None]
    seg_len = length[seg].to(qp.dtype)
    bias = torch.log(seg_len)[:, None, :].expand(n, s, s).clone()
    bias.diagonal(dim1=1, dim2=2).copy_(torch.log((seg_len + 1) / 2))
    qd = qp[seg].permute(2, 0, 1, 3)  # (Hq, n, s, D)
    kd = kp[seg].permute(2, 0, 1, 3)  # (Hkv, n, s, D)

    per_layout = hq // n_layout  # query heads per layout head
    prob = torch.empty(n_layout, n, s, s, dtype=qp.dtype, device=qp.device)
    chunk = max(1, _MAX_SCORE_ELEMS // max(1, n * s * s * per_layout))
    for h0 in range(0, n_layout, chunk):
        h1 = min(n_layout, h0 + chunk)
        heads = torch.arange(h0 * per_layout, h1 * per_layout, device=qp.device)
        qh = qd[heads].reshape(-1, s, qd.shape[-1])  # (heads*n, s, D)
        kh = kd[heads // (hq // hkv)].reshape(-1, s, kd.shape[-1])
        logits = torch.baddbmm(
            bias.repeat(heads.numel(), 1, 1), qh, kh.transpose(1, 2), alpha=scale
        )
        logits = logits.view(heads.numel(), n, s, s).masked_fill_(~allowed, -math.inf)
        p = torch.softmax(logits, dim=-1).masked_fill_(~allowed.any(-1, keepdim=True), 0.0)
        prob[h0:h1] = p.view(h1 - h0, per_layout, n, s, s).mean(1)
    non_finite = ~torch.isfinite(prob).all(-1, keepdim=True)
    seg_tokens = torch.where(real, seg_len, torch.zeros_like(seg_len))
    return DocumentBatch(prob, allowed, seg_block[seg], non_finite, seg_tokens, docs)


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
        budget: the :class:`Budget` (top_k or gamma, anchors, floor, cap).
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
    scale = resolve_scale(scale, dim)
    with torch.no_grad():
        kk = k.double().repeat_interleave(hq // k.shape[1], dim=1)
        logits = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
        logits = logits.masked_fill(~token_mask(cu_seqlens, total, q.device)[None], -math.inf)
        prob = torch.softmax(logits, dim=-1)
        covered = (prob * layout.to_mask(cu_seqlens).to(prob.dtype)).sum(-1)
    return covered.mean(-1)
