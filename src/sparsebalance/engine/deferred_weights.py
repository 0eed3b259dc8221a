"""Zero bubble's W (``--pp-schedule zb-h1``, :mod:`sparsebalance.batching.zero_bubble`): a stage's
linear layers make their input's gradient in the backward (B), which the stage before waits for,
and leave their weights' gradient for a later op (W), which nobody waits for.

While :class:`DeferredWeights` is installed on a stage, each ``nn.Linear`` whose weight takes a
gradient runs through :class:`_DeferredLinear` when autograd records: its backward returns the
input's gradient (``grad_output @ weight``) and the bias's (a sum, cheap), and hands the weight's
GEMM (``grad_output^T @ input``) to the store instead of computing it; the weight gets no
gradient from autograd (it is not an input of the graph). :meth:`DeferredWeights.run` computes a
micro-batch's deferred GEMMs later, in the dtype the forward ran in (autocast's: what autograd's
linear backward computes), and adds each into ``weight.grad`` in the weight's dtype, then calls
``on_ready(weight)`` (the data-parallel bucket hook, on the step's last W). Megatron's
zero-bubble fork defers the same GEMMs (its ``WeightGradStore``). Attention, norms and the
embedding keep their gradients in B.

Memory: a deferred GEMM keeps its layer's input (saved for B anyway) and output gradient until its
W; the schedule bounds the W's pending (:func:`~sparsebalance.batching.zero_bubble.
held_micro_batches`). A backward outside a B (``begin`` not called) computes the weights' gradients
at once, as without the store. Under autocast the forward casts input, weight and bias to
autocast's dtype and runs the GEMM with autocast off, as ``F.linear`` under autocast does.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..precision import autocast_enabled


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module, store):  # weight: detached, in the compute dtype
        ctx.save_for_backward(x, weight)
        ctx.module, ctx.store, ctx.has_bias = module, store, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_b = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        ctx.store.defer(ctx.module.weight, x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1]))
        return grad_x, None, grad_b, None, None


def _weight_gradient(x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    return grad_out.t().matmul(x)


class DeferredWeights:
    """The deferred weight GEMMs of one stage (see the module docstring). :meth:`begin` before a
    micro-batch's B and :meth:`end` after it; :meth:`run` is its W."""

    def __init__(self, module: nn.Module) -> None:
        self.linears = [m for m in module.modules() if isinstance(m, nn.Linear) and m.weight.requires_grad]
        self._current: int | None = None
        self._recording: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]] = []
        self.pending: dict[int, list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]]] = {}
        """Micro-batch -> its deferred GEMMs, in the order its B made them (the last layer's first)."""
        for linear in self.linears:
            linear.forward = types.MethodType(_forward(self), linear)

    def remove(self) -> None:
        """Every linear layer back to its own forward (nothing may be pending)."""
        if self.pending:
            raise RuntimeError(f"deferred weight gradients of micro-batches {sorted(self.pending)} never ran")
        for linear in self.linears:
            del linear.forward

    def begin(self, micro_batch: int) -> None:
        """The next backward is micro-batch ``micro_batch``'s B: defer its weight GEMMs."""
        self._current, self._recording = micro_batch, []

    def end(self) -> None:
        """After the B: its GEMMs wait for :meth:`run`."""
        if self._current is not None:
            self.pending[self._current] = self._recording
        self._current, self._recording = None, []

    def defer(self, weight: nn.Parameter, x: torch.Tensor, grad_out: torch.Tensor) -> None:
        """From :class:`_DeferredLinear`'s backward: keep the GEMM, or outside a B run it now."""
        if self._current is None:
            _accumulate(weight, _weight_gradient(x, grad_out))
        else:
            self._recording.append((weight, x, grad_out))

    def run(self, micro_batch: int, on_ready: Callable[[nn.Parameter], None] | None = None) -> None:
        """Micro-batch ``micro_batch``'s W: its weights' gradients added into ``weight.grad``,
        ``on_ready(weight)`` after each (the step's last W: each weight's gradient is final)."""
        for weight, x, grad_out in self.pending.pop(micro_batch, []):
            _accumulate(weight, _weight_gradient(x, grad_out))
            if on_ready is not None:
                on_ready(weight)


def _accumulate(weight: nn.Parameter, grad: torch.Tensor) -> None:
    grad = grad.to(weight.dtype)
    if weight.grad is None:
        weight.grad = grad.contiguous()
    else:
        weight.grad.add_(grad)


def _forward(store: DeferredWeights):
    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and self.weight.requires_grad):
            return F.linear(x, self.weight, self.bias)
        device = x.device.type
        if not autocast_enabled(device):  # also the stand-in ``meta`` device, which has no autocast
            return _DeferredLinear.apply(x, self.weight.detach(), self.bias, self, store)
        dtype = torch.get_autocast_dtype(device)
        with torch.autocast(device, enabled=False):  # what F.linear under autocast runs in
            bias = None if self.bias is None else self.bias.to(dtype)
            return _DeferredLinear.apply(x.to(dtype), self.weight.detach().to(dtype), bias, self, store)

    return forward
