"""Run the real Trainer in N gloo processes (mp.spawn, file:// rendezvous) and collect results."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparsebalance.engine.runtime import Runtime
from sparsebalance.latency import analytic_profile
from sparsebalance.models import load_shapes
from sparsebalance.ops.flex_config import CUDA_TILE
from sparsebalance.train import TrainConfig, Trainer
from sparsebalance.tuning import DSTConfig

MEMORISABLE = [
    "The passkey is 4821. Remember it. The passkey is 4821.",
    "Alice keeps the red key in the blue box under the old oak table.",
    "one two three four five six seven eight nine ten eleven twelve",
    "Variable X = 17. Variable Y = X. Variable Z = Y. Therefore Z equals 17.",
] * 8


def write_dataset(tmp: Path) -> Path:
    path = tmp / "data.jsonl"
    path.write_text("".join(json.dumps({"text": t * 4}) + "\n" for t in MEMORISABLE))
    return path


def write_profile(tmp: Path) -> Path:
    path = tmp / "profile.json"
    analytic_profile(load_shapes("tiny"), "h100", block_size=32).save(path)
    return path


def base_config(tmp: Path, device: str = "cpu", **over) -> TrainConfig:
    """The harness's small run, built for ``device`` from the start (never ``auto``): CPU-tier
    tests run on the CPU whatever the machine has (block 32, which CUDA's flex would refuse);
    ``device="cuda"`` (the gpu tier) starts from CUDA's block of 128. ``over`` replaces fields."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"base_config: device must be cpu or cuda (explicit), got {device!r}")
    fields = dict(
        data=str(write_dataset(tmp)),
        profile=str(write_profile(tmp)),
        out=str(tmp / "run"),
        steps=6,
        global_batch=8,
        capacity=512,
        device=device,
        block_size=32 if device == "cpu" else CUDA_TILE,
        lr=3e-3,
        warmup_steps=0,
        schedule="constant",
        deterministic=True,
        # the user's default (top-k, bidirectional, p = 0.1, decided on the device off the CPU),
        # its budget scaled to these 48-93-token documents: k = 1 block, cut to 0
        dst=DSTConfig(budget_tokens=32),
    )
    return TrainConfig(**{**fields, **over})


def _run(trainer: Trainer, rank: int) -> dict:
    """:func:`run_ranks`'s body: the whole run, and a digest of the final weights."""
    result = trainer.run()
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in trainer.model.parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in full])
    result["param_sum"] = float(flat.double().sum())
    result["param_first"] = flat[:64].tolist()
    return result


def _trainer_worker(rank: int, body, world: int, tmp: str, cfg: TrainConfig, name: str) -> None:
    out = Path(tmp) / f"{name}-{rank}.pkl"
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=world)
        torch.set_num_threads(1)
        result = body(Trainer(cfg, Runtime(rank, world, torch.device("cpu"))), rank)
        dist.destroy_process_group()
    except BaseException:  # report every failure to the test process
        result = {"error": traceback.format_exc()}
    out.write_bytes(pickle.dumps(result))


def run_trainers(body, cfg: TrainConfig, world: int, tmp: Path, name: str = "result") -> list[dict]:
    """A :class:`Trainer` of ``cfg`` on each of ``world`` gloo processes, then ``body(trainer,
    rank) -> dict`` there (a module-level function: spawn pickles it by name); every rank's dict,
    or an ``AssertionError`` with the failed rank's traceback."""
    rdzv = tmp / "rdzv"
    if rdzv.exists():
        os.remove(rdzv)
    mp.spawn(_trainer_worker, args=(body, world, str(tmp), cfg, name), nprocs=world, join=True)
    results = [pickle.loads((tmp / f"{name}-{r}.pkl").read_bytes()) for r in range(world)]
    for r, res in enumerate(results):
        if "error" in res:
            raise AssertionError(f"rank {r} failed:\n{res['error']}")
    return results


def run_ranks(cfg: TrainConfig, world: int, tmp: Path) -> list[dict]:
    """Run the trainer on ``world`` processes; raise with the worker traceback on failure."""
    return run_trainers(_run, cfg, world, tmp)


def rewind(run: Path, into: Path, step: int, drop: int) -> Path:
    """A run folder ``into/run`` that resumes from ``step``: a copy of ``run``'s checkpoints with
    step ``drop`` (a later one, which a resume would take) removed and ``latest`` at ``step``;
    returns ``into/run``."""
    into.mkdir(exist_ok=True)
    ckpt = into / "run" / "checkpoints"
    shutil.copytree(run / "checkpoints", ckpt)
    shutil.rmtree(ckpt / f"step-{drop:06d}")
    (ckpt / "latest").write_text(f"step-{step:06d}\n")
    return into / "run"


def matches_one_process(tmp: Path, name: str, cfg_of, **pipeline) -> tuple[Path, Path, list[dict]]:
    """``cfg_of(folder)`` on one process against ``cfg_of(folder, **pipeline)`` on two (a pipeline
    of two stages; both runs of 3 steps, checkpointed at the last): the per-step losses within 1e-5,
    both stages' alike, and the weights after 3 steps within 1e-5, every stage's parameters (the
    tied head included). Returns the one-process folder, the pipeline's, and its results."""
    from sparsebalance.train.checkpoint import load_weights

    one, two = tmp / "pp1", tmp / name
    one.mkdir(), two.mkdir()
    ref = run_ranks(cfg_of(one), 1, one)
    got = run_ranks(cfg_of(two, **pipeline), 2, two)
    assert got[0]["losses"] == pytest.approx(ref[0]["losses"], rel=1e-5, abs=1e-5)
    assert got[1]["losses"] == got[0]["losses"]
    want, have = (load_weights(d / "run" / "checkpoints" / "step-000003") for d in (one, two))
    assert sorted(have) == sorted(want)
    # weights after 3 AdamW steps: Adam divides by the gradients' size, so a gradient that is 0 in
    # exact arithmetic (a key bias: softmax ignores a shift) is rounding noise scaled up to ~lr
    for key, tensor in want.items():
        torch.testing.assert_close(have[key], tensor, rtol=1e-5, atol=1e-5, msg=key)
    return one, two, got
