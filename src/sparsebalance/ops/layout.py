"""``BlockLayout``: which (query block, key block) pairs the sparse attention computes.

Blocks are ``block_size`` consecutive tokens of the packed buffer (documents need not start on a
block boundary). For a query block ``qb`` the doc-causal key blocks always form the contiguous range
``[doc_start(first token of qb) // B, qb]``: token i sees keys ``[doc_start_i, i]`` and those
intervals chain without gaps inside the block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .varlen import check_cu_seqlens, debug_checks, token_mask


def num_blocks(total: int, block_size: int) -> int:
    return (total + block_size - 1) // block_size


def causal_block_range(cu_seqlens: torch.Tensor, total: int, block_size: int) -> torch.Tensor:
    """Lowest doc-causal key block of every query block: int64 ``(num_blocks,)``.

    Query block ``qb`` may attend to key blocks ``lo[qb] .. qb`` (inclusive), and no others.
    """
    cu = cu_seqlens.to(torch.int64)
    first_tok = torch.arange(0, total, block_size, device=cu.device)  # O(blocks), not O(T)
    return cu[torch.searchsorted(cu[1:], first_tok, right=True)] // block_size


def causal_block_mask(cu_seqlens: torch.Tensor, total: int, block_size: int) -> torch.Tensor:
    """Bool ``(nb, nb)``: True where a (query block, key block) pair has a doc-causal token pair."""
    lo = causal_block_range(cu_seqlens, total, block_size)
    kb = torch.arange(lo.numel(), device=lo.device)
    return (kb[None, :] >= lo[:, None]) & (kb[None, :] <= kb[:, None])


def dense_to_ordered(block_mask: torch.Tensor, width: int | None = None):
    """Bool ``(..., nq, nk)`` -> (int32 counts ``(..., nq)``, int32 indices ``(..., nq, W)``).

    ``W`` is ``width`` or the largest count (reading it is a host sync on a device: callers in
    the hot path pass ``width``); slots past a row's count are 0, kept blocks past ``W`` are
    dropped. No sort: each kept block goes to the slot its running count gives it (ascending).
    """
    counts = block_mask.sum(-1, dtype=torch.int32)
    width = max(int(counts.max()), 1) if width is None else width
    slot = block_mask.to(torch.int32).cumsum(-1, dtype=torch.int32) - 1
    slot = torch.where(block_mask & (slot < width), slot, width).long()  # spare column: dropped
    kb = torch.arange(block_mask.shape[-1], dtype=torch.int32, device=block_mask.device)
    out = torch.zeros(*block_mask.shape[:-1], width + 1, dtype=torch.int32,
                      device=block_mask.device)  # fmt: skip
    out.scatter_(-1, slot, kb.expand(block_mask.shape))
    return counts, out[..., :width].contiguous()


def document_density(
    block_mask: torch.Tensor, cu_seqlens: torch.Tensor, block_size: int, total: int | None = None
) -> torch.Tensor:
    """float64 ``(N,)``: per-document density of a bool ``(H, nb, nb)`` block mask (see
    :meth:`BlockLayout.document_density`); ``total``: T if known (else read from
    ``cu_seqlens``: a host sync on a device)."""
    total = int(cu_seqlens[-1]) if total is None else total
    cu = cu_seqlens.to(block_mask.device).long()
    causal = causal_block_mask(cu, total, block_size)
    kept = (block_mask & causal[None]).sum(0).double()
    # 2-D prefix sums turn each document's square of blocks into four lookups.
    pre = torch.nn.functional.pad(kept.cumsum(0).cumsum(1), (1, 0, 1, 0))
    b0 = cu[:-1] // block_size
    b1 = (cu[1:] - 1) // block_size + 1
    kept_doc = pre[b1, b1] - pre[b0, b1] - pre[b1, b0] + pre[b0, b0]
    n = (b1 - b0).double()
    return kept_doc / (n * (n + 1) / 2 * block_mask.shape[0])


@dataclass(frozen=True)
class BlockLayout:
    """The key blocks computed for every (layout head, query block), flex-attention style.

    ``kv_indices[h, qb, :kv_num_blocks[h, qb]]`` are the sorted key blocks of query block ``qb``
    for layout head ``h``; entries past ``kv_num_blocks`` are padding (0) and ignored.
    A layout has either one head per query head (``num_heads == num_q_heads``) or one per group of
    query heads that share a KV head (``num_heads`` a multiple of ``Hkv`` dividing ``Hq``), in
    which case query head ``h`` uses layout head ``h // (num_q_heads // num_heads)``.
    """

    kv_num_blocks: torch.Tensor
    """int32 ``(H_layout, nb)``: number of key blocks kept per query block."""
    kv_indices: torch.Tensor
    """int32 ``(H_layout, nb, max_kv)``: sorted key block indices, padded with 0."""
    cu_seqlens: torch.Tensor
    """int32 ``(N + 1,)``: the pack the layout was built for."""
    seq_len: int
    """T, the packed length."""
    block_size: int
    """Tokens per block."""
    num_q_heads: int
    """Hq of the attention this layout serves."""

    def __post_init__(self) -> None:
        h, nb = self.kv_num_blocks.shape
        if nb != num_blocks(self.seq_len, self.block_size):
            raise ValueError(
                f"kv_num_blocks has {nb} query blocks but T={self.seq_len} with "
                f"block_size={self.block_size} needs {num_blocks(self.seq_len, self.block_size)}"
            )
        if self.kv_indices.shape[:2] != (h, nb):
            raise ValueError("kv_indices must be (H_layout, nb, max_kv) matching kv_num_blocks")
        if self.num_q_heads % h != 0:
            raise ValueError(f"layout heads ({h}) must divide num_q_heads ({self.num_q_heads})")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_block_mask(
        cls,
        block_mask: torch.Tensor,
        cu_seqlens: torch.Tensor,
        block_size: int,
        num_q_heads: int,
        width: int | None = None,
    ) -> BlockLayout:
        """Build from a bool ``(H_layout, nb, nb)`` block mask (True = compute the pair);
        ``width``: slots per query block (default: the largest count, a host sync on a device;
        a fixed width keeps shapes fixed and the host out of it)."""
        if block_mask.dtype != torch.bool or block_mask.dim() != 3:
            raise ValueError("block_mask must be a bool tensor (H_layout, nb, nb)")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        check_cu_seqlens(cu_seqlens)
        total = int(cu_seqlens[-1])
        nb = num_blocks(total, block_size)
        if block_mask.shape[1:] != (nb, nb):
            raise ValueError(
                f"block_mask must be (H, {nb}, {nb}) for T={total}, block_size={block_size}; "
                f"got {tuple(block_mask.shape)}"
            )
        counts, indices = dense_to_ordered(block_mask, width)
        return cls(
            counts,
            indices,
            cu_seqlens.to(torch.int32),
            total,
            block_size,
            num_q_heads,
        )

    # ------------------------------------------------------------------ shapes
    @property
    def num_heads(self) -> int:
        return self.kv_num_blocks.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.kv_num_blocks.shape[1]

    @property
    def device(self) -> torch.device:
        return self.kv_num_blocks.device

    def to(self, device: torch.device | str) -> BlockLayout:
        return BlockLayout(
            self.kv_num_blocks.to(device),
            self.kv_indices.to(device),
            self.cu_seqlens.to(device),
            self.seq_len,
            self.block_size,
            self.num_q_heads,
        )

    def check_compatible(self, q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
        """Raise ``ValueError`` if this layout was built for other shapes or another pack (the
        pack's offsets are compared where that needs no host sync: both on the host, or under
        ``SPARSEBALANCE_DEBUG_CHECKS=1``)."""
        if q.shape[0] != self.seq_len:
            raise ValueError(f"layout was built for T={self.seq_len}, q has T={q.shape[0]}")
        if q.shape[1] != self.num_q_heads:
            raise ValueError(
                f"layout was built for Hq={self.num_q_heads}, q has {q.shape[1]} heads"
            )
        if self.num_heads % k.shape[1] != 0:
            raise ValueError(
                f"layout has {self.num_heads} heads, not a multiple of Hkv={k.shape[1]}: "
                "a layout head would span several KV heads"
            )
        if cu_seqlens.shape != self.cu_seqlens.shape:
            raise ValueError("layout was built for another cu_seqlens (another pack of documents)")
        on_host = cu_seqlens.device.type == "cpu" and self.cu_seqlens.device.type == "cpu"
        if cu_seqlens is self.cu_seqlens or not (on_host or debug_checks()):
            return
        if not torch.equal(cu_seqlens.detach().cpu().long(), self.cu_seqlens.detach().cpu().long()):
            raise ValueError("layout was built for another cu_seqlens (another pack of documents)")

    # ------------------------------------------------------------------ views
    def to_block_mask(self) -> torch.Tensor:
        """Bool ``(H_layout, nb, nb)``: True where the (query block, key block) pair is computed."""
        h, nb, max_kv = self.kv_indices.shape
        slot = torch.arange(max_kv, device=self.device)
        valid = slot < self.kv_num_blocks[..., None]
        out = torch.zeros(h, nb, nb, dtype=torch.int32, device=self.device)
        out.scatter_add_(-1, self.kv_indices.long(), valid.to(torch.int32))
        return out > 0

    def to_mask(self, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """Bool ``(Hq, T, T)``: exactly the (query, key) token pairs computed.

        The block pairs of the layout intersected with the document-causal token mask.
        Memory is ``Hq * T^2`` bytes: meant for tests and checks at small T.
        """
        cu = self.cu_seqlens if cu_seqlens is None else cu_seqlens
        check_cu_seqlens(cu, self.seq_len)
        bm = self.to_block_mask().repeat_interleave(self.num_q_heads // self.num_heads, dim=0)
        tok_block = torch.arange(self.seq_len, device=self.device) // self.block_size
        tokens = bm[:, tok_block][:, :, tok_block]
        return tokens & token_mask(cu.to(self.device), self.seq_len)[None]

    # ------------------------------------------------------------------ densities
    def _kept_causal(self) -> tuple[torch.Tensor, torch.Tensor]:
        causal = causal_block_mask(self.cu_seqlens.to(self.device), self.seq_len, self.block_size)
        return self.to_block_mask() & causal[None], causal

    def density(self) -> float:
        """Fraction of doc-causal (query block, key block) pairs kept, over all layout heads."""
        return float(self.density_tensor())

    def density_tensor(self) -> torch.Tensor:
        """:meth:`density` as a float64 0-dim tensor on the layout's device (no host sync)."""
        kept, causal = self._kept_causal()
        return kept.sum().double() / (causal.sum().double() * self.num_heads)

    def head_density(self) -> torch.Tensor:
        """float64 ``(H_layout,)``: density per layout head."""
        kept, causal = self._kept_causal()
        return kept.sum((1, 2)).double() / float(causal.sum())

    def document_density(self) -> torch.Tensor:
        """float64 ``(N,)``: density per document (averaged over heads).

        Document d owns the block pairs (qb, kb), kb <= qb, with both blocks touching d; a block
        shared by two documents counts for both.
        """
        return document_density(
            self.to_block_mask(), self.cu_seqlens, self.block_size, self.seq_len
        )

    def num_kept_pairs(self) -> int:
        """Kept doc-causal block pairs summed over layout heads (the work the op does)."""
        return int(self._kept_causal()[0].sum())


def random_layout(
    cu_seqlens: torch.Tensor,
    num_heads: int,
    block_size: int,
    density: float | list[float] | torch.Tensor,
    seed: int = 0,
    shape: str = "threshold",
) -> BlockLayout:
    """A layout with a chosen density per document (for benchmarks and latency profiling).

    ``shape="threshold"``: each query block keeps ``max(1, round(d * causal blocks))`` key blocks
    (rows grow with the query's position, as a mass threshold keeps them). ``shape="top-k"``:
    each query block keeps ``min(causal blocks, W)`` with one ``W`` per document, the smallest
    whose top-k density reaches ``d`` (rows of equal width once past ``W``, as top-k keeps them;
    the realized density is :func:`~sparsebalance.ops.topk_density` of that ``W`` minus the two
    anchors). Kept: the diagonal, the document's first block, then random causal blocks; ``d``
    is the density of the document that holds the block's last token (``density`` is one float
    or one value per document).
    """
    if shape not in ("threshold", "top-k"):
        raise ValueError(f"shape must be 'threshold' or 'top-k', got {shape!r}")
    check_cu_seqlens(cu_seqlens)
    total = int(cu_seqlens[-1])
    nb = num_blocks(total, block_size)
    cu = cu_seqlens.to("cpu", torch.int64)
    dens = torch.as_tensor(density, dtype=torch.float64).reshape(-1)
    if dens.numel() == 1:
        dens = dens.expand(cu.numel() - 1)
    if dens.numel() != cu.numel() - 1 or not bool(((dens > 0) & (dens <= 1)).all()):
        raise ValueError("density must be one value or one per document, each in (0, 1]")
    qb = torch.arange(nb)
    last_tok = torch.clamp((qb + 1) * block_size, max=total) - 1
    doc = torch.searchsorted(cu[1:], last_tok, right=True)
    prio = torch.rand(num_heads, nb, nb, generator=torch.Generator().manual_seed(seed))
    if shape == "top-k":
        width = topk_width(torch.diff(cu), dens, block_size)[doc]
        return layout_from_priorities(prio, cu, block_size, None, width)
    return layout_from_priorities(prio, cu, block_size, dens[doc])


def topk_width(lengths: torch.Tensor, density: torch.Tensor, block_size: int) -> torch.Tensor:
    """int64: per document, the smallest row width ``W`` (kept blocks per query block, anchors
    included) whose top-k density on a document of ``lengths`` tokens reaches ``density``."""
    from .budget import topk_for_density

    k = topk_for_density(lengths.double().numpy(), density.double().numpy(), block_size, 0)
    return torch.from_numpy(np.maximum(np.ceil(k - 1e-9), 1)).long()


def layout_from_priorities(
    prio: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_size: int,
    density: float | torch.Tensor | None,
    width: torch.Tensor | None = None,
) -> BlockLayout:
    """Keep, per (head, query block), the ``max(1, round(d * causal blocks))`` causal key blocks
    of highest priority (or ``min(causal blocks, width)``), always including the diagonal and
    the document's first block.

    Args:
        prio: float ``(H, nb, nb)`` priority of each (query block, key block); modified in place.
        cu_seqlens: ``(N + 1,)`` document offsets.
        block_size: tokens per block.
        density: ``d``, one value or ``(nb,)`` per query block, in (0, 1]; or None with
        width: int ``(nb,)`` kept blocks per query block (capped at its causal blocks).
    """
    cu = cu_seqlens.to("cpu", torch.int64)
    lo = causal_block_range(cu, int(cu[-1]), block_size)
    qb = torch.arange(prio.shape[1])
    prio[:, qb, qb] = 3.0
    prio[:, qb, lo] = torch.maximum(prio[:, qb, lo], prio.new_tensor(2.0))
    causal = (qb[None, :] >= lo[:, None]) & (qb[None, :] <= qb[:, None])
    prio = prio.masked_fill(~causal[None], -1.0)
    if width is not None:
        n_keep = torch.minimum(causal.sum(-1), width.clamp_min(1))
    else:
        n_keep = torch.clamp(torch.round(density * causal.sum(-1)), min=1).long()
    rank = prio.argsort(-1, descending=True).argsort(-1)
    keep = (rank < n_keep[None, :, None]) & causal[None]
    return BlockLayout.from_block_mask(keep, cu.to(torch.int32), block_size, prio.shape[0])
