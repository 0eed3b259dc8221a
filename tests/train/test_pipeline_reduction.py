"""Issue 54, item 3, in the trainer at DP 2 x PP 2 (``--parallel ddp``): every gradient bucket
of every stage is all-reduced inside the stage's last backward of the step, and what the first
stage reduces after it is its embedding's rows of the step's tokens, not the embedding."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from sparsebalance.train import Trainer
from sparsebalance.tuning import DSTConfig
from tests.train.harness import base_config, run_trainers

OFF = DSTConfig(mode="off", budget="gamma", gamma0=0.9)


def _body(trainer: Trainer, rank: int) -> dict:
    executor = trainer.runner.executor
    grads = executor.gradients
    sizes, original = [], dist.all_reduce

    def spy(tensor, *args, **kwargs):
        sizes.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    armed, arm = [], grads.buckets.arm

    def arm_spy(params=None):  # buckets already launched when each chunk is armed
        armed.append(grads.buckets._next if grads.buckets._armed else 0)
        return arm(params)

    grads.buckets.arm = arm_spy
    steps = []
    for _ in range(trainer.cfg.steps):
        sizes.clear()
        armed.clear()
        dist.all_reduce = spy
        trainer.run_step()
        dist.all_reduce = original
        steps.append({"sizes": list(sizes), "launched": grads.buckets.launched_in_backward, "armed": list(armed)})
    embed = executor.stage.decoder.embed_tokens.weight if executor.stage.layout.first else None
    return {
        "stage": executor.stage.layout.stage,
        "buckets": [sum(p.numel() for p in b) for b in grads.buckets.buckets],
        "embedding": None if embed is None else embed.numel(),
        "hidden": trainer.model.config.hidden_size,
        "steps": steps,
    }


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("virtual", [1, 2])
def test_ddp_stages_reduce_inside_their_last_backward(tmp_path, virtual):
    """Interleaved (``--pp-virtual 2``): inside each chunk's last backward, its own buckets."""
    cfg = base_config(tmp_path, steps=2, strategy="sab", dst=OFF, pp=2, pp_virtual=virtual)
    results = run_trainers(_body, cfg, 4, tmp_path, "reduction")
    for r in results:
        for step in r["steps"]:
            assert step["launched"] == len(r["buckets"])  # none waited for the schedule's end
            assert len(step["armed"]) == virtual  # each chunk armed once, before its last backward
            if virtual > 1:  # the later chunk's buckets were launched before the first chunk's last backward
                assert step["armed"][-1] > 0, step
            big = [n for n in step["sizes"] if n > 1]  # not the norm's square or a flag
            assert big[: len(r["buckets"])] == r["buckets"]  # the buckets, in order
            rest = big[len(r["buckets"]) :]
            if r["embedding"] is not None:  # then the embedding's rows of the step's tokens
                (rows,) = rest
                assert rows % r["hidden"] == 0 and 0 < rows < r["embedding"]
                assert r["embedding"] not in r["buckets"]
            else:
                assert rest == []
