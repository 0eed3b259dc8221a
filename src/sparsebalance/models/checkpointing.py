"""Activation checkpointing of Hugging Face decoder layers that reuses the sparse layouts.

Modes (``--activation-checkpointing``):

- ``off``: every layer keeps its activations for the backward.
- ``full``: every decoder layer keeps only its input; the backward reruns the layer. The rerun's
  attention takes the ``(budget, layout)`` the forward chose (``PackedAttention.layouts``): no
  second block selection, no second call into DST's layer controller, no second timing callback.
- ``selective``: in every decoder layer only the MLP block is recomputed; attention keeps its
  activations. The MLP's intermediates (``4 x intermediate_size`` values per token for a gated MLP)
  are most of a layer's activations, while its recomputation is linear in the tokens; attention,
  quadratic in a document's length and the part whose budget is chosen at run time, never reruns.

Decoder layers are found the way Hugging Face tooling finds them: the module classes named in
``model._no_split_modules`` (Llama, Qwen2, Qwen3, Mistral alike), not ``model.model.layers``.
The wrapping replaces the module's ``forward`` on the instance, so parameter names, state dicts and
FSDP2's hooks (which run around ``__call__``) are untouched; the recomputation is PyTorch's
non-reentrant ``torch.utils.checkpoint``.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils.checkpoint import checkpoint

from .attention import recompute_phase

MODES = ("off", "full", "selective")
# The modules whose forward _wrap replaced (weakly: the set keeps no model alive).
_CHECKPOINTED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a Hugging Face model, in module order.

    Raises:
        ValueError: the model names no ``_no_split_modules`` or none of them is present.
    """
    # transformers' PreTrainedModel attribute, absent on plain torch modules (refused below)
    names = set(getattr(model, "_no_split_modules", None) or ())
    if not names:
        raise ValueError(f"{type(model).__name__} declares no _no_split_modules: cannot find its decoder layers")
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(model).__name__}: no module of the classes {sorted(names)} (_no_split_modules) was found"
        )
    return layers


def _wrap(module: torch.nn.Module) -> None:
    """Run ``module``'s forward under non-reentrant checkpointing, marking forward and rerun."""
    if module in _CHECKPOINTED:
        raise ValueError(f"{type(module).__name__} is already checkpointed")
    inner = module.forward  # the bound method of the class

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():  # nothing is saved without autograd: nothing to rerun
            return inner(*args, **kwargs)
        calls = [0]

        def run(*a, **kw):
            phase = "forward" if calls[0] == 0 else "recompute"
            calls[0] += 1
            with recompute_phase(phase):
                return inner(*a, **kw)

        return checkpoint(run, *args, use_reentrant=False, **kwargs)

    module.forward = forward
    _CHECKPOINTED.add(module)


def apply_activation_checkpointing(model: torch.nn.Module, mode: str) -> int:
    """Checkpoint ``model``'s decoder layers (``full``) or their MLPs (``selective``).

    Call it before FSDP2's ``fully_shard`` or DDP wrapping (either order works: only the
    instance's ``forward`` changes). Returns the number of modules wrapped (0 for ``off``).

    Raises:
        ValueError: unknown ``mode``, no decoder layers, or (``selective``) a layer without an
            ``mlp`` child.
    """
    if mode not in MODES:
        raise ValueError(f"--activation-checkpointing must be one of {MODES}, got {mode!r}")
    if mode == "off":
        return 0
    layers = decoder_layers(model)
    if mode == "full":
        targets = layers
    else:
        targets = []
        for layer in layers:
            # a transformers decoder layer's MLP child; a layer without one is refused below
            mlp = getattr(layer, "mlp", None)
            if not isinstance(mlp, torch.nn.Module):
                raise ValueError(
                    f"--activation-checkpointing selective recomputes each layer's 'mlp'; "
                    f"{type(layer).__name__} has none (use full)"
                )
            targets.append(mlp)
    for module in targets:
        _wrap(module)
    return len(targets)
