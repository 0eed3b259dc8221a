"""One packed micro-batch's loss: the model's forward, then the lm-head + cross-entropy kernel
(:mod:`sparsebalance.ops.loss`, which never builds the ``(T, V)`` logits unless ``--loss plain``)."""

from __future__ import annotations

import torch

from ..models.head import forward_hidden, output_head
from ..ops.loss import linear_cross_entropy, weighted_cross_entropy
from ..precision import Precision, resolve_precision


def packed_loss(
    model: torch.nn.Module,
    batch,
    attention,
    impl: str = "auto",
    chunk_tokens: int | None = None,
    precision: Precision | None = None,
    uniform_weights: bool | None = None,
) -> torch.Tensor:
    """Forward one packed micro-batch and return its weighted loss sum (scalar).

    ``batch`` is a ``data.PackedBatch`` (``input_ids``, ``position_ids``, ``labels``,
    ``loss_weights``, each ``(1, T)``), ``attention`` its ``PackedAttention``. The model and the
    lm-head run under ``precision``'s autocast (default: the device's, bf16 on CUDA and fp32 on
    CPU: :mod:`sparsebalance.precision`); ``plain`` computes the cross-entropy on float32
    logits, the others never build them (module docstring).
    """
    device = batch.input_ids.device
    precision = precision or resolve_precision("auto", device)
    kw = dict(input_ids=batch.input_ids, position_ids=batch.position_ids, sb_attention=attention, use_cache=False)
    labels, weights = batch.labels[0], batch.loss_weights[0]
    with precision.autocast():
        if impl == "plain":
            logits = model(**kw).logits[0]
        else:
            hidden = forward_hidden(model, **kw)[0]
            weight, bias = output_head(model)
            return linear_cross_entropy(
                hidden, weight, labels, weights, bias, impl, chunk_tokens, uniform_weights=uniform_weights
            )
    return weighted_cross_entropy(logits, labels, weights)
