"""The final hidden states of a Hugging Face causal LM, without its ``(T, V)`` logits.

The loss (``ops/loss.py``) applies the lm-head chunk by chunk, so the model must stop before it.
The model still runs through its own ``__call__`` (FSDP2's and DDP's hooks on the root stay in
place): ``logits_to_keep`` selects no token, so the lm-head runs on zero rows, and a forward hook
on the decoder (``get_decoder()``) hands back its output.
"""

from __future__ import annotations

import torch


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside a DistributedDataParallel wrapper (FSDP2 wraps in place)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def output_head(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight (V, H), bias (V,) or None)`` of the model's lm-head."""
    head = _unwrap(model).get_output_embeddings()
    # transformers returns whatever module the model uses as its lm-head (usually nn.Linear,
    # with or without a bias): a head without a weight is refused, a missing bias is none
    if head is None or not hasattr(head, "weight"):
        raise ValueError(f"{type(model).__name__} has no output embedding (lm-head) weight")
    return head.weight, getattr(head, "bias", None)


def tied_head(model: torch.nn.Module) -> bool:
    """Whether the model's lm-head weight is its input embedding (``tie_word_embeddings``), read
    from the weights themselves: the fact, whatever the config says or leaves out. A whole model
    only: a pipeline stage replaces the modules it does not run (read ``StageModel.tied``, taken
    before)."""
    head, embed = _unwrap(model).get_output_embeddings(), _unwrap(model).get_input_embeddings()
    return head is not None and embed is not None and head.weight is embed.weight


def forward_hidden(model: torch.nn.Module, **inputs) -> torch.Tensor:
    """Run ``model(**inputs)`` and return the decoder's last hidden states ``(B, T, H)``
    (after the final norm) instead of logits; no ``(T, V)`` tensor is built."""
    captured: list[torch.Tensor] = []

    def hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
        captured.append(hidden)

    handle = _unwrap(model).get_decoder().register_forward_hook(hook)
    try:
        device = inputs["input_ids"].device
        out = model(**inputs, logits_to_keep=torch.zeros(0, dtype=torch.long, device=device))
    finally:
        handle.remove()
    if len(captured) != 1 or out.logits.shape[1] != 0:
        raise RuntimeError(
            f"{type(model).__name__}: expected one decoder output and no logits, got "
            f"{len(captured)} outputs and logits of shape {tuple(out.logits.shape)}"
        )
    return captured[0]
