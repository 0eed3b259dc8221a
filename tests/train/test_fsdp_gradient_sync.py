"""``--fsdp-gradient-sync``: FSDP2 reduce-scatters after every micro-batch (the default, sharded
gradients accumulate) or in a step's last backward only; the memory model and ``--capacity auto``
count what a later micro-batch then holds."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch

from sparsebalance.engine.parallelize import Parallelized
from sparsebalance.latency.memory import ANALYTIC, MemoryConfig, MemoryModel
from sparsebalance.models import load_shapes
from sparsebalance.train.build import _memory_config

from .harness import base_config, run_ranks, run_trainers


@pytest.mark.parametrize(
    "over, says",
    [
        ({"fsdp_gradient_sync": "never"}, "(--fsdp-gradient-sync) must be one of ('micro-batch', 'step')"),
        ({"fsdp_gradient_sync": "step"}, "(--fsdp-gradient-sync) is for --parallel fsdp2"),
        (
            {"parallel": "fsdp2", "pp": 2, "fsdp_gradient_sync": "micro-batch"},
            "reduce-scatters once a step; use --fsdp-gradient-sync step",
        ),
    ],
)
def test_bad_settings_are_refused_in_one_line(tmp_path, over, says):
    with pytest.raises(ValueError, match=r".*") as err:
        base_config(tmp_path, **over)
    assert says in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "over, every",
    [
        ({"parallel": "fsdp2"}, True),
        ({"parallel": "fsdp2", "fsdp_gradient_sync": "step"}, False),
        ({"parallel": "fsdp2", "pp": 2}, False),
        ({"parallel": "ddp"}, False),
    ],
)
def test_fsdp2_reduce_scatters_every_micro_batch_by_default(tmp_path, over, every):
    cfg = base_config(tmp_path, **over)
    assert cfg.fsdp_sync_every_micro_batch is every
    assert _memory_config(cfg, 4, None).reduce_every is (every and cfg.pp == 1)


def test_a_later_micro_batch_holds_sharded_gradients_when_fsdp2_reduces_each():
    """Reduce-scattering every micro-batch, a later one holds 1/N of the gradients, not all."""
    shapes = load_shapes("qwen2.5-3b")
    mem = MemoryModel(shapes, ANALYTIC["h200"])
    n = 8
    one = MemoryConfig("full", "chunked", shard=n, block_size=128)
    first = mem.breakdown(65536, one)
    whole = mem.breakdown(65536, replace(one, micro_batches=2))
    sharded = mem.breakdown(65536, replace(one, micro_batches=2, reduce_every=True))
    grads = mem.num_params() * ANALYTIC["h200"].grad_bytes
    assert whole["peak"] - first["peak"] == pytest.approx(grads)
    assert sharded["peak"] - first["peak"] == pytest.approx(grads / n)


def _grads_after_each_pass(trainer, rank: int) -> dict:
    """One step, noting after every pass whether every parameter holds a (sharded) gradient."""
    seen = []
    real = Parallelized.microbatch

    @contextlib.contextmanager
    def spy(self, index, passes):
        with real(self, index, passes):
            yield
        grads = [p.grad for p in self.model.parameters()]
        local = [g.to_local() for g in grads if g is not None]
        seen.append((index, passes, all(g is not None for g in grads), sum(t.numel() for t in local)))

    Parallelized.microbatch = spy
    try:
        trainer.run_step()
    finally:
        Parallelized.microbatch = real
    numel = sum(p.to_local().numel() for p in trainer.model.parameters())
    return {"seen": seen, "local_numel": numel}


@pytest.mark.parametrize("sync", ["micro-batch", "step"])
def test_fsdp2_reduce_scatters_after_the_passes_it_says(tmp_path, sync):
    """Every pass (micro-batch) leaves sharded gradients behind with ``micro-batch``; with
    ``step`` the earlier passes leave none (they accumulate unsharded inside FSDP2)."""
    cfg = base_config(tmp_path, parallel="fsdp2", fsdp_gradient_sync=sync, steps=1, capacity=128)
    for res in run_trainers(_grads_after_each_pass, cfg, 2, tmp_path):
        seen = res["seen"]
        assert len(seen) >= 2  # several micro-batches in the step
        for index, passes, has_grads, numel in seen:
            reduced = sync == "micro-batch" or index == passes - 1
            assert has_grads is reduced
            assert numel == (res["local_numel"] if reduced else 0)  # sharded: the local shards


@pytest.mark.slow
def test_both_syncs_train_the_same_model(tmp_path):
    """The same sums in another order: the same losses and weights within rounding."""
    runs = {}
    for sync in ("micro-batch", "step"):
        (tmp_path / sync).mkdir()
        cfg = base_config(tmp_path / sync, parallel="fsdp2", fsdp_gradient_sync=sync, steps=3, capacity=128)
        runs[sync] = run_ranks(cfg, 2, tmp_path / sync)
    every, once = runs["micro-batch"][0], runs["step"][0]
    assert every["losses"] == pytest.approx(once["losses"], rel=1e-5)
    assert every["param_first"] == pytest.approx(once["param_first"], rel=1e-4, abs=1e-6)
    assert torch.isfinite(torch.tensor(every["param_sum"]))


def test_the_memory_command_counts_either_sync(capsys):
    """``sparsebalance memory --check``: a later micro-batch over 32 devices holds 1/32 of the
    gradients by default, all of them with ``--fsdp-gradient-sync step``."""
    import json

    from sparsebalance.cli import main

    peaks = {}
    for sync in ("micro-batch", "step"):
        args = ["memory", "--model", "qwen2.5-3b", "--analytic", "a100", "--check", "524288", "--devices", "32"]
        assert main([*args, "--fsdp-gradient-sync", sync, "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)["rows"]
        peaks[sync] = next(r["peak GiB"] for r in rows if (r["checkpointing"], r["loss"]) == ("full", "chunked"))
    grads = MemoryModel(load_shapes("qwen2.5-3b"), ANALYTIC["a100"]).num_params() * 4 / 2**30
    assert peaks["step"] - peaks["micro-batch"] == pytest.approx(grads * (1 - 1 / 32), rel=1e-6)
