"""A checkpoint saved before the optimizer's first step (step 0, or every step so far skipped as
non-finite) changes nothing: torch's state-dict functions create a missing optimizer state by
stepping at learning rate 0 (AdamW: ``step`` 1 and zero moments, so the next real step would be
bias-corrected as the second); the live optimizer, the saved state and a resumed optimizer must
all stay without state (``train/checkpoint.py``, ``train/pipeline_checkpoint.py``)."""

from __future__ import annotations

import pickle
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparsebalance.engine.runtime import Runtime
from sparsebalance.train.checkpoint import load_checkpoint, save_checkpoint


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    return (model, *_optimizer(model))


def _optimizer(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def _step(model, opt, seed: int) -> None:
    """One optimizer step with gradients drawn from ``seed`` (the same for every copy of the model)."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _state(opt) -> dict:
    """The optimizer's per-parameter state, by position (tensors cloned)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    return {i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(params) if p in opt.state}


def _save(run: Path, model, opt, sched, step: int) -> Path:
    return save_checkpoint(run, step, model, opt, sched, {"step": step, "config": {"model": "m"}}, [], True)


@pytest.mark.parametrize("steps", [0, 1], ids=["no-step-yet", "after-a-step"])
def test_a_checkpoint_saved_before_any_optimizer_step_changes_nothing(tmp_path, steps):
    """Saving leaves the live optimizer's state as it was (none before the first step); the saved
    optimizer state is empty then; resuming and taking one step gives the parameters one step
    without any checkpoint gives."""
    model, opt, sched = _model()
    reference, ref_opt, _ = _model()
    for s in range(steps):
        _step(model, opt, s)
        _step(reference, ref_opt, s)
    before = _state(opt)
    ckpt = _save(tmp_path / "run", model, opt, sched, steps)
    torch.testing.assert_close(_state(opt), before, rtol=0, atol=0)
    assert len(opt.state) == (0 if steps == 0 else 4)
    saved = torch.load(ckpt / "state.pt", weights_only=True)["optimizer"]
    assert (saved["state"] == {}) == (steps == 0)

    _step(reference, ref_opt, steps)
    want = _params(reference)
    _step(model, opt, steps)  # the run that saved goes on
    _assert_same(_params(model), want)

    resumed, res_opt, res_sched = _model()
    load_checkpoint(ckpt, resumed, res_opt, res_sched)
    torch.testing.assert_close(_state(res_opt), before, rtol=0, atol=0)
    _step(resumed, res_opt, steps)
    _assert_same(_params(resumed), want)


def _stage():
    from sparsebalance.engine.stage import PipelineLayout, StageModel
    from sparsebalance.models.hf import build_model

    stage = StageModel(build_model("tiny", "cpu", torch.float32, seed=0), PipelineLayout.of(0, 1, 1))
    return (stage, *_optimizer(stage))


def test_a_pipeline_checkpoint_saved_before_any_optimizer_step_changes_nothing(tmp_path):
    """The same through the pipeline save and load (one stage, one process: the load gathers the
    stages' parameter names over a process group, here a gloo group of one)."""
    from sparsebalance.train.pipeline_checkpoint import load_pipeline_checkpoint, save_pipeline_checkpoint

    stage, opt, sched = _stage()
    reference, ref_opt, _ = _stage()
    rt = Runtime(0, 1, torch.device("cpu"))
    ckpt = save_pipeline_checkpoint(stage, rt, tmp_path / "run", 0, None, opt, sched, {"step": 0}, [], True)
    assert len(opt.state) == 0
    saved = torch.load(ckpt / "optim-stage-00000.pt", weights_only=True)  # the stage's own file
    assert saved["state"] == {}

    _step(reference, ref_opt, 0)
    want = _params(reference)
    _step(stage, opt, 0)
    _assert_same(_params(stage), want)

    resumed, res_opt, res_sched = _stage()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        load_pipeline_checkpoint(ckpt, resumed, res_opt, res_sched, rt)
    finally:
        dist.destroy_process_group()
    assert len(res_opt.state) == 0
    _step(resumed, res_opt, 0)
    _assert_same(_params(resumed), want)


def _load_on_ranks(rank: int, world: int, tmp: str) -> None:
    """Rank 0 alone reads the checkpoint and broadcasts it (:func:`load_checkpoint` on 2 ranks)."""
    out = Path(tmp) / f"result-{rank}.pkl"
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=world)
        torch.set_num_threads(1)
        model, opt, sched = _model()
        load_checkpoint(Path(tmp) / "run" / "checkpoints" / "step-000000", model, opt, sched, runtime=_rt(rank, world))
        states = len(opt.state)
        _step(model, opt, 0)
        dist.destroy_process_group()
        result = {"states": states, "params": _params(model)}
    except BaseException:
        result = {"error": traceback.format_exc()}
    out.write_bytes(pickle.dumps(result))


def _rt(rank: int, world: int) -> Runtime:
    return Runtime(rank, world, torch.device("cpu"))


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_checkpoint_without_optimizer_state_resumes_without_it_on_every_rank(tmp_path):
    """Only rank 0 reads the (empty) saved optimizer state: every rank's optimizer stays without
    state, and one step gives the parameters of one step without any checkpoint."""
    model, opt, sched = _model()
    _save(tmp_path / "run", model, opt, sched, 0)
    _step(model, opt, 0)
    world = 2
    mp.spawn(_load_on_ranks, args=(world, str(tmp_path)), nprocs=world, join=True)
    res = [pickle.loads((tmp_path / f"result-{r}.pkl").read_bytes()) for r in range(world)]
    errors = [f"rank {r}:\n{x['error']}" for r, x in enumerate(res) if "error" in x]
    assert not errors, "\n".join(errors)
    for r in res:
        assert r["states"] == 0
        _assert_same(r["params"], _params(model))
