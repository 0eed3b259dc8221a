"""Generation and evaluation on an attached model: dense attention where the sparse op cannot run.

The block-sparse op runs packed documents (batch 1, ``cu_seqlens`` or restarting positions, no
KV cache): what training feeds it. An attached model is also generated from and evaluated, with
inputs the op does not take: a KV cache whose keys outnumber the queries (decoding), padded
batches with an ``attention_mask``. Those forwards run with the attention implementation the model
had before :func:`~.attach.attach` (``sdpa`` by default), which transformers masks and caches
itself, and are counted in ``runtime.dense_forwards``:

- a forward outside training (``model.eval()`` or no gradient) with a non-empty KV cache (every
  decoding step of ``model.generate``), or with a 2-D ``attention_mask`` over a batch of several
  rows or with padding (a padded ``generate`` prefill, ``Trainer.evaluate`` with a padding
  collator).

A single unpadded sequence (a ``generate`` prefill of one prompt) is one document: it runs the
sparse op with the runtime's budget (``Budget(gamma=1.0)`` by default: exact).

A training forward with such inputs is still refused by the op (one line): training never falls
back to dense attention unseen.
"""

from __future__ import annotations

import contextlib

import torch

from ..models.attention import IMPLEMENTATION


@contextlib.contextmanager
def dense_attention(model: torch.nn.Module, runtime):
    """Run the block inside with ``runtime.dense_implementation`` (nested uses are one switch)."""
    sparse = model.config._attn_implementation
    if sparse == runtime.dense_implementation:
        yield
        return
    model.set_attn_implementation(runtime.dense_implementation)
    runtime.dense_forwards += 1
    try:
        yield
    finally:
        model.set_attn_implementation(sparse)


def needs_dense(model: torch.nn.Module, kwargs: dict) -> bool:
    """Whether a forward with ``kwargs`` is one the sparse op does not take (module docstring).
    Reads the attention mask's values (inference only: never in a training forward)."""
    if model.training and torch.is_grad_enabled():
        return False
    for name in ("cache", "past_key_values"):  # transformers >= 5.x renames it ``cache``
        cache = kwargs.get(name)
        # a transformers Cache has get_seq_length; anything else passed under these names (a
        # legacy tuple cache) is not read as a non-empty cache here
        if cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0:
            return True
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return mask.shape[0] > 1 or not bool(mask.all())
    return False


def install(model: torch.nn.Module, runtime) -> None:
    """Route ``model``'s cached or padded inference forwards to its own attention (the one it
    has now, before ``attach`` switches it; ``sdpa`` if that is ours or a paged one), and let
    the runtime build a forward's pack before its layers (:meth:`~.attach.AttachedRuntime.
    prepare`): two hooks."""
    before = model.config._attn_implementation
    if before not in (None, IMPLEMENTATION, "eager_paged", "sdpa_paged"):
        runtime.dense_implementation = before  # e.g. eager or flash_attention_2
    switched: list[contextlib.ExitStack] = []

    def before(module, args, kwargs):
        stack = contextlib.ExitStack()
        if needs_dense(module, kwargs):
            stack.enter_context(dense_attention(module, runtime))
        else:  # the sparse op: the forward's pack, read once before its layers
            runtime.prepare(args, kwargs)
        switched.append(stack)

    def after(module, args, kwargs, output):
        runtime.done()
        if switched:
            switched.pop().close()

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True, always_call=True)
