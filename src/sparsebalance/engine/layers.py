"""DST's per-layer side of a micro-batch: the attention context one packed micro-batch runs with
(its budget, DST's per-layer choices, dense promotion) and the closed loop's layer timer.

:meth:`~.engine.StepEngine.attention` builds every context a step runs with from these; the
diagnostics that time or count one context alone (``sparsebalance bench-attn``'s cases, the
layer host-time benchmark) build one directly with :func:`packed_attention`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ..models.attention import PackedAttention
from ..ops import Budget
from ..tuning import DSTConfig, LayerController

BACKWARD_RATIO = 3.0  # forward + backward ~ 3x forward: prices a layer before its backward runs


def layer_feedback(dst: DSTConfig, deterministic: bool, device: torch.device | str) -> bool:
    """Whether DST's closed loop gets measured layer times: host times mean the layer's time
    only where the host does the work (CPU), and never in a deterministic run."""
    return bool(dst.layer_feedback) and not deterministic and torch.device(device).type == "cpu"


class LayerTimer:
    """DST's closed loop inside a forward: each attention layer's host time since the previous
    one (x :data:`BACKWARD_RATIO`, its forward + backward) fed to the controller as micro-batch
    ``m``'s measured layer; the first layer's only if :meth:`start` stamped the micro-batch's
    start (a collator builds the context long before the forward). Host times mean anything only
    where the host does the work: callers enable it on CPU outside deterministic runs."""

    def __init__(self, controller: LayerController | None, m: int, enabled: bool) -> None:
        self.controller, self.m = controller, m
        self.enabled = enabled and controller is not None
        self.last: float | None = None

    def start(self, host_time: float) -> None:
        self.last = host_time

    def __call__(self, layer: int) -> None:
        now = time.perf_counter()
        if self.enabled and self.last is not None and self.controller.was_chosen(self.m, layer):
            self.controller.observe(self.m, layer, (now - self.last) * BACKWARD_RATIO)
        self.last = now


def packed_attention(
    cu_seqlens: torch.Tensor,
    lengths: Sequence[int],
    budget: Budget,
    *,
    block_size: int,
    backend: str,
    controller: LayerController | None = None,
    m: int = 0,
    timer: LayerTimer | None = None,
    dense_from: float | None = None,
    gqa: str | None = None,
) -> PackedAttention:
    """The attention context of micro-batch ``m`` (``cu_seqlens`` int32 ``(N + 1,)``, its
    documents' ``lengths`` on the host): ``budget`` for every layer, or DST's per-layer choice
    when a ``controller`` is given; the ``timer`` sees each layer's end; ``dense_from``: the
    latency profile's crossover (documents from that density run whole on the dense kernel);
    ``gqa``: flex's GQA mode (the run's :class:`~.kernel.Kernel`'s; None: the flex default)."""
    choose, low = None, None
    if controller is not None:
        choose = lambda layer, e: controller.choose(m, layer, e)  # noqa: E731
        low = controller.lowest_budget()
    return PackedAttention(
        cu_seqlens,
        budget,
        block_size,
        backend,
        choose_budget=choose,
        on_layer_end=timer,
        lengths=tuple(int(n) for n in lengths),
        min_budget=low,
        dense_from=dense_from,
        gqa=gqa,
    )
