"""Token placement across a context-parallel group, and the ring work it implies.

A :class:`Placement` gives each of the ``P`` ranks the same number of whole *blocks* of the packed
buffer (the layout's ``block_size``), so a rank's query blocks and a remote key/value shard are
sets of global blocks and the global :class:`~sparsebalance.ops.BlockLayout` applies unchanged.
The packed length is padded up to ``P * blocks_per_rank * B`` tokens; padded tokens are masked.

- ``contiguous``: rank r holds blocks ``[r n, (r + 1) n)``: the baseline; causal work piles up on
  the last rank.
- ``zigzag``: the blocks are cut into ``2P`` chunks and rank r holds chunks r and ``2P - 1 - r``:
  exact balance for *dense* causal attention over one document (ring-flash-attention's layout).
- ``striped``: round-robin by block, rank r holds blocks ``r, r + P, r + 2P, ...``: every rank
  samples the whole sequence, so any content-dependent sparse pattern (vertical-slash lines,
  dense regions, packed documents) is shared evenly, and diagonal (slash) work is spread over
  all ring steps (MTraining's layout).

:func:`ring_work` counts the kept block pairs each rank computes at each ring step;
:func:`imbalance` summarises it. Both are pure functions of a layout: the simulator and the
``ring-balance`` command use them; nothing here needs a process group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.layout import BlockLayout, causal_block_mask, num_blocks

PLACEMENTS = ("contiguous", "zigzag", "striped")


@dataclass(frozen=True)
class Placement:
    """Which global blocks every rank of a context-parallel group holds."""

    kind: str
    """One of :data:`PLACEMENTS`."""
    seq_len: int
    """T, the packed length before padding."""
    block_size: int
    """B, tokens per block (the layout's block size)."""
    blocks: torch.Tensor
    """int64 ``(P, n)``: global block ids of each rank, in local order. Ids ``>= ceil(T / B)``
    are padding blocks (no query, never attended)."""

    @property
    def world_size(self) -> int:
        return self.blocks.shape[0]

    @property
    def blocks_per_rank(self) -> int:
        return self.blocks.shape[1]

    @property
    def local_len(self) -> int:
        """Tokens per rank (padded): ``blocks_per_rank * B``."""
        return self.blocks_per_rank * self.block_size

    @property
    def num_blocks(self) -> int:
        """Blocks of the unpadded sequence, ``ceil(T / B)`` (the layout's ``nb``)."""
        return num_blocks(self.seq_len, self.block_size)

    def owner(self) -> torch.Tensor:
        """int64 ``(P * n,)``: the rank holding each (padded) global block."""
        own = torch.empty(self.blocks.numel(), dtype=torch.long)
        own[self.blocks.reshape(-1)] = torch.arange(self.world_size).repeat_interleave(self.blocks_per_rank)
        return own

    def token_index(self, rank: int) -> torch.Tensor:
        """int64 ``(local_len,)``: global token position of each local token (``>= T``: pad)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        offs = torch.arange(self.block_size)
        return (self.blocks[rank][:, None] * self.block_size + offs).reshape(-1)

    def permutation(self) -> torch.Tensor:
        """int64 ``(P * local_len,)``: global positions of the concatenated shards of ranks 0..P-1.

        A permutation of the padded positions ``0 .. P * local_len - 1``.
        """
        return torch.cat([self.token_index(r) for r in range(self.world_size)])

    def shard(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """Global ``(T, ...)`` -> this rank's ``(local_len, ...)``; padded tokens are zeros."""
        if x.shape[0] != self.seq_len:
            raise ValueError(f"x has {x.shape[0]} tokens, the placement was built for T={self.seq_len}")
        idx = self.token_index(rank).to(x.device)
        pad = torch.zeros(self.world_size * self.local_len - self.seq_len, *x.shape[1:])
        return torch.cat([x, pad.to(x)])[idx]

    def unshard(self, parts: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Inverse of :meth:`shard`: the ``P`` local ``(local_len, ...)`` -> global ``(T, ...)``."""
        if len(parts) != self.world_size:
            raise ValueError(f"unshard needs {self.world_size} parts, got {len(parts)}")
        flat = torch.cat(list(parts))
        out = torch.empty_like(flat)
        out[self.permutation().to(flat.device)] = flat
        return out[: self.seq_len]


def make_placement(kind: str, seq_len: int, block_size: int, world_size: int) -> Placement:
    """Place ``seq_len`` tokens (blocks of ``block_size``) on ``world_size`` ranks.

    Every rank gets ``n`` blocks: ``ceil(nb / P)`` (``contiguous``, ``striped``) or
    ``2 ceil(nb / 2P)`` (``zigzag``), with ``nb = ceil(T / B)``; the rest is padding.
    """
    if kind not in PLACEMENTS:
        raise ValueError(f"layout must be one of {', '.join(PLACEMENTS)}, got {kind!r}")
    for name, value in (("seq_len", seq_len), ("block_size", block_size), ("world", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    nb, p = num_blocks(seq_len, block_size), world_size
    if kind == "contiguous":
        n = -(-nb // p)
        blocks = torch.arange(p * n).view(p, n)
    elif kind == "striped":
        n = -(-nb // p)
        blocks = torch.arange(p * n).view(n, p).T.contiguous()
    else:
        half = -(-nb // (2 * p))
        chunks = torch.arange(2 * p * half).view(2 * p, half)
        r = torch.arange(p)
        blocks = torch.cat([chunks[r], chunks[2 * p - 1 - r]], dim=1)
    return Placement(kind, seq_len, block_size, blocks)


def ring_sources(world_size: int, inner_size: int | None = None) -> torch.Tensor:
    """int64 ``(P, P)``: the rank whose key/value shard rank r holds at ring step s.

    Flat ring: ``(r - s) mod P``. Hierarchical ring (``inner_size`` G, ``O = P / G`` groups,
    rank ``r = o G + i``): step ``s = j G + t`` holds the shard of rank
    ``((o - j) mod O) G + (i - t) mod G``.
    """
    r = torch.arange(world_size)[:, None]
    s = torch.arange(world_size)[None, :]
    if inner_size is None or inner_size == world_size:
        return (r - s) % world_size
    if world_size % inner_size:
        raise ValueError(f"inner_size ({inner_size}) must divide the world size ({world_size})")
    groups = world_size // inner_size
    o, i = r // inner_size, r % inner_size
    j, t = s // inner_size, s % inner_size
    return ((o - j) % groups) * inner_size + (i - t) % inner_size


def ring_work(layout: BlockLayout, placement: Placement, inner_size: int | None = None) -> torch.Tensor:
    """float64 ``(P, P)``: kept doc-causal block pairs (summed over heads) of rank r at step s.

    The op's work is proportional to the kept block pairs, so this is the compute each rank does
    between two key/value transfers.
    """
    if (layout.seq_len, layout.block_size) != (placement.seq_len, placement.block_size):
        raise ValueError(
            f"layout (T={layout.seq_len}, B={layout.block_size}) and placement "
            f"(T={placement.seq_len}, B={placement.block_size}) differ"
        )
    causal = causal_block_mask(layout.cu_seqlens.cpu(), layout.seq_len, layout.block_size)
    pairs = (layout.to_block_mask().cpu() & causal).sum(0).double()  # (nb, nb)
    nb, p = layout.num_blocks, placement.world_size
    onehot = torch.zeros(nb, p, dtype=torch.float64)
    onehot[torch.arange(nb), placement.owner()[:nb]] = 1.0
    by_rank = onehot.T @ pairs @ onehot  # [query rank, key rank]
    return by_rank.gather(1, ring_sources(p, inner_size))


def ring_time(work: torch.Tensor, inner_size: int | None = None) -> float:
    """Compute-only finish time of the ring for a ``(P, P)`` :func:`ring_work` matrix.

    A rank posts the transfer of the next shard when it starts a step and waits for it when the
    step's compute ends; the transfer completes once its partner posted too (transfer time 0).
    So ``start[r, s + 1] = max(start[r, s] + W[r, s], start[from, s], start[to, s])`` where
    ``from``/``to`` are the ranks it receives the next shard from and sends its shard to. Unlike
    a lockstep bound, a slow rank delays only its neighbours, one step later.
    """
    p = work.shape[0]
    src = ring_sources(p, inner_size)
    start = torch.zeros(p, dtype=torch.float64)
    for s in range(p - 1):
        # holder[x] = the rank holding shard x at step s
        holder = torch.empty(p, dtype=torch.long)
        holder[src[:, s]] = torch.arange(p)
        recv_from = holder[src[:, s + 1]]
        nxt = torch.empty(p, dtype=torch.long)
        nxt[src[:, s + 1]] = torch.arange(p)
        send_to = nxt[src[:, s]]
        start = torch.maximum(start + work[:, s], torch.maximum(start[recv_from], start[send_to]))
    return float((start + work[:, -1]).max())


def imbalance(work: torch.Tensor, inner_size: int | None = None) -> dict[str, float]:
    """Summary of a ``(P, P)`` :func:`ring_work` matrix (all ratios; 1.0 is perfect).

    - ``rank``: max / mean of the per-rank totals (what a rank computes over the whole ring);
    - ``ring``: :func:`ring_time` over the ideal ``sum W / P``;
    - ``lockstep``: ``sum_s max_r W[r, s]`` over the ideal: the bound if every step waited for
      the slowest rank of the whole ring (an upper bound on ``ring``);
    - ``step_min``: the lightest step's max work over the mean step's: a step far below 1.0 cannot
      hide its key/value transfer (exposed communication);
    - ``step_max``: the heaviest step's max work over the mean step's.
    """
    p = work.shape[0]
    total = float(work.sum())
    if total == 0:
        return {"rank": 1.0, "ring": 1.0, "lockstep": 1.0, "step_min": 1.0, "step_max": 1.0}
    per_rank = work.sum(1)
    step = work.max(0).values
    return {
        "rank": float(per_rank.max() / per_rank.mean()),
        "ring": ring_time(work, inner_size) / (total / p),
        "lockstep": float(step.sum() / (total / p)),
        "step_min": float(step.min() / step.mean()),
        "step_max": float(step.max() / step.mean()),
    }
