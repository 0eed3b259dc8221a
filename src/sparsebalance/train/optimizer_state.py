"""An optimizer's state in and out of a checkpoint, as torch's distributed state-dict API moves it,
without the two things that API changes on the way.

- It creates a missing state (no step taken yet: step 0, or every step so far skipped as
  non-finite) by stepping at learning rate 0: AdamW ``step`` 1 and zero moments, so the next real
  step would be bias-corrected as the second. That state is dropped again.
- It creates that state only when no parameter has a gradient, and refuses to load into an
  optimizer without one ("Expected device to be set"). DDP's gradients are kept from step to step
  (views of its all-reduce buckets: :attr:`.Parallelized.keeps_gradients`), so they are set aside
  for the call and put back, the same tensors, after it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def _gradients_set_aside(optimizer) -> Iterator[None]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    kept = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in zip(params, kept, strict=True):
            p.grad = grad


def optimizer_state_dict(model, optimizer, options) -> dict:
    """``optimizer``'s state dict (``get_optimizer_state_dict``); an optimizer without state yet is
    left without one, and its dict holds no state."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    unstepped = not optimizer.state
    with _gradients_set_aside(optimizer):
        optim_sd = get_optimizer_state_dict(model, optimizer, options=options)
    if unstepped:
        optimizer.state.clear()
        optim_sd["state"] = {}
    return optim_sd


def load_optimizer_state_dict(model, optimizer, optim_sd: dict, options, unstepped: bool) -> None:
    """``set_optimizer_state_dict``; ``unstepped``: the saved state is empty (saved before the first
    step, see :func:`optimizer_state_dict`), and the optimizer is left without state too."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    with _gradients_set_aside(optimizer):
        set_optimizer_state_dict(model, optimizer, optim_sd, options=options)
    if unstepped:
        optimizer.state.clear()
