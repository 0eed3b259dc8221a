"""DDP's gradients are views of its all-reduce buckets (``gradient_as_bucket_view``), allocated
once and zeroed in place after each step: not a second copy of the model's gradients beside the
buckets, and not dropped and allocated again every step."""

from __future__ import annotations

import pytest

from sparsebalance.train import Trainer

from .harness import base_config, run_trainers


def _gradients_body(trainer: Trainer, rank: int) -> dict:
    trainer.run()
    grads = [p.grad for p in trainer.params]
    held = [g for g in grads if g is not None]
    return {
        "kept": trainer.par.keeps_gradients,
        "params": len(grads),
        "held": len(held),
        "zeroed": all(bool((g == 0).all()) for g in held),
        "storages": len({g.untyped_storage().data_ptr() for g in held}),
    }


@pytest.mark.distributed
def test_ddp_gradients_live_in_its_buckets(tmp_path):
    results = run_trainers(_gradients_body, base_config(tmp_path, steps=2, strategy="sab"), 2, tmp_path)
    for r in results:
        assert r["kept"] and r["held"] == r["params"] and r["zeroed"]  # zeroed in place, not dropped
        assert r["storages"] < r["params"] // 4  # views of a few buckets, not a tensor each
