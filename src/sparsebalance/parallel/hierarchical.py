"""Hierarchical (two-level) block-sparse ring attention.

The ``P`` ranks form ``O = P / G`` groups of ``G`` consecutive ranks (rank ``r = o G + i``; a group
is typically one node). The *outer* ring passes key/value shards between groups
(``(o, i) -> (o + 1, i)``); for every outer step the *inner* ring circulates the shards the group
holds among its ``G`` ranks. Each outer step crosses groups exactly once per rank, and that slow
transfer overlaps a whole inner ring of compute (``G`` steps) instead of one step. Key/value
gradients travel back the same way: round the inner ring, then with the shard round the outer
ring. The steps are the flat ring's (:mod:`.ring`), composed; rank ``r`` holds the shard of
:func:`~.layouts.ring_sources` ``(P, G)[r, j G + t]`` at outer step ``j``, inner step ``t``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..ops.layout import BlockLayout
from ..ops.varlen import resolve_scale
from .blockwise import ShardState, backward_step, check_shard_inputs, forward_step
from .layouts import Placement, ring_sources
from .p2p import RingComm
from .ranks import Group, global_rank, group_rank, group_size
from .ring import ring_pass, ring_pass_grad
from .topology import Topology

_INNER_TAG, _OUTER_TAG = 0, 2  # each ring uses tag (shards) and tag + 1 (gradients)


def _rings(group, inner_size: int) -> tuple[RingComm, RingComm]:
    """The inner and outer rings, on the ``inner`` and ``outer`` ring groups of a rank list (two
    communicators, so the cross-group transfer overlaps the inner ring's instead of queueing
    behind them on one NCCL stream)."""
    world, rank = group_size(group), group_rank(group)
    o, i = divmod(rank, inner_size)
    inner = RingComm(group, range(o * inner_size, (o + 1) * inner_size), role="inner")
    outer = RingComm(group, range(i, world, inner_size), role="outer")
    return inner, outer


def hierarchical_forward(inner: RingComm, outer: RingComm, state: ShardState):
    """Rows ``out (R, g*B, D)`` and ``lse (R, g*B)`` over all ``O * G`` shards."""
    out, lse = state.new_accumulators()
    g = inner.size

    def outer_step(j: int, shard: torch.Tensor) -> None:
        def inner_step(t: int, kv: torch.Tensor) -> None:
            forward_step(state.qr, kv, state.plans[j * g + t], out, lse)

        ring_pass(inner, shard, inner_step, _INNER_TAG, offset=j * g)

    ring_pass(outer, state.kv, outer_step, _OUTER_TAG)
    return out, lse


def hierarchical_backward(inner: RingComm, outer: RingComm, state: ShardState, dor, lse, delta):
    """Rows ``dq (R, g*B, D)`` and this rank's shard gradient ``dkv (2, Hkv*n, B*D)``."""
    dq = torch.zeros(state.qr.shape, dtype=state.acc, device=state.qr.device)
    g = inner.size

    def outer_step(j: int, shard: torch.Tensor) -> torch.Tensor:
        def inner_step(t: int, kv: torch.Tensor) -> torch.Tensor:
            return backward_step(state.qr, dor, kv, state.plans[j * g + t], lse, delta, dq)

        # The group's summed gradient of the shard it holds in this outer step.
        return ring_pass_grad(inner, shard, inner_step, _INNER_TAG, offset=j * g)

    dkv = ring_pass_grad(outer, state.kv, outer_step, _OUTER_TAG)
    return dq, dkv


class HierarchicalRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, layout, placement, inner_size, scale):  # type: ignore[override]
        rank, world = group_rank(group), group_size(group)
        sources = ring_sources(world, inner_size)[rank]
        state = ShardState(q, k, v, layout, placement, rank, sources, scale)
        inner, outer = _rings(group, inner_size)
        out, lse = hierarchical_forward(inner, outer, state)
        ctx.state, ctx.rings = state, (inner, outer)
        ctx.save_for_backward(out, lse)
        return state.output(out)

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        out, lse = ctx.saved_tensors
        state = ctx.state
        dor, delta, lse = state.grad_inputs(dout, out, lse)
        dq, dkv = hierarchical_backward(*ctx.rings, state, dor, lse, delta)
        return (*state.grads(dq, dkv), None, None, None, None, None)


def default_inner_size(group: Group) -> int:
    """Ranks per node among ``group``'s ranks (global ranks in ring order), the launcher's
    topology."""
    ranks = [global_rank(group, j) for j in range(group_size(group))]
    return Topology.from_env(dist.get_world_size()).inner_size(ranks)


def hierarchical_ring_attention(
    group: Group,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: BlockLayout,
    placement: Placement,
    inner_size: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Two-level ring attention: inner rings of ``inner_size`` consecutive ranks, outer ring across.

    Args:
        group: the context-parallel process group (``None``: the default group), or a
            :class:`~.ranks.RankList` of default-group ranks; ``P`` ranks.
        q: ``(Tl, Hq, D)``: this rank's query tokens, ``placement.shard(q_global, rank)``.
        k, v: ``(Tl, Hkv, D)``: this rank's key and value tokens.
        layout: the *global* :class:`BlockLayout`, identical on every rank.
        placement: which blocks each rank holds (:func:`~.layouts.make_placement`).
        inner_size: G, ranks per inner ring (e.g. GPUs per node); must divide ``P``. ``G = P`` is
            the flat ring; ``G = 1`` a flat ring with every hop crossing groups. Default: the
            group's ranks per node, from the launcher's ``LOCAL_WORLD_SIZE``
            (:meth:`~.topology.Topology.inner_size`; ``P`` without launcher variables).
        scale: softmax scale, default ``D ** -0.5``.

    Returns:
        ``(Tl, Hq, D)``, equal to :func:`~.ring.ring_attention`'s output; differentiable.
    """
    world = group_size(group)
    if inner_size is None:
        inner_size = default_inner_size(group)
    if isinstance(inner_size, bool) or not isinstance(inner_size, int) or inner_size <= 0:
        raise ValueError(f"inner_size must be a positive integer, got {inner_size!r}")
    if world % inner_size:
        raise ValueError(f"inner_size ({inner_size}) must divide the group size ({world})")
    check_shard_inputs(q, k, v, layout, placement, world)
    scale = resolve_scale(scale, q.shape[-1])
    return HierarchicalRingAttention.apply(q, k, v, group, layout.to(q.device), placement, inner_size, scale)
