"""What each attention layer of a micro-batch did (its budget and densities), kept on the device
during the step and read back once, at its end, for all layers of the micro-batch together."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops import BlockLayout, Budget
from ..ops.pack_index import DensityIndex


@dataclass
class LayerStats:
    """What one attention layer did in one forward, kept as two small device tensors (two
    reductions of the layout: nothing read back, no ``O(nb^2)`` mask held): reading
    :attr:`density`, :attr:`document_density` or :attr:`budget` syncs, so the trainer reads them
    once, at the step's end, for all layers of a micro-batch at once (:func:`read_stats`). A
    layer that kept every document whole (:meth:`whole`) holds no tensor at all: its densities
    are 1, known on the host.

    The layout's pairs are doc-causal (as every selection makes them), so a document's kept
    pairs are its query blocks' row counts plus, where it starts inside a block it shares with
    the document before, that block's diagonal (:class:`~sparsebalance.ops.pack_index.
    DensityIndex`, the one part of the pack the statistics keep)."""

    layer: int
    budget_rule: Budget
    """The budget the layer ran with (a ``floor`` is DST's device decision, read at the end)."""
    rows: torch.Tensor | None
    """int64 ``(nb,)``: kept pairs of every query block, summed over layout heads; None: every
    causal pair (the layer ran every document whole)."""
    diagonal: torch.Tensor | None
    """int64 ``(nb,)``: kept diagonal pairs of every block, summed over layout heads; None where
    the budget keeps every diagonal (a local anchor): the heads, known on the host."""
    owners: DensityIndex | None
    heads: int
    """Layout heads the counts sum over."""
    num_docs: int

    @classmethod
    def of(cls, layer: int, budget: Budget, layout: BlockLayout) -> LayerStats:
        mask = layout.block_mask
        rows = mask.sum((0, 2))
        diagonal = None if budget.local_blocks else mask.diagonal(dim1=1, dim2=2).sum(0)
        pack = layout.pack
        return cls(layer, budget, rows, diagonal, pack.density_index(), mask.shape[0], pack.num_docs)

    @classmethod
    def whole(cls, layer: int, budget: Budget, num_docs: int, heads: int) -> LayerStats:
        """A layer that kept every causal pair of its ``num_docs`` documents: nothing on the
        device (no mask, no reduction)."""
        return cls(layer, budget, None, None, None, heads, num_docs)

    @property
    def budget_value(self) -> float | torch.Tensor:
        """The knob value the layer ran with (k or gamma); ``max(value, floor)`` where DST
        decided a floor on the device (a 0-dim tensor then, read with the statistics)."""
        b = self.budget_rule
        if b.floor is None:
            return b.value
        return torch.clamp(b.floor.reshape(()).double(), min=b.value)

    @property
    def budget(self) -> float:
        return float(self.budget_value)

    @property
    def density(self) -> float:
        return read_stats([self])[2][0]

    @property
    def document_density(self) -> list[float]:
        return read_stats([self])[1][0]


def _diagonal(s: LayerStats) -> torch.Tensor:
    return s.rows.new_full(s.rows.shape, s.heads) if s.diagonal is None else s.diagonal


def read_stats(
    stats: list[LayerStats], *extra: torch.Tensor
) -> tuple[list[float], list[list[float]], list[float], list[float]]:
    """``(budgets (L,), per-document densities (L, N), pack densities (L,), extra)`` of one
    micro-batch's layers, read back together with the 0-dim tensors ``extra`` (its loss, say) in
    one host read (none when nothing lives on the device); call after the step's synchronize."""
    counted = [s for s in stats if s.rows is not None]
    parts = []
    if counted:
        heads = torch.tensor([s.heads for s in counted], dtype=torch.float64)
        counts = torch.stack([t for s in counted for t in (s.rows, _diagonal(s))])  # (2 L', nb)
        densities = counted[0].owners.densities(counts[0::2], counts[1::2])  # (L', N + 1)
        parts.append(densities.flatten())
    floors = [s.budget_value for s in stats]
    parts += [x.reshape(1) for x in floors if isinstance(x, torch.Tensor)]
    parts += [x.reshape(1).to(torch.float64) for x in extra]
    host = torch.cat([x.to(torch.float64) for x in parts]).cpu().tolist() if parts else []  # the read
    read = iter(host)
    tables = {}
    if counted:
        n = counted[0].num_docs
        for s, h in zip(counted, heads.tolist(), strict=True):
            tables[id(s)] = [next(read) / h for _ in range(n + 1)]
    budgets = [next(read) if isinstance(x, torch.Tensor) else float(x) for x in floors]
    docs, dens = [], []
    for s in stats:
        row = tables.get(id(s), [1.0] * (s.num_docs + 1))
        docs.append(row[:-1])
        dens.append(row[-1])
    return budgets, docs, dens, list(read)
