"""What every stand-in test trains: a model small enough that a 16K-token pack costs nothing on the
stand-in device, documents of which one is longer than the default top-k budget keeps whole (8,192
tokens: the gate and DST's layer controller run, the lowest budget cuts it) beside short ones
(kept whole: the dense kernel), and the analytic H100 profile at CUDA's block."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from sparsebalance.latency import analytic_profile
from sparsebalance.models import ModelShapes
from sparsebalance.ops.loss import resolve_loss

from .device import DEVICE

MICRO = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 16384,
    "tie_word_embeddings": True,
}
LENGTHS = (9300, 2500, 700, 1800, 600, 1200)
"""One document past the default budget (8,192 tokens: selected), short ones kept whole."""
CAPACITY = 12288
"""Tokens per micro-batch: the long document and the short ones land in two micro-batches."""
CUDA = torch.device("cuda", 0)


def documents(seed: int = 0) -> list[np.ndarray]:
    g = np.random.default_rng(seed)
    return [g.integers(1, MICRO["vocab_size"], n) for n in LENGTHS]


def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(MICRO))
    return tmp_path


def hf_model():
    """The transformers model (random weights, the ``sparsebalance`` attention not yet set)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**MICRO))


def profile_file(tmp_path: Path) -> Path:
    """The analytic H100 profile of :data:`MICRO` at CUDA's block (what ``profile --analytic
    h100`` writes)."""
    shapes = ModelShapes.from_hf_config(dict(MICRO), name="qwen2")
    path = tmp_path / "profile.json"
    analytic_profile(shapes, "h100", block_size=128).save(path)
    return path


def cuda_loss(uniform_weights: bool = True) -> str:
    """``--loss auto`` as a CUDA run resolves it (Liger counted as installed: the GPU image
    carries it)."""
    from sparsebalance.ops import loss as loss_module

    installed = loss_module.liger_available
    loss_module.liger_available = lambda: True
    try:
        return resolve_loss("auto", CUDA, uniform_weights)
    finally:
        loss_module.liger_available = installed


def model_on_device(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` on the stand-in device with its tied head still tied (``Module.to`` makes one new
    parameter per module when moving to ``meta``: the head and the embedding would part)."""
    model.to(DEVICE)
    head = model.get_output_embeddings()
    if model.config.tie_word_embeddings and isinstance(head, torch.nn.Linear):
        head.weight = model.get_input_embeddings().weight
    return model


def to_device(batch: dict) -> dict:
    """A batch's tensors on the stand-in device (what a trainer's input preparation does)."""
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
