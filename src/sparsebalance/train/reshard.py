"""Resuming on another grid: another ``--pp``, ``--pp-virtual`` or ``--nproc`` (the number of
data-parallel pipelines) than the checkpoint was saved on.

What defines the run (model, data, seed, global batch, optimizer, schedule, DST, ...) is checked
as for any resume (:func:`.resume.check_same_run`); the grid is only how it runs. On another
grid each rank reads, by parameter name, exactly the parameters and optimizer state its new stage
holds (:func:`read_part`), from

- a pipeline checkpoint's stage files (``model-stage-0000s.pt`` / ``optim-stage-0000s.pt``): the
  rank looks at each file's names (its pickle only, memory-mapped: no tensor is read), takes each
  of its names from one file (the files holding most of them first, so a tied embedding, in two
  stage files, is taken once, from a file the rank reads anyway), then reads those files one at
  a time, each verified against ``checksums.json`` first, keeping only its names;
- a checkpoint without pipeline (``model.pt``, the optimizer state in ``state.pt``): the same
  from those two files.

A ``--pp 1`` rank holds the whole model: rank 0 reads it from the stage files in turn and sends
it as for any checkpoint (:func:`.checkpoint.load_checkpoint`). No rank of a pipeline holds
another stage's tensors.

Kept: the step, the data position, the scheduler, the latency calibration, the density
estimator and the stages' backward : forward ratio (all the whole run's). Changed, and said in
one line at resume (:func:`grid_note`): the stages' time scales go back to 1 when the stages hold
other layers (:func:`adapt_state`); rank r restores the RNG state saved by rank r mod N; the
plans are made for the new grid. A pipeline checkpoint of format 2 (the whole model in
``model.pt``, the stages' optimizer states in ``state.pt``) is not resharded: refused in one line.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint_io import CHECKSUMS, sha256
from .checkpoint_io import load_file as _load
from .shards import MODEL_SHARD, OPTIM_SHARD

STAGE_PREFIX = "model."
"""What a :class:`~sparsebalance.engine.stage.StageModel` puts before the model's names."""


@dataclass(frozen=True)
class Grid:
    """A run's layout: ``pp`` stages of ``virtual`` chunks each, over ``ranks`` processes (None:
    a checkpoint that recorded no world size)."""

    pp: int
    virtual: int = 1
    ranks: int | None = None

    @property
    def pipelines(self) -> int | None:
        return None if self.ranks is None else self.ranks // self.pp

    def __str__(self) -> str:
        out = f"--pp {self.pp}" + (f" --pp-virtual {self.virtual}" if self.virtual > 1 else "")
        if self.ranks is None:
            return out
        n, r = self.pipelines, self.ranks
        return f"{out} x {n} pipeline{'s' * (n != 1)} ({r} rank{'s' * (r != 1)})"


def grid_note(name: str, saved: dict, saved_ranks: int | None, version: object, cfg, world_size: int) -> str | None:
    """The line saying what resuming checkpoint ``name`` (its ``saved`` config, ranks and format
    ``version``) on ``cfg``'s grid of ``world_size`` processes changes, None on the saved grid;
    ``ValueError`` (one line) for a pipeline checkpoint of format 2 on another split."""
    before = Grid(saved.get("pp", 1), saved.get("pp_virtual", 1), saved_ranks)
    now = Grid(cfg.pp, cfg.pp_virtual, world_size)
    split = (before.pp, before.virtual) != (now.pp, now.virtual)
    if split and version == 2 and before.pp > 1:
        raise ValueError(
            f"--resume: {name} is a {Grid(before.pp, before.virtual)} checkpoint of format 2 (the whole model in "
            "model.pt, the stages' optimizer states by stage), which is not resharded: resume it with "
            f"{Grid(before.pp, before.virtual)} once (its next checkpoint is written as stage files, which any "
            "--pp and --nproc resume from)"
        )
    if not split and before.ranks in (None, now.ranks):
        return None
    said = [
        "parameters and optimizer state resharded by name"
        if split
        else "parameters and optimizer state as saved (every pipeline loads the same)"
    ]
    if split and max(before.pp, now.pp) > 1:
        said.append(
            "the stages' learned time scales reset to 1 (their stages held other layers; "
            "the backward:forward ratio kept)"
        )
    if before.ranks not in (None, now.ranks):  # the same ranks: each restores its own, as always
        said.append(f"rank r restores the RNG state saved by rank r mod {before.ranks}")
    said.append("step, data position, LR schedule and latency calibration kept")
    said.append(
        f"the plans are made for {now.pipelines} pipeline{'s' * (now.pipelines != 1)} of {now.pp} stage"
        f"{'s' * (now.pp != 1)}: the losses follow an uninterrupted run's up to rounding with --dst-mode off "
        "(another summation order), and with DST on its budgets follow the new plans"
    )
    return f"--resume: {name} was saved by {before} and resumes as {now}: {'; '.join(said)}"


def adapt_state(state: dict, saved_layers, layers, stages: int, world_size: int) -> dict:
    """A checkpoint's ``state`` (RNG states, trainer state) for a grid of ``world_size`` ranks and
    ``stages`` stages splitting the layers as ``layers`` (per virtual stage; None: no pipeline),
    from one that split them as ``saved_layers``: rank r gets the RNG state of saved rank r mod
    N, and on another split the stages' time scales go back to 1 (the ratio is kept)."""
    rng = state.get("rng") or []
    if rng and len(rng) != world_size:
        state["rng"] = [rng[r % len(rng)] for r in range(world_size)]
    trainer = state.get("trainer", {})
    calibration = trainer.get("stage_calibration")
    same = (saved_layers is None and layers is None) or (
        saved_layers is not None and layers is not None and tuple(saved_layers) == tuple(layers)
    )
    if calibration is not None and not same:
        trainer["stage_calibration"] = {**calibration, "scales": [1.0] * stages}
        ahead = (trainer.get("ahead") or {}).get("engine")  # --plan-ahead's state: the same reset
        if ahead is not None and ahead.get("stage_calibration") is not None:
            ahead["stage_calibration"] = {**ahead["stage_calibration"], "scales": [1.0] * stages}
    return state


def stage_names(module: torch.nn.Module) -> list[str]:
    """``module``'s state-dict entries that are its parameters (a tied weight under each name)."""
    params = {id(p) for p in module.parameters()}
    return [n for n, t in module.state_dict(keep_vars=True).items() if id(t) in params]


def optimizer_names(module: torch.nn.Module, optimizer, prefix: str = "") -> list[list[str]]:
    """Each of ``optimizer``'s param groups as names in ``module`` without ``prefix``: the
    names :func:`~torch.distributed.checkpoint.state_dict.get_optimizer_state_dict` keys it by
    (a tied weight under its first name)."""
    fqn = {id(p): n for n, p in module.named_parameters()}
    return [[fqn[id(p)].removeprefix(prefix) for p in group["params"]] for group in optimizer.param_groups]


def read_part(
    path: Path, names: Sequence[str], groups: Sequence[Sequence[str]], stages: int, prefix: str = ""
) -> tuple[dict, dict]:
    """The parameters ``names`` (the model's names) and the optimizer state of ``groups`` (names
    per param group) from checkpoint ``path``: its ``stages`` stage files, or with ``stages`` 0
    its ``model.pt`` and ``state.pt``; only the files holding them are read, one at a time,
    each verified first. Returns the model state dict (``{name: tensor}``) and the optimizer's,
    keyed ``prefix + name`` as the target module's; ``ValueError`` (one line) for a name the
    checkpoint lacks or a damaged file."""
    path = Path(path)
    if stages:
        sources = [(path / MODEL_SHARD.format(s), path / OPTIM_SHARD.format(s), STAGE_PREFIX) for s in range(stages)]
    else:
        sources = [(path / "model.pt", path / "state.pt", "")]
    wanted = set(names)
    held = []
    for model_file, _, _ in sources:  # which names each file holds: its pickle, the tensors mapped
        if not model_file.is_file():
            raise ValueError(f"checkpoint {model_file}: missing")
        held.append(set(_load(model_file)) & wanted)
    take: dict[str, int] = {}
    for i in sorted(range(len(sources)), key=lambda i: -len(held[i])):
        for n in sorted(held[i] - take.keys()):
            take[n] = i
    missing = [n for n in names if n not in take]
    if missing:
        raise ValueError(f"--resume: {path} lacks {len(missing)} parameters this rank holds ({missing[0]}, ...)")
    sums = _checksums(path)
    optimized = {n for group in groups for n in group}
    model_sd, optim_state, saved_groups = {}, {}, None
    for i in sorted(set(take.values())):
        model_file, optim_file, saved_prefix = sources[i]
        mine = [n for n in names if take[n] == i]
        whole = _verified(model_file, sums)
        model_sd.update({n: whole[n] for n in mine})
        del whole  # the file's other tensors were never read
        optim = _verified(optim_file, sums)
        optim = optim if stages else optim["optimizer"]
        state = optim["state"]
        if any(isinstance(k, int) for k in state):
            raise ValueError(f"--resume: {optim_file} holds optimizer states by index, not by name: start afresh")
        lost = [n for n in mine if n in optimized and saved_prefix + n not in state]
        if state and lost:  # a stepped optimizer holds every parameter's moments: none may restart at 0
            raise ValueError(
                f"--resume: {optim_file} has no optimizer state for {len(lost)} parameters ({lost[0]}, ...)"
            )
        optim_state.update({n: state[saved_prefix + n] for n in mine if n in optimized and saved_prefix + n in state})
        saved_groups = saved_groups or optim["param_groups"]
        del optim, state
    if len(saved_groups) != len(groups):
        raise ValueError(f"--resume: {path} has {len(saved_groups)} optimizer param groups, this run {len(groups)}")
    param_groups = [
        {**{k: v for k, v in saved.items() if k != "params"}, "params": [prefix + n for n in group]}
        for saved, group in zip(saved_groups, groups, strict=True)
    ]
    # in the order asked (the model's, the optimizer's), whichever file each came from
    state = {prefix + n: optim_state[n] for group in groups for n in group if n in optim_state}
    return {n: model_sd[n] for n in names}, {"state": state, "param_groups": param_groups}


def read_whole(path: Path, model: torch.nn.Module, optimizer) -> tuple[dict, dict, dict]:
    """Rank 0 of a ``--pp 1`` run: checkpoint ``path``'s model state dict, optimizer state dict
    (keyed by ``model``'s names) and the rest of its state: ``model.pt`` and ``state.pt`` as
    saved, or a pipeline's stage files merged by name (:func:`read_part`, every file verified
    first; a tied weight taken once). ``ValueError`` (one line) for a pipeline checkpoint of
    format 2 (not resharded)."""
    state = _load(path / "state.pt")
    pipeline = state.get("pipeline")
    if (path / "model.pt").is_file():
        if pipeline is not None:
            grid = Grid(pipeline.get("stages", 1), len(pipeline.get("layers", ())) // pipeline.get("stages", 1) or 1)
            raise ValueError(
                f"--resume: {path} is a {grid} checkpoint of format 2, which is not resharded: resume it with {grid} "
                "once (its next checkpoint is written as stage files, which --pp 1 resumes from)"
            )
        return _load(path / "model.pt"), state.pop("optimizer"), state
    if pipeline is None:
        raise ValueError(f"checkpoint {path / 'model.pt'}: missing")
    model_sd, optim_sd = read_part(path, stage_names(model), optimizer_names(model, optimizer), pipeline["stages"])
    return model_sd, optim_sd, state


def _checksums(path: Path) -> dict:
    try:
        sums = json.loads((path / CHECKSUMS).read_text())
    except (OSError, ValueError):
        sums = None
    if not isinstance(sums, dict):
        raise ValueError(f"checkpoint {path / CHECKSUMS}: unreadable checksum list")
    return sums


def _verified(f: Path, sums: dict):
    """File ``f`` of a checkpoint, after checking its SHA-256 against ``sums``."""
    if f.name not in sums or not f.is_file():
        raise ValueError(f"checkpoint {f}: missing")
    if sha256(f) != sums[f.name]:
        raise ValueError(f"checkpoint {f}: corrupt (SHA-256 differs from the one saved)")
    return _load(f)
