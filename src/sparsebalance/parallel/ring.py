"""Block-sparse ring attention over a context-parallel group (flat ring).

Every rank holds the query, key and value tokens of its :class:`~.layouts.Placement` blocks.
Forward: ``P`` steps; at step ``s`` rank ``r`` attends its queries to the key/value shard of rank
``(r - s) mod P`` (only the global layout's kept block pairs, :mod:`.blockwise`) while the next
shard is already in flight (``batch_isend_irecv`` to ``r + 1``, from ``r - 1``); the partial
results are merged by log-sum-exp. Backward: the same ring; each step's key/value gradient is added
to an accumulator that travels with the shard and arrives back at its owner after ``P`` hops.

Communication per rank and direction: ``P - 1`` shards forward, ``P - 1`` shards plus ``P``
gradients backward (``2 Hkv D`` values per token). Compute per step: the kept block pairs between
the local queries and that shard (see :func:`~.layouts.ring_work`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..ops.layout import BlockLayout
from ..ops.varlen import resolve_scale
from . import watch
from .blockwise import ShardState, backward_step, check_shard_inputs, forward_step
from .layouts import Placement, ring_sources
from .p2p import RingComm
from .ranks import Group, group_rank, group_size


def ring_pass(
    comm: RingComm,
    kv: torch.Tensor,
    step: Callable[[int, torch.Tensor], None],
    tag: int = 0,
    offset: int = 0,
) -> None:
    """Call ``step(s, shard)`` for the ``comm.size`` shards of the ring, overlapping transfers
    (``offset + s`` is the ring step a hang report names)."""
    for s in range(comm.size):
        watch.set_ring_step(offset + s)
        pending = comm.send_recv(kv, tag) if s + 1 < comm.size else None
        step(s, kv)
        if pending is not None:
            kv = pending.wait()


def ring_pass_grad(
    comm: RingComm,
    kv: torch.Tensor,
    step: Callable[[int, torch.Tensor], torch.Tensor],
    tag: int = 0,
    offset: int = 0,
) -> torch.Tensor:
    """Like :func:`ring_pass`, with ``step`` returning the shard's gradient; the gradients travel
    with the shards (tag ``tag + 1``) and the sum for this rank's own shard is returned.
    Every rank issues the same sequence (shard of step s + 1, then gradient of step s) to the
    same neighbours, so the transfers pair up by order on backends that ignore tags."""
    grad_pending = None
    for s in range(comm.size):
        watch.set_ring_step(offset + s)
        pending = comm.send_recv(kv, tag) if s + 1 < comm.size else None
        grad = step(s, kv)
        if grad_pending is not None:
            grad += grad_pending.wait()
        grad_pending = comm.send_recv(grad, tag + 1)
        if pending is not None:
            kv = pending.wait()
    return grad_pending.wait()


def ring_forward(comm: RingComm, state: ShardState) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``out (R, g*B, D)`` and ``lse (R, g*B)`` of this rank's queries over the whole ring."""
    out, lse = state.new_accumulators()
    ring_pass(comm, state.kv, lambda s, kv: forward_step(state.qr, kv, state.plans[s], out, lse))
    return out, lse


def ring_backward(comm: RingComm, state: ShardState, dor, lse, delta) -> tuple[torch.Tensor, ...]:
    """Rows ``dq (R, g*B, D)`` and this rank's shard gradient ``dkv (2, Hkv*n, B*D)``."""
    dq = torch.zeros(state.qr.shape, dtype=state.acc, device=state.qr.device)
    dkv = ring_pass_grad(
        comm,
        state.kv,
        lambda s, kv: backward_step(state.qr, dor, kv, state.plans[s], lse, delta, dq),
    )
    return dq, dkv


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, layout, placement, scale):  # type: ignore[override]
        rank, world = group_rank(group), group_size(group)
        state = ShardState(q, k, v, layout, placement, rank, ring_sources(world)[rank], scale)
        comm = RingComm(group, range(world))
        out, lse = ring_forward(comm, state)
        ctx.state, ctx.comm = state, comm
        ctx.save_for_backward(out, lse)
        return state.output(out)

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        out, lse = ctx.saved_tensors
        state = ctx.state
        dor, delta, lse = state.grad_inputs(dout, out, lse)
        dq, dkv = ring_backward(ctx.comm, state, dor, lse, delta)
        return (*state.grads(dq, dkv), None, None, None, None)


def ring_attention(
    group: Group,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: BlockLayout,
    placement: Placement,
    scale: float | None = None,
) -> torch.Tensor:
    """Block-sparse, document-causal attention of a sequence sharded over ``group``.

    Args:
        group: the context-parallel process group (``None``: the default group), or a
            :class:`~.ranks.RankList` of default-group ranks (no group is created); ``P`` ranks.
        q: ``(Tl, Hq, D)``: this rank's query tokens, ``placement.shard(q_global, rank)``.
        k, v: ``(Tl, Hkv, D)``: this rank's key and value tokens, ``Hq % Hkv == 0``.
        layout: the *global* :class:`BlockLayout` (identical on every rank, e.g. from
            :func:`~.selection.select_blocks_distributed`); its ``cu_seqlens`` is the pack.
        placement: which blocks each rank holds (:func:`~.layouts.make_placement`).
        scale: softmax scale, default ``D ** -0.5``.

    Returns:
        ``(Tl, Hq, D)``: this rank's rows of ``block_sparse_attention`` on the full sequence
        (padded tokens are zeros); differentiable in q, k and v.
    """
    world = group_size(group)
    check_shard_inputs(q, k, v, layout, placement, world)
    scale = resolve_scale(scale, q.shape[-1])
    return RingAttention.apply(q, k, v, group, layout.to(q.device), placement, scale)
