"""``PackIndex``: what one packed micro-batch's shape is, known on the host, indexed on the device.

Everything the attention layers of a micro-batch need about *where* its documents and blocks
are, and nothing about their content: document lengths (host), ``cu_seqlens`` (device), the
segments (block ∩ document) selection pools and scores, the documents batched by segment count,
the doc-causal block range of every query block. It is built once per micro-batch, before the
forward, from the lengths the caller already holds on the host; every layer reuses it. So no
layer reads a shape back from the device (no host sync, no ``nonzero`` or ``.item()``), and
the per-pack index work is done once, not once per layer.

Sizes are ``O(T / B + N)`` (segments) and ``O(nb)`` (blocks) on the device; the batched score
indices are ``O(sum_d s_d^2)``, the size of the scores themselves.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from ..transfer import upload, upload_many
from .varlen import check_cu_seqlens, debug_checks


def num_blocks(total: int, block_size: int) -> int:
    return (total + block_size - 1) // block_size


@dataclass(frozen=True)
class ScoreBatch:
    """Documents with similar segment counts, scored together (padded to ``s`` segments)."""

    docs: torch.Tensor
    """int64 ``(n,)``: the pack's index of each document."""
    seg: torch.Tensor
    """int64 ``(n, s)``: segment id of each slot (padding repeats the document's first)."""
    real: torch.Tensor
    """bool ``(n, s)``: the slot holds a real segment."""
    seg_block: torch.Tensor
    """int64 ``(n, s)``: block of each slot's segment."""
    pair_index: torch.Tensor
    """int64 ``(n, s, s)``: flat ``query block * nb + key block`` of each segment pair."""
    n: int
    s: int


@dataclass(frozen=True, eq=False)
class DensityIndex:
    """Which document owns which counted block pairs of a pack (layer statistics read them):
    a document owns the rows of the query blocks whose first token it holds (their causal key
    blocks all touch it) and, where it starts inside a block it shares with the document
    before, that block's diagonal pair, so its pairs are those with both blocks touching it
    (:func:`~.layout.document_density`). Small (``O(nb + N)``): statistics keep it, not the
    pack."""

    num_docs: int
    owner: torch.Tensor
    """int64 ``(nb,)``: the document holding each block's first token."""
    shared_blocks: torch.Tensor
    """int64 ``(K,)``: first blocks of the documents that start inside them."""
    shared_docs: torch.Tensor
    """int64 ``(K,)``: those documents."""
    pairs: torch.Tensor
    """float64 ``(N + 1,)``: causal block pairs of every document, then of the pack."""

    def densities(self, rows: torch.Tensor, diagonal: torch.Tensor) -> torch.Tensor:
        """float64 ``(L, N + 1)``: kept pairs over causal pairs per document, then the pack's,
        from per-layer counts ``rows`` and ``diagonal`` ``(L, nb)`` (kept pairs of every query
        block, of every diagonal block, summed over layout heads: divide by them)."""
        rows, diagonal = rows.to(torch.float64), diagonal.to(torch.float64)
        kept = rows.new_zeros(rows.shape[0], self.num_docs + 1)
        kept.index_add_(1, self.owner, rows)  # integer counts: exact in any order
        kept.index_add_(1, self.shared_docs, diagonal[:, self.shared_blocks])
        kept[:, self.num_docs] = rows.sum(1)
        return kept / self.pairs


@dataclass(frozen=True, eq=False)
class PackIndex:
    """One pack's documents and blocks (see the module docstring). Build with :meth:`build`."""

    lengths: tuple[int, ...]
    """Tokens of every document, in pack order (host)."""
    cu_seqlens: torch.Tensor
    """int32 ``(N + 1,)`` document offsets on the pack's device."""
    block_size: int

    # the memo is an attribute, not a dataclass field: FSDP2 walks the fields of every dataclass
    # a forward receives (PackedAttention -> its pack), and memoised tables point back here
    def __post_init__(self) -> None:
        object.__setattr__(self, "_memo", {})

    @classmethod
    def build(
        cls,
        cu_seqlens: torch.Tensor,
        block_size: int,
        lengths: tuple[int, ...] | list[int] | np.ndarray | None = None,
    ) -> PackIndex:
        """The index of the pack ``cu_seqlens`` (int32 ``(N + 1,)``); ``lengths``: its document
        lengths if the caller has them on the host (else read from ``cu_seqlens``: one host sync
        when it lives on a device, so the training paths pass them). Given lengths are checked
        on the host; that they are ``cu_seqlens``' only under :func:`~.varlen.debug_checks` (a
        read of the offsets, wherever they live: the training paths build both from the same
        documents, and a CPU run does what a CUDA run does)."""
        check_cu_seqlens(cu_seqlens, values=None if lengths is None else debug_checks())
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if lengths is None:
            lengths = np.diff(cu_seqlens.detach().to("cpu", torch.int64).numpy())
        lengths = tuple(int(n) for n in lengths)
        if len(lengths) != cu_seqlens.numel() - 1 or min(lengths) < 1:
            raise ValueError(
                f"lengths must give {cu_seqlens.numel() - 1} documents of >= 1 token, "
                f"got {len(lengths)} (min {min(lengths, default=0)})"
            )
        if debug_checks():
            offsets = cu_seqlens.detach().to("cpu", torch.int64).numpy()
            if not np.array_equal(np.diff(offsets), lengths):
                raise ValueError(
                    f"lengths {list(lengths)[:8]}... do not match cu_seqlens "
                    f"{offsets.tolist()[:9]}...: the host's and the device's packs differ"
                )
        return cls(lengths, cu_seqlens.to(torch.int32), block_size)

    # ------------------------------------------------------------------ host facts
    @property
    def device(self) -> torch.device:
        return self.cu_seqlens.device

    @property
    def num_docs(self) -> int:
        return len(self.lengths)

    @functools.cached_property
    def offsets(self) -> np.ndarray:
        """int64 ``(N + 1,)`` on the host."""
        return np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)])

    @property
    def seq_len(self) -> int:
        return int(self.offsets[-1])

    @property
    def num_blocks(self) -> int:
        return num_blocks(self.seq_len, self.block_size)

    @functools.cached_property
    def doc_blocks(self) -> tuple[np.ndarray, np.ndarray]:
        """int64 ``(N,)`` first and last block every document touches (host)."""
        off, bs = self.offsets, self.block_size
        return off[:-1] // bs, (off[1:] - 1) // bs

    @functools.cached_property
    def doc_segments(self) -> np.ndarray:
        """int64 ``(N,)``: segments (blocks touched) of every document (host)."""
        first, last = self.doc_blocks
        return last - first + 1

    def doc_block_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 ``(N,)`` device: every document's first block and one past its last block."""
        first, last = self.doc_blocks
        return self.memo("doc_block_bounds", lambda: (self.upload(first), self.upload(last + 1)))

    def to(self, device: torch.device | str) -> PackIndex:
        """The same pack with its device tensors on ``device`` (host facts shared; its tables
        are built there when first asked for). From the host the offsets are uploaded from the
        host's own copy (pinned, non-blocking: a pageable copy to CUDA would wait for the
        stream)."""
        device = torch.device(device)
        if device == self.device:
            return self

        def build() -> PackIndex:
            if self.device.type == "cpu":
                cu = upload(self.offsets, device, torch.int32)
            else:
                cu = self.cu_seqlens.to(device, non_blocking=True)
            return PackIndex(self.lengths, cu, self.block_size)

        return self.memo(("to", device), build)

    def upload(self, array: np.ndarray, dtype=torch.int64) -> torch.Tensor:
        """``array`` on the pack's device: a copy to the device, never a read back. On CUDA from
        pinned memory, so the copy is queued on the stream without waiting for it (a copy from
        pageable memory would wait for the kernels before it)."""
        return upload(array, self.device, dtype)

    def memo(self, key, build):
        """``build()`` once per key for this pack (derived device tensors, kernel indices)."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    # ------------------------------------------------------------------ segments
    @functools.cached_property
    def _host_segments(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(start, length, block, document) of every segment, in token order (host int64)."""
        total, bs = self.seq_len, self.block_size
        start = np.union1d(np.arange(0, total, bs), self.offsets[:-1])
        length = np.diff(np.append(start, total))
        doc = np.searchsorted(self.offsets[1:], start, side="right")
        return start, length, start // bs, doc

    def segments(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """int64 ``(S,)`` device tensors: start token, length, block and document of every
        segment (block ∩ document), in token order."""
        return self.memo("segments", lambda: tuple(self.upload(a) for a in self._host_segments))

    @property
    def num_segments(self) -> int:
        return int(self._host_segments[0].size)

    def pool_plan(self) -> dict:
        """How :func:`~.select.pool_segments` sums tokens into segments without a scatter:
        whole blocks by a reshape, the few blocks a document start splits (and the pack's
        short last block) by prefix sums inside the block.

        Keys: ``nfull`` (host: blocks of ``B`` tokens at the pack's start); ``whole_idx``,
        ``whole_block`` int64 ``(S_w,)``: the segments that are whole blocks and their blocks;
        ``split_idx``, ``lo``, ``hi`` int64 ``(S_s,)``: the other segments and, as flat
        positions ``k * B + offset`` into the split blocks' prefix sums, the token before their
        start (``-1``: none) and their last token; ``tok`` int64 ``(K, B)``: the split blocks'
        tokens (clamped to ``T - 1``: a prefix sum never reads past its segment's end).
        """

        def build():
            start, length, block, _ = self._host_segments
            bs, total = self.block_size, self.seq_len
            whole = (length == bs) & (start % bs == 0)
            split = np.unique(block[~whole])
            pos = np.searchsorted(split, block[~whole])
            off = start[~whole] % bs
            lo = np.where(off == 0, -1, pos * bs + off - 1)
            hi = pos * bs + off + length[~whole] - 1
            tok = np.minimum(split[:, None] * bs + np.arange(bs)[None, :], total - 1)
            up = self.upload
            return {
                "nfull": total // bs,
                "whole_idx": up(np.flatnonzero(whole)),
                "whole_block": up(block[whole]),
                "split_idx": up(np.flatnonzero(~whole)),
                "lo": up(lo),
                "hi": up(hi),
                "tok": up(tok),
            }

        return self.memo("pool", build)

    def seg_of_token(self) -> torch.Tensor:
        """int64 ``(T,)``: each token's segment (tests and the context-parallel path)."""

        def build():
            start = self._host_segments[0]
            return self.upload(np.searchsorted(start, np.arange(self.seq_len), side="right") - 1)

        return self.memo("seg_of_token", build)

    def score_batches(self) -> tuple[ScoreBatch, ...]:
        """The documents grouped by the power of two of their segment count (similar sizes
        share one padded batch, so scoring costs ``O(sum_d s_d^2)``, not ``N max_d s_d^2``)."""

        def build():
            _, _, block, doc = self._host_segments
            nb = self.num_blocks
            first = np.searchsorted(doc, np.arange(self.num_docs))
            count = np.diff(np.append(first, doc.size))
            group = np.floor(np.log2(count)).astype(np.int64)
            out = []
            for g in np.unique(group):
                docs = np.flatnonzero(group == g)
                s = int(count[docs].max())
                slot = np.arange(s)
                real = slot[None, :] < count[docs, None]
                seg = np.where(real, first[docs, None] + slot, first[docs, None])
                sb = block[seg]
                pair = sb[:, :, None] * nb + sb[:, None, :]
                out.append(
                    ScoreBatch(
                        self.upload(docs),
                        self.upload(seg),
                        self.upload(real, torch.bool),
                        self.upload(sb),
                        self.upload(pair),
                        int(docs.size),
                        s,
                    )
                )
            return tuple(out)

        return self.memo("score_batches", build)

    # ------------------------------------------------------------------ blocks
    def causal_lo(self) -> torch.Tensor:
        """int64 ``(nb,)`` device: the lowest key block query block ``qb`` may see (the document
        start of its first token): its doc-causal key blocks are ``[lo, qb]``."""

        def build():
            first_tok = np.arange(self.num_blocks) * self.block_size
            doc = np.searchsorted(self.offsets[1:], first_tok, side="right")
            return self.upload(self.offsets[doc] // self.block_size)

        return self.memo("causal_lo", build)

    def density_index(self) -> DensityIndex:
        """What :meth:`DensityIndex.densities` needs of this pack (``O(nb + N)``, once)."""

        def build():
            nb, n = self.num_blocks, self.num_docs
            first, last = self.doc_blocks
            owner = np.searchsorted(self.offsets[1:], np.arange(nb) * self.block_size, side="right")
            blocks = (last - first + 1).astype(np.float64)
            shared = np.flatnonzero(self.offsets[:-1] % self.block_size != 0)
            lo = self.offsets[owner] // self.block_size
            pairs = np.append(blocks * (blocks + 1) / 2, float(np.sum(np.arange(nb) - lo + 1)))
            owner_d, shared_d, first_d, pairs_d = upload_many([owner, shared, first[shared], pairs], self.device)
            return DensityIndex(n, owner_d, first_d, shared_d, pairs_d)

        return self.memo("density_index", build)

    def causal_block_mask(self) -> torch.Tensor:
        """Bool ``(nb, nb)`` device: the doc-causal block pairs."""
        lo = self.causal_lo()
        kb = torch.arange(lo.numel(), device=lo.device)
        return (kb[None, :] >= lo[:, None]) & (kb[None, :] <= kb[:, None])

    def documents_block_mask(self, docs: tuple[bool, ...]) -> torch.Tensor:
        """Bool ``(nb, nb)`` device: the causal block pairs of the documents marked in ``docs``
        (query block ``qb`` touched by such a document keeps key blocks from the first block of
        the earliest one through ``qb``): what a document kept whole needs."""

        def build():
            nb = self.num_blocks
            first, last = self.doc_blocks
            lo = np.full(nb, nb, dtype=np.int64)
            for d in np.flatnonzero(np.asarray(docs))[::-1]:  # the earliest document wins
                lo[first[d] : last[d] + 1] = first[d]
            lo_t = self.upload(lo)
            kb = torch.arange(nb, device=lo_t.device)
            return (kb[None, :] >= lo_t[:, None]) & (kb[None, :] <= kb[:, None])

        return self.memo(("documents_block_mask", docs), build)

    def dense_runs(self, dense_docs: tuple[bool, ...]) -> tuple[tuple[int, int, int, int], ...]:
        """Maximal runs of consecutive dense documents: ``(first doc, end doc, first token,
        end token)`` each, ends exclusive (host)."""
        runs, d, off = [], 0, self.offsets
        while d < self.num_docs:
            if not dense_docs[d]:
                d += 1
                continue
            e = d
            while e < self.num_docs and dense_docs[e]:
                e += 1
            runs.append((d, e, int(off[d]), int(off[e])))
            d = e
        return tuple(runs)

    def dense_tokens(self, runs) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        """The tokens of the documents in ``runs`` (:meth:`dense_runs`) gathered into one pack:
        int64 ``(T_d,)`` device token indices, int32 ``(n + 1,)`` device offsets of the gathered
        documents, and their lengths (host)."""

        def build():
            docs = [d for d0, d1, _, _ in runs for d in range(d0, d1)]
            lengths = tuple(self.lengths[d] for d in docs)
            idx = np.concatenate([np.arange(t0, t1) for _, _, t0, t1 in runs])
            cu = np.concatenate([[0], np.cumsum(lengths)])
            return self.upload(idx), self.upload(cu, torch.int32), lengths

        return self.memo(("dense_tokens", runs), build)
