"""The ``sparsebalance`` attention implementation for Hugging Face models.

Registered with transformers' ``AttentionInterface`` (no mask function: transformers then prepares
no mask at all), so any decoder whose attention goes through that interface (Qwen2/Qwen2.5,
Llama, Qwen3) runs packed, document-causal, dynamically sparse attention. Per forward the caller
passes a :class:`PackedAttention` as ``model(..., sb_attention=ctx, use_cache=False)``;
transformers hands extra keyword arguments through to the attention function.

Activation checkpointing (:mod:`.checkpointing`) reruns a layer's forward in the backward. The
rerun must not choose again: :func:`recompute_phase` tells this function whether it runs in a
checkpointed layer's first forward (choose, keep the ``(budget, layout)`` in
``PackedAttention.layouts``) or in its recomputation (take them back: no block selection, no call to
``choose_budget``, no ``on_layer_end``, no stats).

Context parallelism: with ``PackedAttention.ring`` set (a :class:`RingContext`), the model runs on
this rank's striped shard of the pack; ``q, k, v`` are local and ``cu_seqlens`` is the *global*
pack's. Selection is distributed (one all-gather of pooled block means round the unit's ring:
every rank gets the same estimate, so the same budget and layout) and attention is the flat or
hierarchical block-sparse ring. A checkpointed layer's recomputation reruns the ring forward
with the cached layout; every rank of the unit recomputes the same layers in the same
(reverse-layer) order, so the ring's messages pair up.

Precision: under autocast the projections come out in the autocast dtype but a rotary embedding
with float32 cos/sin turns q and k back to float32; q, k and v are brought to one compute dtype
here (:func:`sparsebalance.precision.compute_dtype`) before any op sees them.

No host sync per layer: the statistics (densities) stay device tensors until the step's end
reads them (:class:`~.layer_stats.LayerStats`).

A layer whose budget keeps every document of its pack whole (the budget DST chose for it, or the
fixed one) computes no gate, no coverage bound and no block mask: one dense varlen call, its
statistics known on the host (:class:`LayerGateView` builds the gate only when asked).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from ..ops import BlockLayout, Budget, block_sparse_attention, estimate_block_mass
from ..ops.flex_config import GQA_MODES
from ..ops.pack_index import PackIndex
from ..ops.topk_gate import GateTables, TopKGate, gate_applies
from ..ops.varlen import resolve_scale
from ..parallel import (
    Placement,
    RankList,
    estimate_block_mass_distributed,
    hierarchical_ring_attention,
    ring_attention,
)
from ..precision import autocast_enabled, compute_dtype
from .layer_stats import LayerStats, read_stats

IMPLEMENTATION = "sparsebalance"

# None: not inside a checkpointed layer; "forward": its first forward; "recompute": the rerun.
_PHASE: ContextVar[str | None] = ContextVar("sparsebalance_checkpoint_phase", default=None)


@contextmanager
def recompute_phase(phase: str | None) -> Iterator[None]:
    """Mark the code inside as a checkpointed layer's ``"forward"`` or ``"recompute"``."""
    if phase not in (None, "forward", "recompute"):
        raise ValueError(f"phase must be None, 'forward' or 'recompute', got {phase!r}")
    token = _PHASE.set(phase)
    try:
        yield
    finally:
        _PHASE.reset(token)


@dataclass(frozen=True)
class RingContext:
    """How one rank of a CP unit attends: the unit's ranks, the placement of the pack, the ring."""

    group: RankList
    """The unit's ranks (default group, ring order); position j holds placement rank j."""
    placement: Placement
    """Striped placement of the global pack over the unit (its ``block_size`` is the layout's)."""
    kind: str = "flat"
    """``flat`` or ``hierarchical``."""
    inner_size: int = 1
    """Ranks per inner ring (``hierarchical``)."""

    def __post_init__(self) -> None:
        if self.kind not in ("flat", "hierarchical"):
            raise ValueError(f"ring kind must be flat or hierarchical, got {self.kind!r}")
        if self.placement.world_size != len(self.group.ranks):
            raise ValueError(
                f"the placement is for {self.placement.world_size} ranks, the unit has {len(self.group.ranks)}"
            )

    def estimate(self, q, k, cu_seqlens, block_size: int, scale, pack=None):
        """The global ``BlockMassEstimate`` from the local ``q (Tl, Hq, D)``, ``k (Tl, Hkv, D)``
        (``pack``: the global pack's index, built once per unit)."""
        if block_size != self.placement.block_size:
            raise ValueError(f"block size {block_size} differs from the placement's {self.placement.block_size}")
        return estimate_block_mass_distributed(self.group, q, k, self.placement, cu_seqlens, scale=scale, pack=pack)

    def attend(self, q, k, v, layout: BlockLayout, scale) -> torch.Tensor:
        """This rank's ``(Tl, Hq, D)`` rows of the block-sparse attention of the global pack."""
        if self.kind == "hierarchical":
            return hierarchical_ring_attention(self.group, q, k, v, layout, self.placement, self.inner_size, scale)
        return ring_attention(self.group, q, k, v, layout, self.placement, scale)


@dataclass
class PackedAttention:
    """Per-forward attention settings for one packed micro-batch (``batch size 1``)."""

    cu_seqlens: torch.Tensor
    """int32 ``(N + 1,)`` document offsets of the pack."""
    budget: Budget
    """Budget for every layer unless ``choose_budget`` is given (DST's layer controller);
    ``Budget(gamma=1.0)``: every causal block, exact attention."""
    block_size: int
    backend: str = "auto"
    choose_budget: Any = None
    """Optional ``(layer_idx, LayerGateView) -> Budget``: per-layer budgets at run time (the
    view computes the layer's gate when a question needs it)."""
    on_layer_end: Any = None
    """Optional ``(layer_idx) -> None`` called after each attention (for per-layer timing)."""
    stats: list[LayerStats] = field(default_factory=list)
    layouts: dict[int, tuple[Budget, BlockLayout]] = field(default_factory=dict)
    """Per layer, what a checkpointed layer's forward chose, held until its recomputation takes it
    back (then dropped). Empty without activation checkpointing."""
    ring: RingContext | None = None
    """Set when the model runs one rank's shard of a CP unit (see the module docstring)."""
    lengths: tuple[int, ...] | None = None
    """The documents' lengths on the host (what ``cu_seqlens`` holds): every layer's shapes come
    from them (:class:`~sparsebalance.ops.pack_index.PackIndex`), so no layer reads a shape back
    from the device. None: read from ``cu_seqlens`` once, when the context is built."""
    min_budget: Budget | None = None
    """The smallest budget ``choose_budget`` may return. Where it covers every document of the
    pack (:meth:`Budget.covers`), every causal block is kept whatever DST picks: no layer
    estimates or chooses (a pack of short documents under top-k runs dense, selection-free)."""
    dense_from: float | None = None
    """The density from which a document runs faster on the dense kernel than on the sparse one
    (the latency profile's crossover, ``Profile.dense_from``): a top-k document whose density
    reaches it keeps every causal block (exact attention, on the dense path). None: only the
    documents the budget covers."""
    gqa: str | None = None
    """flex's grouped-query attention, ``expand`` or ``native``: the run's resolved
    :class:`~sparsebalance.engine.kernel.Kernel`'s. None: the flex call's default (``expand``).
    The ring and the other backends ignore it."""
    _pack: PackIndex | None = field(default=None, init=False, repr=False)
    _all_covered: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.gqa is not None and self.gqa not in GQA_MODES:
            raise ValueError(f"gqa must be one of {GQA_MODES} or None, got {self.gqa!r}")
        if self.ring is None:  # a CP unit's shards index the global pack in the ring's estimate
            self._pack = PackIndex.build(self.cu_seqlens, self.block_size, self.lengths)
            low = self.min_budget if self.choose_budget is not None else self.budget
            self._all_covered = low is not None and all(low.dense_documents(self._pack, self.dense_from))

    def to_device(self, device: torch.device) -> None:
        """Put the pack's offsets and index on ``device`` (the activations'), in place. A
        collator builds the context on the host before the batch reaches the device (HF
        Trainer, TRL, accelerate, plain loops); the first layer of the forward moves it, once
        per micro-batch, with a pinned non-blocking copy of the offsets (the index's tables are
        then built on ``device``, from the host's facts: nothing is read back)."""
        if self._pack is None:
            self._pack = PackIndex.build(self.cu_seqlens, self.block_size, self.lengths)
        self._pack = self._pack.to(device)
        self.cu_seqlens = self._pack.cu_seqlens

    @property
    def pack(self) -> PackIndex:
        """The pack's index, built with the context, before the forward: every layer, the
        backward and any recomputation reuse it."""
        if self._pack is None:
            self._pack = PackIndex.build(self.cu_seqlens, self.block_size, self.lengths)
        return self._pack

    def estimate(self, q: torch.Tensor, k: torch.Tensor, scale: float | None):
        """The layer's gate for DST's choice: the one-batch top-k gate (:mod:`~sparsebalance.
        ops.topk_gate`) where :attr:`min_budget` is top-k, else the per-document estimate."""
        low = self.min_budget or self.budget
        scale = resolve_scale(scale, q.shape[-1])
        if gate_applies(low):
            tables = GateTables.of(self.pack, low, self.dense_from)
            if tables is not None:
                return TopKGate.score(q, k, tables, scale)
        return estimate_block_mass(q, k, self.cu_seqlens, self.block_size, scale=scale, pack=self.pack)

    def keeps_whole(self, budget: Budget) -> bool:
        """Whether ``budget`` keeps every document of the pack whole (covered, or promoted from
        :attr:`dense_from`): host facts, memoised on the pack."""
        return all(budget.dense_documents(self.pack, self.dense_from))

    def full_layout(self, num_q_heads: int) -> BlockLayout:
        """Every causal block pair of the pack, every document dense (built once per pack)."""
        pack = self.pack
        return pack.memo(("full layout", num_q_heads), lambda: BlockLayout.full(pack, num_q_heads, num_q_heads))

    def mean_density(self) -> float:
        return sum(read_stats(self.stats)[2]) / max(1, len(self.stats))


class LayerGateView:
    """One layer's gate as DST's layer controller asks for it (the
    :class:`~sparsebalance.tuning.LayerGate` protocol), computed only when a question needs it:
    whether a budget keeps every document whole is a host fact of the pack, so a layer whose
    chosen budget does never scores a block."""

    def __init__(self, ctx: PackedAttention, q: torch.Tensor, k: torch.Tensor, scale: float | None) -> None:
        self.ctx, self.q, self.k, self.scale = ctx, q, k, scale
        self._gate = None

    @property
    def gate(self):
        """The layer's ``TopKGate`` or ``BlockMassEstimate`` (:meth:`PackedAttention.estimate`)."""
        if self._gate is None:
            self._gate = self.ctx.estimate(self.q, self.k, self.scale)
        return self._gate

    def keeps_whole(self, budget: Budget) -> bool:
        return self.ctx.keeps_whole(budget)

    def document_density(self, budget: Budget) -> torch.Tensor:
        return self.gate.document_density(budget)

    def coverage(self, budget: Budget) -> float:
        return self.gate.coverage(budget)

    def coverage_curve(self, budget: Budget, ks):
        return self.gate.coverage_curve(budget, ks)

    def coverage_floor(self, budget: Budget, ks, p: float) -> torch.Tensor:
        return self.gate.coverage_floor(budget, ks, p)

    def layout(self, budget: Budget) -> BlockLayout:
        """The layout ``budget`` keeps (every block of a pack it keeps whole, without a gate)."""
        if self.keeps_whole(budget):
            return self.ctx.full_layout(self.q.shape[1])
        return self.gate.layout(budget, self.ctx.dense_from)


# attention module -> ``(module, query, sb_attention, kwargs) -> PackedAttention``: how a layer of
# a model another trainer drives finds its micro-batch (``sparsebalance.attach`` binds it).
_CONTEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def bind_context(module: torch.nn.Module, resolve) -> None:
    """Let attention ``module`` find its :class:`PackedAttention` when a forward passes none:
    ``resolve(module, query, sb_attention, kwargs)`` returns it (``sb_attention``: whatever the
    forward passed, e.g. an integration's ticket, or None). A bound method is held weakly: the
    entry must not keep its owner, hence the model and the module, alive."""
    _CONTEXTS[module] = weakref.WeakMethod(resolve) if inspect.ismethod(resolve) else (lambda: resolve)


def sparsebalance_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling=None,
    dropout=0.0,
    sb_attention: PackedAttention | None = None,
    **kwargs,
):
    """transformers attention function: ``query (1, Hq, T, D)`` -> ``((1, T, Hq, D), None)``.
    The one registration behind ``sparsebalance train``'s models and ``sparsebalance.attach``."""
    if not isinstance(sb_attention, PackedAttention):
        ref = _CONTEXTS.get(module)
        resolve = None if ref is None else ref()
        if resolve is None:
            raise ValueError(
                "the 'sparsebalance' attention needs model(..., sb_attention=PackedAttention("
                "...), use_cache=False), or a model prepared with sparsebalance.attach(model): "
                "call sparsebalance.attach(model) to run it inside another trainer"
            )
        sb_attention = resolve(module, query, sb_attention, kwargs)
    if sb_attention.cu_seqlens.device != query.device:  # built on the host by a collator
        sb_attention.to_device(query.device)
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise ValueError(
            "the 'sparsebalance' attention implements full document-causal attention: this "
            "model uses a sliding window or logit soft-capping, which it does not support"
        )
    if dropout:
        raise ValueError(f"attention dropout ({dropout}) is not supported by 'sparsebalance'")
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects batch size 1, got {query.shape[0]}")
    dtype = compute_dtype(query, key, value)
    q, k, v = (x[0].transpose(0, 1).to(dtype) for x in (query, key, value))  # (T, H, D)
    # Selection and the op compute in q/k/v's dtype with their own float32 accumulators: the
    # same numbers inside and outside autocast (a backward runs outside it anyway).
    if autocast_enabled(q.device.type):
        with torch.autocast(q.device.type, enabled=False):
            out = _layer(sb_attention, module, q, k, v, scaling)
    else:
        out = _layer(sb_attention, module, q, k, v, scaling)
    return out.unsqueeze(0), None


def _layer(ctx: PackedAttention, module, q, k, v, scaling) -> torch.Tensor:
    """Choose (or take back) the layer's layout and attend: ``(T, Hq, D)``."""
    phase = _PHASE.get()
    if phase == "recompute":
        layer = int(module.layer_idx)
        if layer not in ctx.layouts:
            raise RuntimeError(
                f"layer {layer} is recomputed but its forward left no layout: the recomputation "
                "must run with the PackedAttention of the forward it repeats"
            )
        budget, layout = ctx.layouts.pop(layer)  # the forward's choice; nothing chosen again
        return _attend(ctx, q, k, v, layout, scaling)
    # a transformers attention module carries its layer_idx; a bare one counts its calls
    layer = int(getattr(module, "layer_idx", len(ctx.stats)))
    if ctx.ring is not None:
        estimate = ctx.ring.estimate(q, k, ctx.cu_seqlens, ctx.block_size, scaling, ctx.pack)
        budget = ctx.budget if ctx.choose_budget is None else ctx.choose_budget(layer, estimate)
        layout = estimate.layout(budget)
    else:
        gate = LayerGateView(ctx, q, k, scaling)
        budget = ctx.budget
        if ctx.choose_budget is not None and not ctx._all_covered:
            budget = ctx.choose_budget(layer, gate)
        layout = gate.layout(budget)
    if phase == "forward":
        ctx.layouts[layer] = (budget, layout)
    out = _attend(ctx, q, k, v, layout, scaling)
    whole = ctx.ring is None and ctx.keeps_whole(budget)
    heads = layout.block_mask.shape[0]
    stats = LayerStats.whole(layer, budget, ctx.pack.num_docs, heads) if whole else LayerStats.of(layer, budget, layout)
    ctx.stats.append(stats)
    if ctx.on_layer_end is not None:
        ctx.on_layer_end(layer)
    return out


def _attend(ctx: PackedAttention, q, k, v, layout: BlockLayout, scaling) -> torch.Tensor:
    """The op on the whole pack, or this rank's rows through the unit's ring."""
    if ctx.ring is not None:
        return ctx.ring.attend(q, k, v, layout, scaling)
    return block_sparse_attention(q, k, v, layout, ctx.cu_seqlens, scale=scaling, backend=ctx.backend, gqa=ctx.gqa)


def register() -> None:
    """Register the implementation with transformers (idempotent).

    No mask function is registered: for an attention implementation without one, transformers'
    mask preparation returns at once (``masking_utils._preprocess_mask_arguments``), before it
    scans ``position_ids`` for packed documents, a read back on every forward (the first GPU
    run's sync test failed there). Masking happens inside the op."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, sparsebalance_attention)
