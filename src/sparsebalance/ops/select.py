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
from .layout import BlockLayout, document_density
from .pack_index import PackIndex, ScoreBatch
from .select_rules import DocumentBatch
from .topk_gate import GateTables, TopKGate, gate_applies
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


def pool_segments(x: torch.Tensor, seg_of_token: torch.Tensor, seg_len: torch.Tensor) -> torch.Tensor:
    """Mean of ``x (T, H, D)`` per segment -> ``(S, H, D)`` in float32 (float64 kept).

    ``seg_of_token`` int64 ``(T,)`` is each token's segment, ``seg_len`` ``(S,)`` the lengths;
    segments are contiguous runs of tokens in order, so a segmented sum does it (about 20x
    faster on CPU than a scattered ``index_add_``).
    """
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    flat = x.to(dtype).reshape(x.shape[0], -1)
    out = torch.segment_reduce(flat, "sum", lengths=seg_len.to(x.device), axis=0)
    return out.view(-1, *x.shape[1:]) / seg_len.to(dtype)[:, None, None]


def pool_pack(x: torch.Tensor, pack: PackIndex) -> torch.Tensor:
    """Mean of ``x (T, H, D)`` per segment of ``pack`` -> ``(S, H, D)`` in float32 (float64
    kept), without a scatter or a read back: whole blocks by a reshape and a sum, the few blocks
    a document start splits by prefix sums inside those blocks (:meth:`PackIndex.pool_plan`).
    Reads ``x`` once; writes ``O(S H D)``."""
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    plan, bs = pack.pool_plan(), pack.block_size
    out = torch.empty(pack.num_segments, *x.shape[1:], dtype=dtype, device=x.device)
    if plan["whole_idx"].numel():
        nfull = plan["nfull"]
        sums = x[: nfull * bs].unflatten(0, (nfull, bs)).sum(1, dtype=dtype)  # (nfull, H, D)
        out[plan["whole_idx"]] = sums[plan["whole_block"]]
    if plan["split_idx"].numel():
        pre = x[plan["tok"]].cumsum(1, dtype=dtype).flatten(0, 1)  # (K * B, H, D)
        lo = plan["lo"]
        below = pre[lo.clamp(min=0)] * (lo >= 0).to(dtype)[:, None, None]
        out[plan["split_idx"]] = pre[plan["hi"]] - below
    length = pack.segments()[1]
    return out / length.to(dtype)[:, None, None]


@dataclass(frozen=True)
class BlockMassEstimate:
    """Estimated attention mass between segments (block ∩ document) of one pack, for one layer.

    Computed once per layer by :func:`estimate_block_mass`; any number of budgets can then be
    turned into layouts (:meth:`layout`) or densities (:meth:`density`) without recomputing it,
    which is what run-time budget tuning needs. Every method is device work of fixed shape (the
    shapes come from the pack's host-side :class:`PackIndex`); only :meth:`density`,
    :meth:`coverage` and :meth:`coverage_curve` return host numbers (one read back each).
    """

    batches: tuple[DocumentBatch, ...]
    """The documents, batched by segment count."""
    pack: PackIndex
    num_q_heads: int
    num_layout_heads: int
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def block_mask(self, budget: Budget) -> torch.Tensor:
        """Bool ``(H_layout, nb, nb)``: the block pairs this budget keeps."""
        if not isinstance(budget, Budget):
            raise TypeError(f"budget must be a sparsebalance.ops.Budget, got {type(budget).__name__}")
        nb, h = self.pack.num_blocks, self.num_layout_heads
        hits = torch.zeros(h, nb * nb, dtype=torch.int32, device=self.pack.cu_seqlens.device)
        for i, batch in enumerate(self.batches):
            keep = batch.keep(budget, self._cache.setdefault(i, {}))  # (H, n, s, s)
            # Segments -> blocks: a query block keeps the union over its query segments; a
            # fixed-shape scatter (no nonzero, no read back). Padding pairs add 0.
            index = batch.pair_index.reshape(1, -1).expand(h, -1)
            hits.scatter_add_(1, index, keep.reshape(h, -1).to(torch.int32))
        return (hits > 0).view(h, nb, nb)

    def layout(self, budget: Budget, dense_from: float | None = None) -> BlockLayout:
        """The :class:`BlockLayout` this budget keeps, with the documents kept whole marked dense
        (:meth:`Budget.dense_documents`: covered by the budget, or promoted from
        ``dense_from``: every causal block of a promoted document is added)."""
        dense = budget.dense_documents(self.pack, dense_from)
        mask = self.block_mask(budget)
        covered = budget.dense_documents(self.pack)
        if dense != covered:
            mask = mask | self.pack.documents_block_mask(dense)[None]
        return BlockLayout(mask, self.pack, self.num_q_heads, dense)

    def document_density(self, budget: Budget) -> torch.Tensor:
        """float64 ``(N,)``: per-document density of :meth:`layout`, without building it."""
        return document_density(self.block_mask(budget), self.pack)

    def density(self, budget: Budget) -> float:
        """Density of :meth:`layout` for this budget."""
        mask = self.block_mask(budget)
        causal = self.pack.causal_block_mask()
        return float((mask & causal).sum()) / float(causal.sum() * mask.shape[0])

    def document_coverage(self, budget: Budget) -> torch.Tensor:
        """float64 ``(N,)``: per document, the estimated attention mass the budget keeps, mean
        over layout heads and query tokens (each query's estimated masses sum to 1): ``C`` of the
        paper's coverage bound. 1.0 when every causal block is kept."""
        num_docs = self.pack.num_docs
        out = torch.zeros(num_docs, dtype=torch.float64, device=self.pack.cu_seqlens.device)
        for i, batch in enumerate(self.batches):
            cache = self._cache.setdefault(i, {})
            if budget.top_k is not None and budget.max_density is None:
                out[batch.docs] = batch.topk_covered(budget, cache)
            else:
                out[batch.docs] = batch.covered(batch.keep(budget, cache))
        tokens = torch.diff(self.pack.cu_seqlens.long()).double().clamp_min(1)
        return out / (tokens * self.num_layout_heads)

    def coverage_curve(self, budget: Budget, ks) -> np.ndarray:
        """float64 ``(K,)``: the pack's :meth:`coverage` of ``budget`` (a top-k budget without a
        cap: its anchors) at every k of ``ks``, computed together and read back once (one host
        sync, however many k a decision looks at)."""
        if budget.top_k is None or budget.max_density is not None:
            return np.array([self.coverage(budget.with_value(k)) for k in ks])
        return self.coverage_curve_tensor(budget, ks).cpu().numpy()

    def coverage_curve_tensor(self, budget: Budget, values) -> torch.Tensor:
        """:meth:`coverage_curve` of a budget without a cap at every knob value of ``values``
        (host numbers, ascending: k of a top-k budget, gamma of a gamma one; copied to the device
        once per pack) as a float64 ``(K,)`` device tensor: nothing read back."""
        if budget.max_density is not None:
            raise ValueError(f"{budget}: a capped budget's coverage curve is read on the host (coverage_curve)")
        top_k = budget.top_k is not None
        dtype = np.int64 if top_k else np.float64
        values = tuple(int(v) if top_k else float(v) for v in values)
        at = self.pack.memo(("knob values", top_k, values), lambda: self.pack.upload(np.asarray(values, dtype), None))
        total = torch.zeros(at.numel(), dtype=torch.float64, device=at.device)
        for i, batch in enumerate(self.batches):
            cache = self._cache.setdefault(i, {})
            total += batch.topk_covered(budget, cache, at).sum(-1) if top_k else batch.gamma_covered(budget, cache, at)
        return total / (self.pack.seq_len * self.num_layout_heads)

    def coverage_floor(self, budget: Budget, ks, p: float) -> torch.Tensor:
        """int64 ``(1,)`` device: the index in ``ks`` (knob values, ascending, the last the base)
        of the smallest one whose coverage of ``budget``'s anchors is within ``p`` of the last's
        (a budget without a cap, top-k or gamma; no read back)."""
        cov = self.coverage_curve_tensor(budget, ks)
        return torch.searchsorted(cov, cov[-1:] - p)

    def keeps_whole(self, budget: Budget) -> bool:
        """Whether ``budget`` keeps every document of the pack whole (host)."""
        return all(budget.dense_documents(self.pack))

    def coverage(self, budget: Budget) -> float:
        """The pack's coverage: :meth:`document_coverage` weighted by document tokens."""
        tokens = torch.diff(self.pack.cu_seqlens.long()).double()
        return float((self.document_coverage(budget) * tokens).sum() / tokens.sum())


def estimate_block_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_size: int,
    share_kv_groups: bool = False,
    scale: float | None = None,
    pack: PackIndex | None = None,
) -> BlockMassEstimate:
    """The estimator half of :func:`select_blocks` (same arguments, no budget)."""
    check_qkv(q, k)
    pack = _pack_for(q, cu_seqlens, block_size, pack)
    with torch.no_grad():
        qp = pool_pack(q.detach(), pack)  # (S, Hq, D)
        kp = pool_pack(k.detach(), pack)  # (S, Hkv, D)
    return estimate_from_pooled(qp, kp, pack.cu_seqlens, block_size, share_kv_groups, scale, pack)


def _pack_for(q: torch.Tensor, cu_seqlens, block_size: int, pack: PackIndex | None) -> PackIndex:
    """The pack's index on q's device: ``pack`` if given (the training path, built before the
    forward), else built from ``cu_seqlens`` (reads its values: a host sync on a device)."""
    if pack is None:
        check_cu_seqlens(cu_seqlens, q.shape[0])
        pack = PackIndex.build(cu_seqlens, block_size)
    elif pack.block_size != block_size:
        raise ValueError(f"pack was indexed for block_size={pack.block_size}, got {block_size}")
    if pack.seq_len != q.shape[0]:
        raise ValueError(f"cu_seqlens must end at T={q.shape[0]} (the packed length), got {pack.seq_len}")
    return pack.to(q.device)


def estimate_from_pooled(
    qp: torch.Tensor,
    kp: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_size: int,
    share_kv_groups: bool = False,
    scale: float | None = None,
    pack: PackIndex | None = None,
) -> BlockMassEstimate:
    """:func:`estimate_block_mass` from the per-segment means ``qp (S, Hq, D)``, ``kp (S, Hkv, D)``.

    The segments are those of :func:`segments` ``(cu_seqlens, T, block_size)`` in order. Context
    parallelism gathers the (small) pooled tensors from the ranks and calls this, so every rank
    gets the layout one device would.
    """
    if pack is None:
        pack = PackIndex.build(cu_seqlens, block_size)
    pack = pack.to(qp.device)
    hq, dim = qp.shape[1:]
    scale = resolve_scale(scale, dim)
    n_layout = kp.shape[1] if share_kv_groups else hq
    with torch.no_grad():
        length = pack.segments()[1]
        batches = tuple(_score_documents(qp, kp, length, b, scale, n_layout) for b in pack.score_batches())
    return BlockMassEstimate(batches, pack, hq, n_layout)


def _score_documents(qp, kp, length, batch: ScoreBatch, scale, n_layout) -> DocumentBatch:
    """The gate's scores of the ``n`` documents of ``batch`` (padded to ``s`` segments);
    ``qp (S, Hq, D)``, ``kp (S, Hkv, D)`` pooled means, ``length (S,)`` segment lengths."""
    hq, hkv = qp.shape[1], kp.shape[1]
    n, s, real, seg = batch.n, batch.s, batch.real, batch.seg
    slot = torch.arange(s, device=qp.device)
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
        logits = torch.baddbmm(bias.repeat(heads.numel(), 1, 1), qh, kh.transpose(1, 2), alpha=scale)
        logits = logits.view(heads.numel(), n, s, s).masked_fill_(~allowed, -math.inf)
        p = torch.softmax(logits, dim=-1).masked_fill_(~allowed.any(-1, keepdim=True), 0.0)
        prob[h0:h1] = p.view(h1 - h0, per_layout, n, s, s).mean(1)
    non_finite = ~torch.isfinite(prob).all(-1, keepdim=True)
    seg_tokens = torch.where(real, seg_len, torch.zeros_like(seg_len))
    return DocumentBatch(prob, allowed, batch.seg_block, non_finite, seg_tokens, batch.docs, batch.pair_index)


def select_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens: torch.Tensor,
    budget: Budget,
    block_size: int,
    share_kv_groups: bool = False,
    scale: float | None = None,
    pack: PackIndex | None = None,
    dense_from: float | None = None,
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
        pack: the pack's :class:`PackIndex` (built from ``cu_seqlens`` if None, which reads the
            offsets back when they live on a device).
        dense_from: the density from which a document runs faster on the dense kernel (the
            latency profile's crossover): a top-k document whose density reaches it keeps every
            causal block (:meth:`Budget.dense_documents`). None: only covered documents.

    Returns:
        A :class:`BlockLayout` with ``Hq`` heads (or ``Hkv`` with ``share_kv_groups``). When the
        budget covers every document (:meth:`Budget.covers`), nothing is estimated: the layout
        is every causal block, all documents dense.
    """
    if not isinstance(budget, Budget):
        raise TypeError(f"budget must be a sparsebalance.ops.Budget, got {type(budget).__name__}")
    check_qkv(q, k)
    pack = _pack_for(q, cu_seqlens, block_size, pack)
    if all(budget.dense_documents(pack, dense_from)):
        heads = k.shape[1] if share_kv_groups else q.shape[1]
        return BlockLayout.full(pack, heads, q.shape[1])
    if gate_applies(budget, share_kv_groups):
        tables = GateTables.of(pack, budget, dense_from)
        if tables is not None:  # one batch for the pack (else the per-document batches)
            scale = resolve_scale(scale, q.shape[-1])
            return TopKGate.score(q, k, tables, scale).layout(budget, dense_from)
    est = estimate_block_mass(q, k, cu_seqlens, block_size, share_kv_groups, scale, pack)
    return est.layout(budget, dense_from)


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
