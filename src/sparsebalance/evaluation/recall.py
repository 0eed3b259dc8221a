"""Attention recall per layer: how much of the true (dense) attention mass the kept blocks hold.

For every layer of a forward at a budget (``gamma``, or any :class:`~sparsebalance.ops.Budget`
such as top-k, optionally per document length), the op picks its blocks as usual; this module
records the layer's query/key tensors and that layout and scores them with
:func:`sparsebalance.ops.attention_recall` (exact float64 softmax over every doc-causal key, mean
over query tokens and heads). 1.0 means no attention mass was dropped; at ``gamma = 1`` it is 1.0
by construction. The exact softmax is ``Hq * T^2`` memory, so documents run one per forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..models.attention import (
    PackedAttention,
    recompute_phase,
    register,
    sparsebalance_attention,
)
from ..ops import Budget, attention_recall

RECALL_IMPLEMENTATION = "sparsebalance_recall"
"""The transformers attention implementation name this module registers."""


def _recall_attention(
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
    """``sparsebalance_attention`` that also records each layer's recall in ``sb_attention``."""
    # the "forward" phase makes the op keep its (budget, layout) per layer in ctx.layouts
    with recompute_phase("forward"):
        out = sparsebalance_attention(
            module,
            query,
            key,
            value,
            attention_mask,
            scaling,
            dropout,
            sb_attention=sb_attention,
            **kwargs,
        )
    # a transformers attention module carries layer_idx; a bare one is the latest layer
    layer = int(getattr(module, "layer_idx", len(sb_attention.stats) - 1))
    _, layout = sb_attention.layouts.pop(layer)
    q, k = (x[0].transpose(0, 1) for x in (query, key))  # (T, H, D)
    per_head = attention_recall(q, k, layout, sb_attention.cu_seqlens, scale=scaling)
    sb_attention.recall.setdefault(layer, []).append(float(per_head.mean()))
    return out


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    register()
    AttentionInterface.register(RECALL_IMPLEMENTATION, _recall_attention)
    AttentionMaskInterface.register(RECALL_IMPLEMENTATION, lambda *args, **kwargs: None)


def layer_recall(
    model,
    docs: Sequence[Sequence[int]],
    gamma: float,
    block_size: int,
    backend: str = "torch",
    budget: Budget | Callable[[int], Budget] | None = None,
) -> dict[int, float]:
    """Mean attention recall per layer ``{layer: recall in [0, 1]}`` over ``docs`` (token ids,
    one forward each) with every layer at budget ``gamma``, or at ``budget`` (a
    :class:`~sparsebalance.ops.Budget`, or ``length -> Budget`` per document) when given. The
    model must use the ``sparsebalance`` attention implementation; it is restored afterwards."""
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"gamma must be in (0, 1], got {gamma}")
    if budget is None:
        budget = Budget(gamma=gamma)
    if not (isinstance(budget, Budget) or callable(budget)):
        raise TypeError(f"budget must be a Budget or length -> Budget, got {budget!r}")
    if not docs:
        raise ValueError("docs: need at least one document")
    _register()
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = RECALL_IMPLEMENTATION
    totals: dict[int, list[float]] = {}
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        for doc in docs:
            ids = torch.as_tensor(list(doc), dtype=torch.long, device=device)
            cu = torch.tensor([0, len(doc)], dtype=torch.int32, device=device)
            doc_budget = budget if isinstance(budget, Budget) else budget(len(doc))
            ctx = PackedAttention(cu, doc_budget, block_size, backend)
            ctx.recall = {}  # layer -> [recall per forward]
            with torch.no_grad():
                model.get_decoder()(
                    input_ids=ids[None],
                    position_ids=torch.arange(len(doc))[None],
                    sb_attention=ctx,
                    use_cache=False,
                )
            for layer, values in ctx.recall.items():
                totals.setdefault(layer, []).extend(values)
    finally:
        config._attn_implementation = previous
        model.train(was_training)
    return {layer: sum(v) / len(v) for layer, v in sorted(totals.items())}
