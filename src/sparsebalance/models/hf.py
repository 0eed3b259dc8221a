"""Hugging Face causal LMs for training: built from a shipped config (random weights) or loaded
from a local directory (safetensors). Never a hub download."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .attention import IMPLEMENTATION, register
from .shapes import BUILTIN_MODELS, CONFIG_DIR


def build_model(
    model: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = IMPLEMENTATION,
    seed: int = 0,
):
    """A ``transformers`` causal LM.

    Args:
        model: a built-in name (``tiny``, ``qwen2.5-0.5b``, ``qwen2.5-3b``: random weights from
            the shipped config) or a local directory with ``config.json`` (+ safetensors weights,
            loaded when present).
        attn_implementation: ``"sparsebalance"`` (packed sparse; default), ``"eager"``, ``"sdpa"``.
        seed: initialisation seed for built-in configs (identical on every rank).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    register()
    if model in BUILTIN_MODELS:
        cfg = {k: v for k, v in json.loads((CONFIG_DIR / f"{model}.json").read_text()).items()
               if not k.startswith("_")}  # fmt: skip
        config = AutoConfig.for_model(**cfg)
        config._attn_implementation = attn_implementation
        torch.manual_seed(seed)
        net = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    else:
        path = Path(model)
        if not (path / "config.json").is_file():
            raise ValueError(
                f"--model {model!r}: not a built-in model {BUILTIN_MODELS} and not a directory "
                "with config.json (weights are only ever loaded from local paths)"
            )
        has_weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
        if has_weights:
            net = AutoModelForCausalLM.from_pretrained(
                path, local_files_only=True, attn_implementation=attn_implementation,
                dtype=dtype,
            )  # fmt: skip
        else:
            config = AutoConfig.from_pretrained(path, local_files_only=True)
            torch.manual_seed(seed)
            net = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return net.to(device=device, dtype=dtype)
