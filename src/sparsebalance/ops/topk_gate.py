"""The MoBA top-k gate of one layer over a whole pack, in a fixed number of device operations.

The same gate and rule as :mod:`.select` (segments = block ∩ document, mean-pooled queries and
keys, the log-length bias, anchors, ``min_blocks``; ties to the earlier segment), scored as one
batch instead of one per group of documents, so a layer launches the same handful of kernels
whatever the number of documents in its pack:

- only the documents the lowest budget a layer may run does not keep whole are scored (the
  rest keep every causal block under any budget: their blocks come from the pack); their
  ``S`` segments form one ``S x S`` problem whose pairs across documents are masked. Such
  documents are longer than the budget, so ``S`` stays within about ``1.5 nb`` (a pack whose
  scored segments exceed ``2 nb`` goes to :mod:`.select`'s per-document batches instead);
- pooling: one within-block prefix sum of ``q`` (and of ``k``), read at every segment's end and
  before its start (one gather), so a segment's sum is exact to the block, in float32;
- scores: one batched product of the pooled sums, the bias and ``scale / (n_i n_j)`` added in
  one pass; one sort per row ranks the candidates (anchors and other documents sort last);
- the rule: which ranks a row keeps depends on the pack and ``k`` only (built once per pack and
  budget on the host), so keeping is one scatter of the sorted order; DST's coverage floor, a
  device scalar, adds three comparisons;
- segments -> blocks: one scatter onto the blocks the pack's whole documents already fill (none
  when the segments are the blocks).

Everything that depends only on the pack is built once per micro-batch (:meth:`GateTables.of`,
memoised on the :class:`~.pack_index.PackIndex`) and uploaded from pinned memory; nothing is
read back. Non-finite input: NaN and ``+inf`` scores rank first, so a non-finite key is kept
by every query segment that keeps any candidate and reaches the output (as with dense
attention) instead of being hidden; the step is then skipped (``docs/reliability.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..transfer import upload_many
from .budget import Budget
from .layout import BlockLayout
from .pack_index import PackIndex


def gate_applies(budget: Budget, share_kv_groups: bool = False) -> bool:
    """Whether :class:`TopKGate` implements ``budget``: top-k without a density cap, one layout
    head per query head (the paper's setting; everything else goes through :mod:`.select`)."""
    return budget.top_k is not None and budget.max_density is None and not share_kv_groups


@dataclass(frozen=True, eq=False)
class GateTables:
    """What one pack's gate needs besides q and k, for one anchor setting and one set of scored
    documents: device tensors built once per micro-batch, on the device from ``O(S)`` uploaded
    vectors (one copy; the ``S x S`` tables never cross from the host)."""

    pack: PackIndex
    rule: Budget
    """The lowest budget the tables serve: its anchors and ``min_blocks`` are every budget's, its
    ``top_k`` the least (:meth:`check`)."""
    num_scored: int
    """``S``: segments of the scored documents."""
    full_blocks: int
    """Blocks of ``B`` tokens from the pack's start (the rest, if any, is one shorter block)."""
    pool_index: torch.Tensor
    """int64 ``(2 S,)``: token rows of the within-block prefix sums at each segment's last
    token, then before its first token (its own last row where it starts its block)."""
    start_sign: torch.Tensor
    """float ``(S, 1, 1)``: -1 where the segment starts inside its block, else 0."""
    inv_lengths: torch.Tensor
    """float ``(S, S)``: ``1 / (n_i n_j)``, the pooled sums' product to the means'."""
    bias_rank: torch.Tensor
    """float ``(S, S)``: the log-length bias at candidate pairs, ``-inf`` elsewhere (anchors,
    pairs across documents, later segments): candidates sort first."""
    bias_mass: torch.Tensor
    """float ``(S, S)``: the bias at every causal pair of a document, ``-inf`` elsewhere: the
    gate's probabilities (coverage)."""
    unscored: torch.Tensor
    """bool ``(S, S)``: pairs a row does not rank (anchors, other documents, later segments)."""
    anchors: torch.Tensor
    """bool ``(S, S)``: the anchor pairs (sink, local), causal."""
    anchor_ranks: torch.Tensor
    """bool ``(S, S)``: the sorted positions of every row's anchors (they sort after its
    candidates, in column order, with the other pairs the row does not score: a stable sort)."""
    slots: torch.Tensor
    """int64 ``(S,)``: 0 .. S-1, a sorted row's positions."""
    extra_min: torch.Tensor
    """int64 ``(S,)``: candidates each row keeps at least (``min_blocks`` minus anchors)."""
    num_candidates: torch.Tensor
    """int64 ``(S,)``: non-anchor causal segments of each row."""
    seg_tokens: np.ndarray
    """int64 ``(S,)`` host: tokens of each scored segment (a row's weight in the coverage)."""
    pair_index: torch.Tensor | None
    """int64 ``(S * S,)``: flat ``query block * nb + key block`` of each pair; None when the
    scored segments are exactly the pack's blocks (the kept pairs are the block mask)."""
    scored: tuple[bool, ...]
    """Per document of the pack: scored (else kept whole under every budget)."""

    # the memo is an attribute, not a dataclass field: FSDP2 walks the fields of every dataclass
    # a forward receives (PackedAttention -> its pack), and memoised tables point back here
    def __post_init__(self) -> None:
        object.__setattr__(self, "_memo", {})

    @classmethod
    def of(cls, pack: PackIndex, lowest: Budget, dense_from: float | None = None) -> GateTables | None:
        """The tables for ``pack`` when no budget below ``lowest`` is used (its anchors and
        ``min_blocks`` are every budget's), memoised on the pack; None when no document is
        scored or their segments exceed ``2 nb + 8`` (many short scored documents: the
        per-document batches of :mod:`.select` hold less). Decided once per pack and budget."""

        def decide() -> GateTables | None:
            scored = tuple(not x for x in lowest.dense_documents(pack, dense_from))
            num = int(pack.doc_segments[np.asarray(scored)].sum())
            if num == 0 or num > 2 * pack.num_blocks + 8:
                return None
            return pack.memo(("topk-gate", lowest, scored), lambda: cls._build(pack, lowest, scored))

        return pack.memo(("topk-gate-for", lowest, dense_from), decide)

    @classmethod
    def _build(cls, pack: PackIndex, rule: Budget, scored: tuple[bool, ...]) -> GateTables:
        start, length, block, doc = pack._host_segments
        sel = np.flatnonzero(np.asarray(scored)[doc])
        start, length, block, doc = start[sel], length[sel], block[sel], doc[sel]
        n, bs, nb = sel.size, pack.block_size, pack.num_blocks
        first = np.searchsorted(doc, doc)  # each row's document's first scored segment
        offset = start - block * bs
        ends = start + length - 1
        host = [
            np.concatenate([ends, np.where(offset > 0, start - 1, ends)]),
            np.where(offset > 0, -1.0, 0.0).astype(np.float32),
            length.astype(np.float32),
            doc,
            block,
            first,
            np.arange(n),
        ]
        pool_index, sign, seg_len, doc_d, block_d, first_d, idx = upload_many(host, pack.device)
        i, j = idx[:, None], idx[None, :]
        allowed = (doc_d[:, None] == doc_d[None, :]) & (j <= i)
        sink = (block_d - block_d[first_d]) < rule.sink_blocks
        anchors = allowed & (sink[None, :] | ((block_d[:, None] - block_d[None, :]) < rule.local_blocks))
        candidate = allowed & ~anchors
        n_cand = candidate.sum(-1)
        # a row's unscored pairs sort after its candidates, in column order (stable sort)
        after = n_cand[:, None] + torch.cumsum(~candidate, dim=1) - 1
        anchor_ranks = torch.zeros(n, n + 1, dtype=torch.bool, device=pack.device)
        anchor_ranks.scatter_(1, torch.where(anchors, after, n), True)  # column n: dropped
        floor_n = torch.clamp(idx - first_d + 1, max=rule.min_blocks)  # causal segments, capped
        log_len = torch.log(seg_len)
        bias = torch.where(i == j, torch.log((seg_len + 1) / 2)[:, None], log_len[None, :])
        identity = n == nb and np.array_equal(block, np.arange(nb))
        pair = None if identity else (block_d[:, None] * nb + block_d[None, :]).reshape(-1)
        return cls(
            pack=pack,
            rule=rule,
            num_scored=n,
            full_blocks=pack.seq_len // bs,
            pool_index=pool_index,
            start_sign=sign[:, None, None],
            inv_lengths=1.0 / (seg_len[:, None] * seg_len[None, :]),
            bias_rank=torch.where(candidate, bias, -math.inf),
            bias_mass=torch.where(allowed, bias, -math.inf),
            unscored=~candidate,
            anchors=anchors,
            anchor_ranks=anchor_ranks[:, :n],
            slots=idx,
            extra_min=torch.clamp(floor_n - anchors.sum(-1), min=0),
            num_candidates=n_cand,
            seg_tokens=length,
            pair_index=pair,
            scored=scored,
        )

    def check(self, budget: Budget, least_k: int | None = None) -> None:
        """Raise ``ValueError`` unless the tables serve ``budget`` (top-k without a cap, the
        tables' anchors and ``min_blocks``, ``k`` at least theirs: ``least_k`` when given)."""
        rule = self.rule
        anchors = (budget.sink_blocks, budget.local_blocks, budget.min_blocks)
        k = budget.top_k if least_k is None else least_k
        if (
            not gate_applies(budget)
            or k < rule.top_k
            or anchors != (rule.sink_blocks, rule.local_blocks, rule.min_blocks)
        ):
            raise ValueError(
                f"the gate's tables were built for budgets from {rule}; {budget} (k from {k}) "
                "is not one of them: build them for the lowest budget a layer may run"
            )

    def memo(self, key, build):
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def kept_ranks(self, top_k: int) -> torch.Tensor:
        """Bool ``(S, S)``: the sorted positions a row keeps under ``top_k``, its anchors'
        included (once per pack and ``k``, on the device)."""

        def build():
            extra = torch.minimum(self.extra_min.clamp(min=top_k), self.num_candidates)
            return self.anchor_ranks | (self.slots[None, :] < extra[:, None])

        return self.memo(("kept", top_k), build)

    def candidate_ranks(self) -> torch.Tensor:
        """Bool ``(S, S)``: sorted positions that hold a candidate."""
        return self.memo("candidates", lambda: self.slots[None, :] < self.num_candidates[:, None])

    def coverage_terms(self, ks: tuple[int, ...], heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For the coverage of every ``k`` of ``ks``: int64 ``(S, K)`` positions of a row's
        cumulative sorted mass at ``k`` candidates (clamped to its candidates) and float
        ``(S, K)`` weights (tokens over the pack's ``T x heads``; 0 where a row keeps none)."""

        def build():
            host = [self.seg_tokens.astype(np.float32), np.asarray(ks, dtype=np.int64)]
            tokens, ks_d = upload_many(host, self.pack.device)
            kept = torch.minimum(ks_d[None, :], self.num_candidates[:, None])
            weight = tokens[:, None] * (kept >= 1) / (self.pack.seq_len * heads)
            return kept.sub(1).clamp(min=0), weight

        return self.memo(("coverage", ks, heads), build)


class TopKGate:
    """One layer's gate scores over its pack (:meth:`score`), turned into layouts and coverages
    for any top-k budget at or above the lowest one the tables were built for."""

    def __init__(self, tables: GateTables, raw: torch.Tensor, scale: float, heads: int) -> None:
        self.tables = tables
        self.pack = tables.pack
        self.raw = raw
        """float ``(Hq, S, S)``: products of the pooled sums (not yet scaled or biased)."""
        self.scale = scale
        self.num_q_heads = heads
        logits = torch.addcmul(tables.bias_rank, raw, self._weights())
        # a NaN in raw survives the bias' -inf: pairs the row does not score sort last anyway
        logits.masked_fill_(tables.unscored, -math.inf)
        self.order = torch.sort(logits, dim=-1, descending=True, stable=True).indices
        self._cums: torch.Tensor | None = None

    @classmethod
    def score(cls, q: torch.Tensor, k: torch.Tensor, tables: GateTables, scale: float) -> TopKGate:
        """The gate of ``q (T, Hq, D)`` and ``k (T, Hkv, D)`` (``Hq % Hkv == 0``) on the pack of
        ``tables``; ``scale``: the softmax scale."""
        hq, hkv = q.shape[1], k.shape[1]
        with torch.no_grad():
            qs = _pooled_sums(q.detach(), tables)  # (Hq, S, D)
            ks = _pooled_sums(k.detach(), tables)  # (Hkv, S, D)
            n = tables.num_scored
            # query heads of a KV group are consecutive: (Hkv, g * S, D) against (Hkv, S, D)
            raw = torch.bmm(qs.view(hkv, (hq // hkv) * n, -1), ks.transpose(1, 2))
        return cls(tables, raw.view(hq, n, n), scale, hq)

    def _weights(self) -> torch.Tensor:
        t = self.tables
        return t.memo(("weights", self.scale), lambda: t.inv_lengths * self.scale)

    # ------------------------------------------------------------------ the rule
    def keep(self, budget: Budget) -> torch.Tensor:
        """Bool ``(Hq, S, S)``: the kept segment pairs (anchors included) under ``budget``
        (a ``floor`` raises ``k`` on the device). Which sorted positions a row keeps is known
        on the host, so keeping is one scatter of the sort's order (three comparisons more for
        a floor). NaN and ``+inf`` scores sort first: a non-finite key is kept by every row
        that keeps a candidate, and reaches the output as with dense attention."""
        t = self.tables
        t.check(budget)
        ranks = t.kept_ranks(int(budget.top_k))
        if budget.floor is not None:  # k = max(top_k, floor): three comparisons on the device
            ranks = ranks | ((t.slots[None, :] < budget.floor) & t.candidate_ranks())
        keep = torch.empty_like(self.order, dtype=torch.bool)
        return keep.scatter_(-1, self.order, ranks.expand_as(keep))

    def layout(self, budget: Budget, dense_from: float | None = None) -> BlockLayout:
        """The :class:`BlockLayout` ``budget`` keeps: the scored documents' kept pairs, every
        causal block of the others and of the documents ``dense_from`` promotes."""
        t, pack = self.tables, self.pack
        dense = budget.dense_documents(pack, dense_from)
        keep = self.keep(budget)
        if t.pair_index is None:
            mask = keep
            if any(dense):
                mask = mask | pack.documents_block_mask(dense)[None]
        else:
            nb, h = pack.num_blocks, keep.shape[0]
            base = pack.memo(
                ("documents_block_u8", dense),
                lambda: pack.documents_block_mask(dense).to(torch.uint8),
            )
            hits = base.expand(h, nb, nb).contiguous().view(h, nb * nb)  # one copy
            hits.scatter_reduce_(1, t.pair_index.expand(h, -1), keep.view(h, -1).view(torch.uint8), "amax")
            mask = hits.view(h, nb, nb).view(torch.bool)
        return BlockLayout(mask, pack, self.num_q_heads, dense)

    # ------------------------------------------------------------------ coverage
    def _sorted_mass_cumsum(self) -> torch.Tensor:
        """float ``(Hq, S, S)``: per row, the cumulative gate probability of its candidates in
        rank order (positions past its candidates are never read); once per layer."""
        if self._cums is None:
            t = self.tables
            prob = torch.softmax(torch.addcmul(t.bias_mass, self.raw, self._weights()), dim=-1)
            self._cums = prob.gather(-1, self.order).cumsum(-1)
        return self._cums

    def candidate_mass(self, ks: tuple[int, ...]) -> torch.Tensor:
        """float32 ``(K,)``: for each ``k`` of ``ks`` (ascending), the gate mass the ``k`` best
        candidates of every row hold, weighted by tokens, over the pack's ``T x Hq``: the
        coverage up to a constant (anchors, documents kept whole). Non-decreasing in ``k``."""
        index, weight = self.tables.coverage_terms(tuple(int(x) for x in ks), self.num_q_heads)
        cums = self._sorted_mass_cumsum()
        kept = cums.gather(-1, index.expand(cums.shape[0], -1, -1))  # (Hq, S, K)
        return (kept * weight).sum((0, 1))

    def coverage_floor(self, budget: Budget, ks, p: float) -> torch.Tensor:
        """int64 ``(1,)`` device: how many of ``ks`` (ascending; the last the base budget) lose
        more than ``p`` of the coverage at the last, i.e. the index in ``ks`` of the smallest
        ``k`` within the bound (``budget``: the anchors, the tables'). No read back."""
        self.tables.check(budget, least_k=int(ks[0]))
        mass = self.candidate_mass(ks)
        return torch.searchsorted(mass, mass[-1:] - p)

    def coverage_curve(self, budget: Budget, ks) -> np.ndarray:
        """float64 ``(K,)``: the pack's coverage of ``budget``'s anchors at every k of ``ks``
        (one read back: the host path)."""
        ks = tuple(int(x) for x in ks)
        self.tables.check(budget, least_k=ks[0])
        t, pack = self.tables, self.pack
        prob = torch.softmax(torch.addcmul(t.bias_mass, self.raw, self._weights()), dim=-1)
        anchor = (prob * t.anchors).sum(-1)  # (Hq, S)
        rows = torch.as_tensor(t.seg_tokens, dtype=prob.dtype, device=prob.device)
        whole = sum(n for n, s in zip(pack.lengths, t.scored, strict=True) if not s)
        const = float((anchor * rows).sum()) / (pack.seq_len * self.num_q_heads)
        const += whole / pack.seq_len
        return const + self.candidate_mass(ks).double().cpu().numpy()

    def coverage(self, budget: Budget) -> float:
        return float(self.coverage_curve(budget, (int(budget.top_k),))[0])

    def keeps_whole(self, budget: Budget) -> bool:
        """Whether ``budget`` keeps every document of the pack whole (host)."""
        return all(budget.dense_documents(self.pack))

    def density(self, budget: Budget) -> float:
        return self.layout(budget).density()

    def document_density(self, budget: Budget) -> torch.Tensor:
        """float64 ``(N,)``: per-document density of :meth:`layout`."""
        return self.layout(budget).document_density()


def _pooled_sums(x: torch.Tensor, t: GateTables) -> torch.Tensor:
    """Sums of ``x (T, H, D)`` over the scored segments, heads first: ``(H, S, D)`` in float32
    (float64 kept). One prefix sum within blocks, one gather of the rows at the segments' ends
    and before their starts, one subtraction (written heads first)."""
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    total, heads, dim = x.shape
    bs, full = t.pack.block_size, t.full_blocks
    prefix = torch.empty(total, heads, dim, dtype=dtype, device=x.device)
    main = full * bs
    if full:
        torch.cumsum(x[:main].view(full, bs, heads, dim), 1, dtype=dtype, out=prefix[:main].view(full, bs, heads, dim))
    if main < total:
        torch.cumsum(x[main:], 0, dtype=dtype, out=prefix[main:])
    rows = prefix.index_select(0, t.pool_index)  # (2 S, H, D)
    n = t.num_scored
    out = torch.empty(heads, n, dim, dtype=dtype, device=x.device)
    torch.addcmul(rows[:n], rows[n:], t.start_sign.to(dtype), out=out.permute(1, 0, 2))
    return out
