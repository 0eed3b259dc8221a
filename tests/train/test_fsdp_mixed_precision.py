"""Issue 53, item 2: FSDP2 gathers the parameters in the run's compute dtype and reduce-scatters
the gradients in float32 (``MixedPrecisionPolicy``): under ``--precision bf16`` every all-gather
moves half the bytes, the master weights, their gradients and the optimizer state stay float32.
Before, every all-gather and reduce-scatter moved float32 (``engine/parallelize.py``)."""

from __future__ import annotations

import pytest
import torch

from sparsebalance.engine.parallelize import mixed_precision
from sparsebalance.precision import Precision

from .harness import base_config, run_trainers


@pytest.mark.parametrize(
    "precision, gathered",
    [(Precision("bf16", "cuda"), torch.bfloat16), (Precision("fp16", "cuda"), torch.float16), (None, None)],
)
def test_the_policy_gathers_in_the_compute_dtype_and_reduces_in_float32(precision, gathered):
    policy = mixed_precision(precision)
    assert policy.param_dtype is gathered and policy.reduce_dtype is torch.float32
    assert mixed_precision(Precision("fp32", "cuda")).param_dtype is None


def _dtypes_in_a_step(trainer, rank: int) -> dict:
    """The dtype of a decoder layer's weight while the layer computes (gathered), and of the
    sharded parameters and gradients the optimizer steps."""
    seen, grads = [], []
    layer = trainer.model.get_decoder().layers[0]  # FSDP2 renames its class: found by place
    layer.self_attn.q_proj.register_forward_hook(lambda m, args, out: seen.append(str(m.weight.dtype)))
    params = list(trainer.model.parameters())
    step = trainer.optimizer.step

    def record(*args, **kwargs):  # the gradients the optimizer steps with (zeroed after it)
        grads.extend(str(p.grad.to_local().dtype) for p in params if p.grad is not None)
        return step(*args, **kwargs)

    trainer.optimizer.step = record
    trainer.run_step()
    return {
        "gathered": sorted(set(seen)),
        "params": sorted({str(p.to_local().dtype) for p in params}),
        "grads": sorted(set(grads)),
    }


@pytest.mark.distributed
def test_fsdp2_under_bf16_gathers_bf16_and_keeps_float32_shards(tmp_path):
    cfg = base_config(tmp_path, parallel="fsdp2", precision="bf16", steps=1, capacity=96, global_batch=2)
    for res in run_trainers(_dtypes_in_a_step, cfg, 2, tmp_path):
        assert res["gathered"] == ["torch.bfloat16"]
        assert res["params"] == res["grads"] == ["torch.float32"]
