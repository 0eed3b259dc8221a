"""``BlockLayout``: which (query block, key block) pairs the sparse attention computes.

Blocks are ``block_size`` consecutive tokens of the packed buffer (documents need not start on a
block boundary). For a query block ``qb`` the doc-causal key blocks always form the contiguous range
``[doc_start(first token of qb) // B, qb]``: token i sees keys ``[doc_start_i, i]`` and those
intervals chain without gaps inside the block.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from .pack_index import PackIndex, num_blocks
from .varlen import check_cu_seqlens, debug_checks, token_mask


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
    out = torch.zeros(*block_mask.shape[:-1], width + 1, dtype=torch.int32, device=block_mask.device)
    out.scatter_(-1, slot, kb.expand(block_mask.shape))
    return counts, out[..., :width].contiguous()


def document_density(block_mask: torch.Tensor, pack: PackIndex) -> torch.Tensor:
    """float64 ``(N,)``: per-document density of a bool ``(H, nb, nb)`` block mask of ``pack``
    (see :meth:`BlockLayout.document_density`); device work only."""
    pack = pack.to(block_mask.device)
    causal = pack.causal_block_mask()
    kept = (block_mask & causal[None]).sum(0).double()
    # 2-D prefix sums turn each document's square of blocks into four lookups.
    pre = torch.nn.functional.pad(kept.cumsum(0).cumsum(1), (1, 0, 1, 0))
    first, last = pack.doc_block_bounds()
    kept_doc = pre[last, last] - pre[first, last] - pre[last, first] + pre[first, first]
    n = (last - first).double()
    return kept_doc / (n * (n + 1) / 2 * block_mask.shape[0])


@dataclass(frozen=True, eq=False)
class BlockLayout:
    """The (query block, key block) pairs computed, per layout head: one bool block mask.

    The mask is the one form every consumer starts from: selection writes it, the statistics
    read it, and each kernel derives its own index form from it once (flex's kv- and query-side
    lists, the torch backend's sorted rows; :meth:`memo`), reused by the forward, the backward
    and a checkpointed layer's recomputation. ``O(H nb^2)`` bytes, a few MB at 128K tokens.

    A layout has either one head per query head (``num_heads == num_q_heads``) or one per group of
    query heads that share a KV head (``num_heads`` a multiple of ``Hkv`` dividing ``Hq``), in
    which case query head ``h`` uses layout head ``h // (num_q_heads // num_heads)``.
    """

    block_mask: torch.Tensor
    """bool ``(H_layout, nb, nb)``: True where the pair is computed (pairs that are not
    doc-causal are ignored by every backend)."""
    pack: PackIndex
    """The pack the layout was built for (lengths on the host, offsets on the device)."""
    num_q_heads: int
    """Hq of the attention this layout serves."""
    dense_docs: tuple[bool, ...] | None = None
    """Per document, known on the host to keep every causal block (its budget covers it):
    such documents may run through the dense kernel (:mod:`.dense`). None: not known."""

    # the memo is an attribute, not a dataclass field: FSDP2 walks the fields of every dataclass
    # a forward receives (PackedAttention -> its pack), and memoised tables point back here
    def __post_init__(self) -> None:
        object.__setattr__(self, "_memo", {})
        bm = self.block_mask
        if bm.dtype != torch.bool or bm.dim() != 3:
            raise ValueError("block_mask must be a bool tensor (H_layout, nb, nb)")
        nb = self.pack.num_blocks
        if bm.shape[1:] != (nb, nb):
            raise ValueError(
                f"block_mask must be (H, {nb}, {nb}) for T={self.pack.seq_len}, "
                f"block_size={self.block_size}; got {tuple(bm.shape)}"
            )
        if self.num_q_heads % bm.shape[0] != 0:
            raise ValueError(f"layout heads ({bm.shape[0]}) must divide num_q_heads ({self.num_q_heads})")
        if self.dense_docs is not None and len(self.dense_docs) != self.pack.num_docs:
            raise ValueError(f"dense_docs has {len(self.dense_docs)} entries for {self.pack.num_docs} documents")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_block_mask(
        cls,
        block_mask: torch.Tensor,
        cu_seqlens: torch.Tensor,
        block_size: int,
        num_q_heads: int,
        lengths: tuple[int, ...] | None = None,
    ) -> BlockLayout:
        """Build from a bool ``(H_layout, nb, nb)`` block mask (True = compute the pair) for the
        pack ``cu_seqlens`` (``lengths``: its document lengths, if on the host already)."""
        if block_mask.dtype != torch.bool or block_mask.dim() != 3:
            raise ValueError("block_mask must be a bool tensor (H_layout, nb, nb)")
        pack = PackIndex.build(cu_seqlens, block_size, lengths).to(block_mask.device)
        return cls(block_mask, pack, num_q_heads)

    @classmethod
    def full(cls, pack: PackIndex, num_heads: int, num_q_heads: int) -> BlockLayout:
        """Every doc-causal block pair of ``pack`` (exact attention), every document dense;
        ``O(nb^2)`` device work, no selection."""
        causal = pack.causal_block_mask()
        return cls(causal.expand(num_heads, -1, -1), pack, num_q_heads, (True,) * pack.num_docs)

    # ------------------------------------------------------------------ shapes
    @property
    def cu_seqlens(self) -> torch.Tensor:
        """int32 ``(N + 1,)``: the pack the layout was built for."""
        return self.pack.cu_seqlens

    @property
    def seq_len(self) -> int:
        return self.pack.seq_len

    @property
    def block_size(self) -> int:
        return self.pack.block_size

    @property
    def num_heads(self) -> int:
        return self.block_mask.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.block_mask.shape[1]

    @property
    def device(self) -> torch.device:
        return self.block_mask.device

    def to(self, device: torch.device | str) -> BlockLayout:
        device = torch.device(device)
        if device == self.device:
            return self
        return BlockLayout(self.block_mask.to(device), self.pack.to(device), self.num_q_heads, self.dense_docs)

    def memo(self, key, build):
        """``build()`` once per key for this layout: a kernel's index form of the mask, built
        by the first call and reused by the backward and any recomputation."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    @property
    def kv_num_blocks(self) -> torch.Tensor:
        """int32 ``(H_layout, nb)``: key blocks kept per query block."""
        return self._ordered()[0]

    @property
    def kv_indices(self) -> torch.Tensor:
        """int32 ``(H_layout, nb, nb)``: the kept key blocks of each query block, ascending,
        padded with 0 past :attr:`kv_num_blocks`."""
        return self._ordered()[1]

    def _ordered(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.memo("ordered", lambda: dense_to_ordered(self.block_mask, self.num_blocks))

    def check_compatible(self, q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
        """Raise ``ValueError`` if this layout was built for other shapes or another pack (the
        pack's offsets are compared where that needs no host sync: both on the host, or under
        ``SPARSEBALANCE_DEBUG_CHECKS=1``)."""
        if q.shape[0] != self.seq_len:
            raise ValueError(f"layout was built for T={self.seq_len}, q has T={q.shape[0]}")
        if q.shape[1] != self.num_q_heads:
            raise ValueError(f"layout was built for Hq={self.num_q_heads}, q has {q.shape[1]} heads")
        if self.num_heads % k.shape[1] != 0:
            raise ValueError(
                f"layout has {self.num_heads} heads, not a multiple of Hkv={k.shape[1]}: "
                "a layout head would span several KV heads"
            )
        if cu_seqlens.shape != self.cu_seqlens.shape:
            raise ValueError("layout was built for another cu_seqlens (another pack of documents)")
        on_host = cu_seqlens.device.type == "cpu"
        if cu_seqlens is self.cu_seqlens or not (on_host or debug_checks()):
            return
        mine = torch.as_tensor(self.pack.offsets)
        if not torch.equal(cu_seqlens.detach().cpu().long(), mine):
            raise ValueError("layout was built for another cu_seqlens (another pack of documents)")

    # ------------------------------------------------------------------ views
    def to_block_mask(self) -> torch.Tensor:
        """Bool ``(H_layout, nb, nb)``: True where the (query block, key block) pair is computed."""
        return self.block_mask

    def to_mask(self, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """Bool ``(Hq, T, T)``: exactly the (query, key) token pairs computed.

        The block pairs of the layout intersected with the document-causal token mask.
        Memory is ``Hq * T^2`` bytes: meant for tests and checks at small T.
        """
        cu = self.cu_seqlens if cu_seqlens is None else cu_seqlens
        check_cu_seqlens(cu, self.seq_len)
        bm = self.block_mask.repeat_interleave(self.num_q_heads // self.num_heads, dim=0)
        tok_block = torch.arange(self.seq_len, device=self.device) // self.block_size
        tokens = bm[:, tok_block][:, :, tok_block]
        return tokens & token_mask(cu.to(self.device), self.seq_len)[None]

    # ------------------------------------------------------------------ densities
    def _kept_causal(self) -> tuple[torch.Tensor, torch.Tensor]:
        causal = self.pack.causal_block_mask()
        return self.block_mask & causal[None], causal

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
        return kept.sum((1, 2)).double() / causal.sum().double()

    def document_density(self) -> torch.Tensor:
        """float64 ``(N,)``: density per document (averaged over heads).

        Document d owns the block pairs (qb, kb), kb <= qb, with both blocks touching d; a block
        shared by two documents counts for both.
        """
        return document_density(self.block_mask, self.pack)

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
    dense_from: float | None = None,
) -> BlockLayout:
    """A layout with a chosen density per document (for benchmarks and latency profiling).

    ``shape="threshold"``: each query block keeps ``max(1, round(d * causal blocks))`` key blocks
    (rows grow with the query's position, as a mass threshold keeps them). ``shape="top-k"``:
    each query block keeps ``min(causal blocks, W)`` with one ``W`` per document, the smallest
    whose top-k density reaches ``d`` (rows of equal width once past ``W``, as top-k keeps them;
    the realized density is :func:`~sparsebalance.ops.topk_density` of that ``W`` minus the two
    anchors). Kept: the diagonal, the document's first block, then random causal blocks; ``d``
    is the density of the document that holds the block's last token (``density`` is one float
    or one value per document). ``dense_from``: documents of at least that density keep every
    causal block (a run promotes them to the dense kernel, :meth:`Budget.dense_documents`).
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
    if dense_from is not None:
        dens = torch.where(dens >= dense_from, torch.ones_like(dens), dens)
    qb = torch.arange(nb)
    last_tok = torch.clamp((qb + 1) * block_size, max=total) - 1
    doc = torch.searchsorted(cu[1:], last_tok, right=True)
    prio = torch.rand(num_heads, nb, nb, generator=torch.Generator().manual_seed(seed))
    if shape == "top-k":
        width = topk_width(torch.diff(cu), dens, block_size)[doc]
        layout = layout_from_priorities(prio, cu, block_size, None, width)
    else:
        layout = layout_from_priorities(prio, cu, block_size, dens[doc])
    # Documents that kept every causal block run where the trainer would run them: dense.
    full = layout.document_density() >= 1.0 - 1e-12
    return replace(layout, dense_docs=tuple(bool(x) for x in full))


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
