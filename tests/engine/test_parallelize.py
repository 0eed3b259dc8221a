"""The parallelism seam: decoder layers found through ``_no_split_modules`` (Qwen2, Llama,
Mistral built offline), and how a step's passes and syncs are planned per mode."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sparsebalance.engine.parallelize import Parallelized, decoder_layers, parallelize
from sparsebalance.engine.runtime import Runtime

SMALL = dict(
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=64,
    vocab_size=128,
    max_position_embeddings=256,
)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_decoder_layers_are_found_by_no_split_modules(family):
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **SMALL))
    layers = decoder_layers(model)
    assert len(layers) == 3
    assert all(type(m).__name__ in model._no_split_modules for m in layers)
    assert layers == list(model.model.layers)  # the same blocks, found without the attribute path


def test_models_without_no_split_modules_are_refused():
    with pytest.raises(ValueError, match="_no_split_modules"):
        decoder_layers(nn.Linear(2, 2))
    net = nn.Sequential(nn.Linear(2, 2))
    net._no_split_modules = ["DecoderLayer"]
    with pytest.raises(ValueError, match="no module of"):
        decoder_layers(net)


def test_nested_blocks_are_wrapped_once():
    class Block(nn.Module):
        def __init__(self, inner: bool):
            super().__init__()
            self.inner = Block(False) if inner else nn.Linear(2, 2)

    net = nn.Sequential(Block(True), Block(True))
    net._no_split_modules = ["Block"]
    assert decoder_layers(net) == [net[0], net[1]]


def test_single_process_is_left_alone_and_bad_flags_name_themselves():
    model = nn.Linear(2, 2)
    par = parallelize(model, Runtime(0, 1, torch.device("cpu")), "ddp", "overlap")
    assert par.model is model and par.module is model and par.kind == "single"
    assert not par.exact and not par.sharded and par.ready_time() is None
    assert par.passes(0, 3) == 0 and par.passes(2, 3) == 2
    with pytest.raises(ValueError, match="--parallel"):
        parallelize(model, Runtime(0, 1, torch.device("cpu")), "zero3", "overlap")
    with pytest.raises(ValueError, match="--measure-bubble"):
        parallelize(model, Runtime(0, 1, torch.device("cpu")), "ddp", "roughly")
    with pytest.raises(ValueError, match="--nproc"):
        parallelize(model, Runtime(0, 1, torch.device("cpu")), "fsdp2", "overlap")


@pytest.mark.parametrize(
    ("kind", "mode", "mine", "most", "passes"),
    [
        ("ddp", "overlap", 0, 3, 1),  # an empty rank still joins the one synced backward
        ("ddp", "overlap", 2, 3, 2),  # uneven counts: each rank syncs in its own last pass
        ("ddp", "exact", 0, 3, 0),  # no sync in any backward: the all-reduce comes after
        ("fsdp2", "overlap", 1, 3, 3),  # FSDP2 gathers parameters in every pass
        ("fsdp2", "exact", 0, 2, 2),
    ],
)
def test_passes(kind, mode, mine, most, passes):
    par = Parallelized(nn.Linear(2, 2), nn.Linear(2, 2), kind, mode, world_size=2)
    assert par.passes(mine, most) == passes
    assert par.exact == (mode == "exact")
