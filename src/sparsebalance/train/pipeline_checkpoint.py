"""Checkpoints of a pipeline run (``--pp P``): the same folder, shared files and guarantees as
:mod:`.checkpoint` (atomic, checksummed, a full disk one line, the newest ``keep_last`` kept),
each stage's tensors written and read by that stage's ranks only (:mod:`.shards`).

- ``model-stage-0000s.pt``: stage ``s``'s parameters under the whole model's names (a tied
  embedding in both stages that use it), and ``optim-stage-0000s.pt``: its optimizer state keyed
  by parameter names. Written by stage ``s`` of the first pipeline (every data-parallel pipeline
  holds the same; ``--parallel fsdp2`` stages gather their shards to it first, so ``ddp`` and
  ``fsdp2`` write the same files). ``sparsebalance eval`` merges the stages' model files in one
  process (:func:`.checkpoint.load_weights`).
- ``state.pt`` (rank 0): scheduler, every rank's RNG state, the trainer's state, and
  ``pipeline``: ``{"stages": P, "layers": [layers per virtual stage]}``; ``meta.json`` and
  ``checksums.json`` (every file's SHA-256, each stage file's hashed by its writer).

Saving: the writers put their files in a staging folder rank 0 made; rank 0 moves them into the
checkpoint's temporary folder beside its own files and commits it as
:func:`.checkpoint.commit_checkpoint` does (a writer's failure, a full disk included, is the same
one line on every rank). The folder must be one every rank sees (a shared file system on several
nodes).

Resuming on the saved split: rank 0 reads ``state.pt`` and sends every rank the small state;
each rank reads its own stage's two files, after checking their SHA-256 against
``checksums.json``, so no rank holds another stage's tensors (another ``--nproc``: every
pipeline's stage s reads stage s's files). On another split (``--pp``, ``--pp-virtual``), or from
a checkpoint without pipeline, each rank reads its stage's names from the files holding them
(:mod:`.reshard`). A checkpoint of format 2 (``model.pt`` holding the whole model, ``state.pt``
every stage's optimizer state) still resumes on its own split: rank 0 reads it and sends every
rank its own stage's part. The objects travel over ``group`` (on CUDA a gloo group: NCCL would
stage every pickle in device memory).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor

from ..batching.schedule import stage_layers
from ..engine.runtime import Runtime
from ..engine.stage import StageModel
from .checkpoint import CHECKSUMS, KEEP_LAST, _load, _save, _write, commit_checkpoint, plain, sha256
from .optimizer_state import load_optimizer_state_dict, optimizer_state_dict
from .reshard import STAGE_PREFIX, adapt_state, optimizer_names, read_part
from .shards import MODEL_SHARD, OPTIM_SHARD


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
    """Collective: every stage of the first pipeline writes its own files, rank 0 the shared
    ones, and rank 0 commits the folder (``group``: for the small objects; None: the default
    group; ``model``: unused, the stage holds it; the signature is
    :func:`.checkpoint.save_checkpoint`'s). Returns the checkpoint folder on rank 0."""
    layout = stage.layout
    files = None
    if layout.dp == 0 or stage.sharded:  # FSDP2: every peer takes part in the gathers
        files = {
            MODEL_SHARD.format(layout.stage): stage.state_dict_owned(),
            OPTIM_SHARD.format(layout.stage): _optimizer_state(stage, optimizer),
        }
    staging, failed = _staging(Path(run_dir) / "checkpoints", step, is_main, group)
    report = _write_stage(staging, files) if layout.dp == 0 and staging is not None else None
    files = None  # this stage's tensors go before rank 0 writes
    reports = [report]
    if not _alone(group):
        reports = [None] * dist.get_world_size(group) if is_main else None
        dist.gather_object(report, reports, dst=0, group=group)
    state = None
    if is_main:
        state = {
            "pipeline": {"stages": layout.stages, "layers": list(stage.split)},
            "scheduler": plain(scheduler.state_dict()),
            "rng": plain(rng_states),
            "trainer": plain(trainer_state),
        }
        writers = [reports[layout.rank(0, s)] for s in range(layout.stages)]

    def stage_files(tmp: Path) -> dict[str, str]:
        """Rank 0, inside the checkpoint's temporary folder: the stages' files moved in."""
        if failed is not None:
            raise failed
        hashes = {}
        for s, written in enumerate(writers):
            if isinstance(written, tuple):  # (errno or None, what failed)
                number, what = written
                if number is None:
                    raise ValueError(f"checkpoint step-{step:06d}: stage {s} could not write its files ({what})")
                raise OSError(number, f"stage {s}: {what}")
            for name, digest in written.items():
                os.replace(staging / name, tmp / name)
                hashes[name] = digest
        return hashes

    try:
        return commit_checkpoint(Path(run_dir), step, stage_files if is_main else None, state, is_main, keep_last)
    finally:
        if is_main and staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


def _staging(root: Path, step: int, is_main: bool, group) -> tuple[Path | None, OSError | None]:
    """The folder the stages write their files in, made by rank 0 and named to every rank (its
    name a temporary one that :func:`.checkpoint.clean_temporaries` removes), or None and on rank
    0 the ``OSError`` that kept it from being made."""
    box, failed = [None], None
    if is_main:
        path = root / f".step-{step:06d}.tmp-stages-{secrets.token_hex(4)}"
        try:
            path.mkdir(parents=True)
            box = [str(path)]
        except OSError as err:
            failed = err
    if not _alone(group):
        dist.broadcast_object_list(box, src=0, group=group)
    return (None if box[0] is None else Path(box[0])), failed


def _alone(group) -> bool:
    """Whether this process is the whole pipeline (one stage, maybe with no process group)."""
    return not dist.is_initialized() or dist.get_world_size(group) == 1


def _write_stage(folder: Path, files: dict) -> dict[str, str] | tuple[int | None, str]:
    """Write and fsync this stage's ``files`` (name: object) in ``folder``: their SHA-256 by
    name, or ``(errno, message)`` of an ``OSError`` (None and the error's text for another)."""
    try:
        for name, obj in files.items():
            _write(folder / name, lambda p, obj=obj: _save(obj, p))
        return {name: sha256(folder / name) for name in files}
    except OSError as err:
        return err.errno, str(err.strerror or err)
    except Exception as err:  # whatever torch.save raises: rank 0 reports it in one line
        return None, f"{type(err).__name__}: {err}"


def load_pipeline_checkpoint(path: Path, stage: StageModel, optimizer, scheduler, rt: Runtime, group=None) -> dict:
    """Restore this rank's stage, its optimizer and the scheduler from checkpoint ``path``
    (verified by rank 0 when it was chosen), each rank reading its own stage's files; the saved
    ``state`` without the optimizers' (its RNG states and stages' pricing for this grid,
    :func:`.reshard.adapt_state`). A checkpoint of another split (``--pp``, ``--pp-virtual``), or
    without pipeline (``model.pt``), is resharded: each rank reads its stage's names from the
    files holding them (:func:`.reshard.read_part`). A pipeline checkpoint with ``model.pt``
    (format 2) is read by rank 0, which sends each rank its stage's part (its own split only)."""
    path = Path(path)
    box = [(None, None, None, None)]  # (how, the state without optimizers, saved (stages, layers), refusal)
    if rt.is_main:
        box = [_plan(path, stage)]
    if not _alone(group):
        dist.broadcast_object_list(box, src=0, group=group)
    how, state, saved, error = box[0]
    if error is not None:
        raise ValueError(error)  # rank 0's refusal, said by every rank
    layout = stage.layout
    if how == "whole":
        state = _load_whole(path, stage, optimizer, scheduler, rt, group)
        return adapt_state(state, stage.split, stage.split, layout.stages, rt.world_size)
    try:
        if how == "own":
            model_sd = _read_own(path, MODEL_SHARD.format(layout.stage))
            optim_sd = _read_own(path, OPTIM_SHARD.format(layout.stage))
            missing = [n for n in stage.names if n not in model_sd]
            if missing:
                error = f"--resume: {path} lacks {len(missing)} parameters of stage {layout.stage} ({missing[0]}, ...)"
        else:
            groups = optimizer_names(stage, optimizer, STAGE_PREFIX)
            model_sd, optim_sd = read_part(path, stage.names, groups, 0 if saved is None else saved[0], STAGE_PREFIX)
    except ValueError as err:
        error = str(err)
    errors = [error]
    if not _alone(group):
        errors = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, error, group=group)
    error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise ValueError(error)  # the first failing rank's line, said by every rank
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(stage, {f"model.{n}": model_sd[n] for n in stage.names}, options=options)
    load_optimizer_state_dict(stage, optimizer, optim_sd, options, unstepped=not optim_sd["state"])
    scheduler.load_state_dict(state["scheduler"])
    return adapt_state(state, None if saved is None else saved[1], stage.split, layout.stages, rt.world_size)


def _plan(path: Path, stage: StageModel) -> tuple[str | None, dict | None, tuple | None, str | None]:
    """Rank 0: how this rank's stage loads checkpoint ``path``: ``"own"`` (its split: each rank
    its own stage's files), ``"reshard"`` (another split, or no pipeline), ``"whole"`` (format 2
    on its split); the state without optimizers, the saved ``(stages, layers)`` (None: no
    pipeline), and the line refusing it (else None)."""
    try:
        state = _load(path / "state.pt")
        if (path / "model.pt").is_file():
            if "pipeline" in state:  # format 2: rank 0 reads the whole model (_load_whole)
                return "whole", None, None, _refusal(path, state, stage)
            state.pop("optimizer", None)  # no pipeline: each rank reads its part from the file
            return "reshard", state, None, None
        pipeline = state.pop("pipeline", {})
        stages = pipeline.get("stages", 1)
        # checkpoints from before the balanced split record no layers: theirs was the even split
        layers = tuple(pipeline.get("layers", stage_layers(sum(stage.split), stages).tolist()))
        how = "own" if (stages, layers) == (stage.layout.stages, stage.split) else "reshard"
        return how, state, (stages, layers), None
    except ValueError as err:
        return None, None, None, str(err)


def _read_own(path: Path, name: str):
    """One of this stage's files, after checking its SHA-256 against ``checksums.json``."""
    try:
        sums = json.loads((path / CHECKSUMS).read_text())
    except (OSError, ValueError):
        raise ValueError(f"checkpoint {path / CHECKSUMS}: unreadable checksum list") from None
    f = path / name
    if not isinstance(sums, dict) or name not in sums or not f.is_file():
        raise ValueError(f"checkpoint {f}: missing")
    if sha256(f) != sums[name]:
        raise ValueError(f"checkpoint {f}: corrupt (SHA-256 differs from the one saved)")
    return _load(f)


def _load_whole(path: Path, stage: StageModel, optimizer, scheduler, rt: Runtime, group=None) -> dict:
    """:func:`load_pipeline_checkpoint` of a format-2 checkpoint (``model.pt``): rank 0 reads it and
    sends every rank its stage's part over ``group``."""
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
    """Rank 0, a format-2 checkpoint: its model and state, or the line refusing it for this
    pipeline."""
    model_sd = _load(path / "model.pt")
    state = _load(path / "state.pt")
    error = _refusal(path, state, stage)
    return (None, None, error) if error is not None else (model_sd, state, None)


def _refusal(path: Path, state: dict, stage: StageModel) -> str | None:
    """The line refusing checkpoint ``path`` (its ``state``, whose ``pipeline`` is taken out) for
    this pipeline, or None."""
    pipeline = state.pop("pipeline", {})
    saved = pipeline.get("stages", 1)
    if saved != stage.layout.stages:
        return f"--resume: {path} was saved with --pp {saved}; resume it with --pp {saved}"
    # checkpoints from before the balanced split record no layers: theirs was the even split
    layers = tuple(pipeline.get("layers", stage_layers(sum(stage.split), saved).tolist()))
    if layers != stage.split:
        return (
            f"--resume: {path} split the layers {list(layers)} over its stages, this version splits them "
            f"{list(stage.split)} (its optimizer states are per stage): resume it with the version that "
            "wrote it, or start afresh"
        )
    if any(isinstance(k, int) for opt in state.get("optimizer", ()) for k in opt["state"]):
        return (
            f"--resume: {path} is a pipeline checkpoint of an earlier development build (its optimizer "
            "states are by index, not by name): start afresh, or `sparsebalance eval` its weights"
        )
    return None
