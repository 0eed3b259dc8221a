"""Hugging Face causal LMs for training: built from a shipped config (random weights) or loaded
from a local directory (safetensors). Never a hub download."""

from __future__ import annotations

import json
import pickle
import re
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
        cfg = {k: v for k, v in json.loads((CONFIG_DIR / f"{model}.json").read_text()).items() if not k.startswith("_")}
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
            try:
                net = AutoModelForCausalLM.from_pretrained(
                    path,
                    local_files_only=True,
                    attn_implementation=attn_implementation,
                    dtype=dtype,
                )
            except pickle.UnpicklingError as err:  # torch's safe loader refused a .bin file
                raise ValueError(_refused_pickle(model, path, err)) from None
        else:
            config = AutoConfig.from_pretrained(path, local_files_only=True)
            torch.manual_seed(seed)
            net = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return net.to(device=device, dtype=dtype)


def _refused_pickle(model: str, folder: Path, err: pickle.UnpicklingError) -> str:
    """One line for a ``pytorch_model.bin`` that torch's safe loader refused: it names the file
    and what it holds, and points at safetensors (torch's own message suggests turning the safe
    loader off, which would run whatever the file holds)."""
    found = re.search(r"GLOBAL ([\w.]+)", str(err))
    holds = f" ({found.group(1)})" if found else ""
    culprit = _unsafe_file(folder) or folder
    return (
        f"--model {model}: {culprit} refused: it holds objects{holds} that torch's safe loader "
        "does not allow, so loading it could run code; nothing of it was loaded. Use the "
        "model's weights as safetensors (model.safetensors; from a copy you trust, "
        "model.save_pretrained(DIR, safe_serialization=True) writes them)"
    )


def _unsafe_file(folder: Path) -> Path | None:
    """The first ``*.bin`` in ``folder`` that torch's safe loader refuses (None if none does).
    Only on the error path: each file is mapped, not read, where torch can map it."""
    for f in sorted(folder.glob("*.bin")):
        for mmap in (True, False):  # files of torch's old format cannot be mapped
            try:
                torch.load(f, map_location="cpu", weights_only=True, mmap=mmap)
            except pickle.UnpicklingError:
                return f
            except Exception:  # not the refusal: a damaged or unmappable file
                continue
            break
    return None
