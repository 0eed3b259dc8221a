"""Checkpoints of a pipeline run (``--pp P``): the same folder, files and guarantees as
:mod:`.checkpoint` (atomic, checksummed, a full disk one line), written by rank 0.

- ``model.pt``: the whole model's state dict, the stages' parameters assembled under the model's
  own names, so ``sparsebalance export``/``eval`` read a pipeline checkpoint as any other.
- ``state.pt``'s ``optimizer``: one optimizer state per stage, in stage order, keyed by parameter
  names (a stage's optimizer steps only its parameters; every data-parallel pipeline holds the
  same states, so the first pipeline's are saved; ``--parallel fsdp2`` stages gather their shards
  first, so ``ddp`` and ``fsdp2`` write the same files), and ``pipeline``: ``{"stages": P,
  "layers": [layers per stage]}``.

Resuming needs the same ``--pp`` (refused before launch otherwise: the optimizer states are
per stage); rank 0 reads the files and sends every rank its own stage's tensors only. The
objects travel point to point over ``group`` (on CUDA a gloo group: NCCL would stage every pickle
in device memory). Rank 0 holds the whole model and its optimizer states while saving and loading
(a host-memory limit for models much larger than one stage: docs/pipeline.md); every other rank
holds its stage's.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor

from ..batching.schedule import stage_layers
from ..engine.runtime import Runtime
from ..engine.stage import StageModel
from .checkpoint import KEEP_LAST, _load, commit_checkpoint, plain
from .optimizer_state import load_optimizer_state_dict, optimizer_state_dict


def save_pipeline_checkpoint(
    stage: StageModel,
    rt: Runtime,
    run_dir: Path,
    step: int,
    model,
    optimizer,
    scheduler,
    trainer_state: dict,
    rng_states: list,
    is_main: bool,
    keep_last: int = KEEP_LAST,
    group=None,
) -> Path | None:
    """Collective: every stage of the first pipeline sends rank 0 its parameters and optimizer
    state (``group``: for these objects; None: the default group); rank 0 writes them (``model``:
    unused, the stage holds it; the signature is :func:`.checkpoint.save_checkpoint`'s)."""
    layout = stage.layout
    mine = None
    if layout.dp == 0 or stage.sharded:  # FSDP2: every peer takes part in the gathers
        mine = (stage.state_dict_owned(), _optimizer_state(stage, optimizer))
    if layout.dp == 0 and layout.stage > 0:
        dist.send_object_list([mine], dst=0, group=group)
    model_sd, state = {}, None
    if is_main:
        stages = [mine]
        for s in range(1, layout.stages):
            box = [None]
            dist.recv_object_list(box, src=layout.rank(0, s), group=group)
            stages.append(box[0])
        for sd, _ in stages:
            model_sd.update(sd)  # a tied embedding is in two stages: the same values
        state = {
            "optimizer": [opt for _, opt in stages],
            "pipeline": {"stages": layout.stages, "layers": list(stage.split)},
            "scheduler": plain(scheduler.state_dict()),
            "rng": plain(rng_states),
            "trainer": plain(trainer_state),
        }
    return commit_checkpoint(Path(run_dir), step, model_sd, state, is_main, keep_last)


def load_pipeline_checkpoint(path: Path, stage: StageModel, optimizer, scheduler, rt: Runtime, group=None) -> dict:
    """Restore this rank's stage, its optimizer and the scheduler from checkpoint ``path``
    (verified on rank 0), rank 0 sending every rank its stage's part over ``group``; the saved
    ``state`` without the optimizers'."""
    layout = stage.layout
    names = [None] * rt.world_size if rt.is_main else None  # each rank's parameters, by name
    dist.gather_object(stage.names, names, dst=0, group=group)
    model_sd, state, error = None, None, None
    if rt.is_main:
        model_sd, state, error = _read(Path(path), stage)
        error = error or _missing(path, model_sd, names, layout)
    error = rt.broadcast_object(error)  # rank 0's refusal, said by every rank
    if error is not None:
        raise ValueError(error)
    if rt.is_main:
        optimizers = state.pop("optimizer")
        for rank in range(1, rt.world_size):  # its stage's part only, one rank at a time
            there = rank % layout.stages  # world rank r is stage r % P (PipelineLayout)
            part = ({n: model_sd[n] for n in names[rank]}, {**state, "optimizer": optimizers[there]})
            dist.send_object_list([part], dst=rank, group=group)
        model_sd, state = {n: model_sd[n] for n in stage.names}, {**state, "optimizer": optimizers[layout.stage]}
    else:
        box = [None]
        dist.recv_object_list(box, src=0, group=group)
        model_sd, state = box[0]
    # full tensors in, each FSDP2 peer keeping its shard; names as the stage's (``model.`` + the model's)
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(stage, {f"model.{n}": model_sd[n] for n in stage.names}, options=options)
    optim_sd = state.pop("optimizer")
    load_optimizer_state_dict(stage, optimizer, optim_sd, options, unstepped=not optim_sd["state"])
    scheduler.load_state_dict(state["scheduler"])
    return state


def _missing(path: Path, model_sd: dict, names: list[list[str]], layout) -> str | None:
    """The line refusing a checkpoint that lacks a parameter some rank's stage holds."""
    for rank, mine in enumerate(names):
        missing = [n for n in mine if n not in model_sd]
        if missing:
            stage = rank % layout.stages
            return f"--resume: {path} lacks {len(missing)} parameters of stage {stage} ({missing[0]}, ...)"
    return None


def _optimizer_state(stage: StageModel, optimizer) -> dict:
    """The stage's optimizer state keyed by parameter names, full tensors on the CPU: one format
    for ``ddp`` and ``fsdp2`` stages. FSDP2's shards are gathered one tensor at a time (a
    collective over the stage's peers, in the state's order), each moved to the CPU before the
    next, so no device ever holds the stage's whole optimizer state."""
    return _on_cpu(optimizer_state_dict(stage, optimizer, StateDictOptions(full_state_dict=False)))


def _on_cpu(obj):
    if isinstance(obj, DTensor):
        return obj.full_tensor().cpu()
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _on_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_on_cpu(v) for v in obj)
    return obj


def _read(path: Path, stage: StageModel) -> tuple[dict | None, dict | None, str | None]:
    """Rank 0: the checkpoint's model and state, or the line refusing it for this pipeline."""
    layout = stage.layout
    model_sd = _load(path / "model.pt")
    state = _load(path / "state.pt")
    pipeline = state.pop("pipeline", {})
    saved = pipeline.get("stages", 1)
    if saved != layout.stages:
        return None, None, f"--resume: {path} was saved with --pp {saved}; resume it with --pp {saved}"
    # checkpoints from before the balanced split record no layers: theirs was the even split
    layers = tuple(pipeline.get("layers", stage_layers(sum(stage.split), saved).tolist()))
    if layers != stage.split:
        return (
            None,
            None,
            (
                f"--resume: {path} split the layers {list(layers)} over its stages, this version splits them "
                f"{list(stage.split)} (its optimizer states are per stage): resume it with the version that "
                "wrote it, or start afresh"
            ),
        )
    if any(isinstance(k, int) for opt in state.get("optimizer", ()) for k in opt["state"]):
        return (
            None,
            None,
            (
                f"--resume: {path} is a pipeline checkpoint of an earlier development build (its optimizer "
                "states are by index, not by name): start afresh, or `sparsebalance export` its weights"
            ),
        )
    return model_sd, state, None
