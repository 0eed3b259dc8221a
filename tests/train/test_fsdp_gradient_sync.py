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
    "over, resolved",
    [
        ({"parallel": "fsdp2"}, "micro-batch"),
        ({"parallel": "fsdp2", "fsdp_gradient_sync": "step"}, "step"),
        ({"parallel": "fsdp2", "pp": 2}, "step"),
        ({"parallel": "ddp"}, None),
    ],
)
def test_fsdp2_reduce_scatters_every_micro_batch_by_default(tmp_path, over, resolved):
    """Unset, the choice resolves per layout and is saved resolved (what runs is what is saved)."""
    cfg = base_config(tmp_path, **over)
    assert cfg.fsdp_gradient_sync == resolved
    assert cfg.fsdp_sync_every_micro_batch is (resolved == "micro-batch")
    assert _memory_config(cfg, 4, None).reduce_every is (resolved == "micro-batch")


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
    # at a backward's end the whole gradients are freed after their reduce-scatter: a later
    # micro-batch ends as the first does (its held gradients are the shards the end holds anyway)
    tiny = (mem.breakdown(128, one), mem.breakdown(128, replace(one, micro_batches=2, reduce_every=True)))
    assert [b["moment"] for b in tiny] == ["end", "end"]
    assert tiny[1]["peak"] == pytest.approx(tiny[0]["peak"])


def _grads_after_each_pass(trainer, rank: int) -> dict:
    """One step, noting after every pass whether every parameter holds a (sharded) gradient,
    and every local gradient shard just before the optimizer steps."""
    seen, final = [], []
    real = Parallelized.microbatch

    @contextlib.contextmanager
    def spy(self, index, passes):
        with real(self, index, passes):
            yield
        grads = [p.grad for p in self.model.parameters()]
        local = [g.to_local() for g in grads if g is not None]
        seen.append((index, passes, all(g is not None for g in grads), sum(t.numel() for t in local)))

    step = trainer.optimizer.step

    def record(*args, **kwargs):
        final.extend(p.grad.to_local().clone() for p in trainer.model.parameters())
        return step(*args, **kwargs)

    counts = []
    real_passes = Parallelized.passes

    def passes(self, mine, most):
        counts.append((mine, most))
        return real_passes(self, mine, most)

    Parallelized.microbatch, Parallelized.passes = spy, passes
    trainer.optimizer.step = record
    try:
        trainer.run_step()
    finally:
        Parallelized.microbatch, Parallelized.passes = real, real_passes
    numel = sum(p.to_local().numel() for p in trainer.model.parameters())
    return {"seen": seen, "local_numel": numel, "grads": final, "counts": counts}


def test_fsdp2_reduce_scatters_after_the_passes_it_says_and_sums_the_same(tmp_path):
    """Every pass (micro-batch) leaves sharded gradients behind with ``micro-batch``; with
    ``step`` the earlier passes leave none (they accumulate unsharded inside FSDP2). Both reach
    the optimizer with the same gradient shards, within rounding, filler passes included (3
    documents on 2 ranks: the lighter rank runs zero-weight passes)."""
    runs = {}
    for sync in ("micro-batch", "step"):
        (tmp_path / sync).mkdir()
        cfg = base_config(
            tmp_path / sync, parallel="fsdp2", fsdp_gradient_sync=sync, steps=1, capacity=96, global_batch=3
        )
        runs[sync] = run_trainers(_grads_after_each_pass, cfg, 2, tmp_path / sync)
        for res in runs[sync]:
            seen = res["seen"]
            assert len(seen) >= 2  # several micro-batches in the step
            for index, passes, has_grads, numel in seen:
                reduced = sync == "micro-batch" or index == passes - 1
                assert has_grads is reduced
                assert numel == (res["local_numel"] if reduced else 0)  # sharded: the local shards
    # a filler pass ran: one rank had fewer micro-batches than the busiest
    assert any(mine < most for res in runs["micro-batch"] for mine, most in res["counts"])
    for every, once in zip(runs["micro-batch"], runs["step"], strict=True):
        assert len(every["grads"]) == len(once["grads"]) > 0
        for a, b in zip(every["grads"], once["grads"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


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


def test_memory_and_plan_take_the_sync_as_train_does(tmp_path, capsys):
    """``memory --pp`` refuses ``micro-batch`` as ``train`` does; ``plan --capacity auto
    --parallel fsdp2`` sizes C larger when the gradients are reduce-scattered every micro-batch."""
    import json

    from sparsebalance.cli import main

    args = ["memory", "--model", "qwen2.5-3b", "--analytic", "a100", "--devices", "8", "--pp", "2"]
    assert main([*args, "--fsdp-gradient-sync", "micro-batch"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "use --fsdp-gradient-sync step" in err[0]
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(["4096"] * 32))
    caps = {}
    for sync in ("micro-batch", "step"):
        plan = ["plan", "--lengths", str(lengths), "--world-size", "32", "--capacity", "auto"]
        plan += ["--model", "qwen2.5-3b", "--accelerator", "a100", "--parallel", "fsdp2", "--json"]
        assert main([*plan, "--fsdp-gradient-sync", sync]) == 0
        caps[sync] = json.loads(capsys.readouterr().out)["capacity"]
    assert caps["micro-batch"] > caps["step"]
