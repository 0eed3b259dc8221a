"""How a rank takes part in a CP unit: the pass schedule, and its shard of the unit's pack.

Schedule (:func:`pass_schedule`): every rank runs its units (``plan.execution()``) in slot order.
A unit's ranks must reach it in the same forward/backward *pass*: FSDP2 all-gathers parameters
in every pass on all ranks, so a rank that reached a unit one pass earlier than a partner would
wait in the ring while the partner waits in an all-gather. Units are therefore given rounds:
in slot order, a unit runs at the first round after the last round of each of its ranks; a rank
with nothing at a round runs a zero-weight filler there (under FSDP2; other modes skip the gaps).
A plan without CP units gets rounds ``0 .. n_r - 1`` on rank r: today's passes.

Shard (:func:`shard_batch`): the unit's documents are packed in the *global* token order (labels
shifted there, so a token's label may sit on another rank's shard; positions are global, so
RoPE is right), then each rank keeps its striped blocks (``make_placement("striped", T, B, k)``,
placement rank = position in ``unit.ranks``). Padding (the last blocks up to ``k`` equal shards)
has token 0, position 0, no label and weight 0: it adds exactly nothing to loss or gradients.
The loss over local tokens is scaled like every micro-batch's (``world / global weight``), so the
summed gradients are the global token mean.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..batching import Unit
from ..data.packing import IGNORE, PackedBatch, pack
from ..models.attention import RingContext
from ..parallel import Placement, RankList, make_placement
from ..parallel.groups import RingGroups


def pass_schedule(units: Sequence[Unit], rank_units: Sequence[Sequence[int]]) -> tuple[tuple[int | None, ...], ...]:
    """Per rank, the unit index run at each round (``None``: a gap), all of one length.

    Args:
        units / rank_units: ``plan.execution()``.
    Returns:
        ``(R, rounds)``: ``out[r][i]`` is the unit rank r runs at round i, or None.
    """
    at: dict[int, int] = {}
    free = [0] * len(rank_units)
    for u in sorted({u for order in rank_units for u in order}, key=lambda u: units[u].slot):
        ranks = units[u].ranks
        at[u] = max(free[r] for r in ranks)
        for r in ranks:
            free[r] = at[u] + 1
    rounds = max(free, default=0)
    out = []
    for order in rank_units:
        row: list[int | None] = [None] * rounds
        for u in order:
            row[at[u]] = u
        out.append(tuple(row))
    return tuple(out)


def unit_placement(unit: Unit, block_size: int) -> Placement:
    """The striped placement of a CP unit's pack over its ranks."""
    return make_placement("striped", unit.num_tokens, block_size, unit.degree)


def shard_batch(batch: PackedBatch, placement: Placement, position: int) -> PackedBatch:
    """Placement rank ``position``'s shard of a packed batch (see the module docstring).

    Args:
        batch: the unit's whole pack, tensors ``(1, T)`` (labels already shifted globally).
        placement: a placement of the T tokens; position: this rank's place in it.
    Returns:
        A :class:`PackedBatch` of ``(1, Tl)`` tensors (``Tl = placement.local_len``) whose
        ``cu_seqlens`` is still the *global* pack's (what selection and the ring read).
    """
    if batch.input_ids.shape[1] != placement.seq_len:
        raise ValueError(f"the pack has {batch.input_ids.shape[1]} tokens, the placement {placement.seq_len}")
    dev = batch.input_ids.device
    idx = placement.token_index(position).to(dev)
    real = idx < placement.seq_len
    src = idx[real]

    def take(x: torch.Tensor, fill) -> torch.Tensor:
        out = torch.full((idx.numel(),), fill, dtype=x.dtype, device=dev)
        out[real] = x[0, src]
        return out[None]

    return PackedBatch(
        take(batch.input_ids, 0),
        take(batch.labels, IGNORE),
        take(batch.position_ids, 0),
        batch.cu_seqlens,
        take(batch.loss_weights, 0.0),
    )


def unit_batch(
    unit: Unit,
    rank: int,
    docs: Sequence[np.ndarray],
    block_size: int,
    device: torch.device,
    per_doc_weighting: bool = False,
    ring_groups: RingGroups | None = None,
) -> tuple[PackedBatch, RingContext]:
    """Rank ``rank``'s shard of CP unit ``unit`` and the attention's ring context.

    Args:
        docs: token ids of every corpus document (indexed by sample id).
        ring_groups: the process groups the unit's rings talk on (created once per topology);
            None: the default group.
    """
    if rank not in unit.ranks:
        raise ValueError(f"rank {rank} is not in the unit's ranks {list(unit.ranks)}")
    tokens = [docs[i][o : o + n] for i, o, n in zip(unit.sample_ids, unit.offsets, unit.lengths, strict=True)]
    whole = pack(tokens, device, per_doc_weighting)
    placement = unit_placement(unit, block_size)
    ring = RingContext(RankList(unit.ranks, ring_groups), placement, unit.ring, unit.inner_size)
    return shard_batch(whole, placement, unit.ranks.index(rank)), ring
