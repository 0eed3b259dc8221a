"""Issue 54, item 3, in the trainer at DP 2 x PP 2 (``--parallel ddp``): every gradient bucket
of every stage is all-reduced inside the stage's last backward of the step, and what the first
stage reduces after it is its embedding's rows of the step's tokens, not the embedding. With
``--parallel fsdp2 --pp-virtual 2``: every FSDP unit reduce-scatters inside its chunk's last
backward, and an empty pipeline issues its peer's reduce-scatters in the same order."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.tensor import DTensor

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


def _fsdp_body(trainer: Trainer, rank: int) -> dict:
    """Per step: each reduce-scatter's (and all-gather's) input size, and the backward it ran in
    (its index in the step's backwards, or None outside them); the chunk of each backward; the
    units per chunk."""
    executor, stage = trainer.runner.executor, trainer.stage
    names = [n for n in ("reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, n)]
    gathers = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    originals = {n: getattr(dist, n) for n in names + gathers}
    calls, gathered, backwards, current = [], [], [], [None]
    backward = executor._backward

    def in_backward(m, c, *args, **kwargs):
        current[0] = len(backwards)
        backwards.append(c)
        try:
            return backward(m, c, *args, **kwargs)
        finally:
            current[0] = None

    def counting(name):
        def call(output, input, *args, **kwargs):  # what FSDP2 calls, looked up at each call
            (calls if name in names else gathered).append((input.numel(), current[0]))
            return originals[name](output, input, *args, **kwargs)

        return call

    executor._backward = in_backward
    steps = []
    for _ in range(trainer.cfg.steps):
        calls.clear(), gathered.clear(), backwards.clear()
        for n in originals:
            setattr(dist, n, counting(n))
        trainer.run_step()
        for n, fn in originals.items():
            setattr(dist, n, fn)
        steps.append({"calls": list(calls), "gathers": list(gathered), "backwards": list(backwards)})
    layer_params = {id(p) for layer in stage.layers for p in layer.parameters()}
    own = any(id(p) not in layer_params for p in stage.parameters())  # embedding, norm or head
    held = stage.layout.virtual - 1 if stage.layout.last else 0  # the chunk running the norm and head, or embedding
    units = [len(span) + (own and c == held) for c, span in enumerate(stage.chunk_spans)]
    sharded = all(isinstance(p, DTensor) for p in stage.parameters_owned())
    return {"stage": stage.layout.stage, "dp": stage.layout.dp, "units": units, "steps": steps, "sharded": sharded}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("strategy, capacity", [("sab", 128), ("lbb", 4096)])
def test_fsdp2_chunks_reduce_scatter_in_their_own_last_backward(tmp_path, strategy, capacity):
    """``--parallel fsdp2 --pp-virtual 2`` at DP 2 x PP 2: each FSDP unit reduce-scatters once a
    step, inside the last backward of the chunk it belongs to (the stage's own unit, embedding or
    norm and head, in the chunk running them), not at the stage's last backward; a pipeline without
    micro-batches (LBB's one bucket of 4,096 leaves pipeline 1 empty) issues the same reduce-scatters
    in the same order as its peer."""
    cfg = base_config(
        tmp_path, steps=2, strategy=strategy, capacity=capacity, dst=OFF, pp=2, pp_virtual=2, parallel="fsdp2"
    )
    results = run_trainers(_fsdp_body, cfg, 4, tmp_path, "fsdp-reduction")
    for r in results:
        # the tiny model's 4 layers, one a chunk; the own unit on the embedding's chunk 0 (stage 0), the head's 1
        assert r["sharded"] and r["units"] == ([2, 1] if r["stage"] == 0 else [1, 2])
        for step in r["steps"]:
            assert len(step["calls"]) == sum(r["units"])  # once a step each
            # and all-gathered once, before the schedule: no backward's prefetch gathers a unit again
            assert len(step["gathers"]) == sum(r["units"]) and all(where is None for _, where in step["gathers"])
            if not step["backwards"]:  # an empty pipeline: after its schedule, per chunk
                assert all(where is None for _, where in step["calls"])
                continue
            last = {c: i for i, c in enumerate(step["backwards"])}  # each chunk's last backward
            assert last[1] < last[0]  # the later chunk's comes first
            per_backward = {i: sum(where == i for _, where in step["calls"]) for i in range(len(step["backwards"]))}
            assert per_backward == {
                i: (r["units"][step["backwards"][i]] if last[step["backwards"][i]] == i else 0) for i in per_backward
            }
    for a, b in ((0, 2), (1, 3)):  # stage s of pipeline 0 and of pipeline 1: the same tensors in turn
        for x, y in zip(results[a]["steps"], results[b]["steps"], strict=True):
            assert [n for n, _ in x["calls"]] == [n for n, _ in y["calls"]]
    if strategy == "lbb":
        assert all(not s["backwards"] for s in results[2]["steps"])
    else:  # 128 tokens: several micro-batches a pipeline, so a chunk's last backward is not its first
        assert all(len(s["backwards"]) > 2 for r in results for s in r["steps"])
