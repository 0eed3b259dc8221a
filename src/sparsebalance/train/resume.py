"""Resuming a run: ``--resume`` continues *the same run* or refuses, listing what differs.

What defines a run is every :class:`~.config.TrainConfig` field (data, tokenizer, model, seed,
global batch, batching, optimizer, schedule, DST, ...) and the data's content fingerprint, except
the few that may change between a run and its resumption (:data:`SAFE_ON_RESUME`). A field added
to the config later is run-defining unless listed there. The grid (``--pp``, ``--pp-virtual``,
``--nproc``) may change: the ranks read their stages' parts by name (:mod:`.reshard`), and rank 0
says in one line what that changes (:func:`check_grid`).
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, fields
from pathlib import Path

from .. import flags
from ..versions import CHECKPOINT, CONFIG
from .checkpoint import checkpoint_version, find_checkpoint, verify_checkpoint
from .config import TrainConfig
from .config_io import to_dict, upgrade
from .reshard import grid_note

SAFE_ON_RESUME = {
    "steps": "a longer or shorter run; the LR schedule follows the new total from the first resumed step",
    "checkpoint_every": "how often checkpoints are written",
    "out": "the run folder may have been moved",
    "resume": "how the run is started",
    "overwrite": "how the run is started",
    "profile": "latency profile used for planning (timing predictions only)",
    "device": "where it runs (e.g. another machine)",
    "backend": "attention kernel (same maths, different implementation)",
    "measure_bubble": "how the bubble is timed",
    "plan_ahead": "when a step is planned: during the previous step or after its feedback (the plans follow the new mode)",
    "ranks_per_node": "the machines' layout (where CP units are placed, not what is trained)",
    "keep_checkpoints": "how many checkpoints are kept",
    "comm_timeout": "how long a collective may wait before the run reports a hang",
    "max_nonfinite_steps": "how many skipped non-finite steps in a row the run tolerates",
    "fsdp_gradient_sync": "when FSDP2 reduce-scatters: the same sums (rounded in another order)",
    "pp": "the pipeline's stages: parameters and optimizer state are resharded by name (reshard.py)",
    "pp_virtual": "the stages' chunks of layers: resharded by name as --pp is",
    "pp_schedule": "the order of a pipeline's ops: the same gradients (zb-h1's deferred weights bit for bit)",
}
"""Fields a resumed run may change, and why each is safe."""


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _defaults() -> dict:
    out = {}
    for f in fields(TrainConfig):
        if f.default is not MISSING:
            out[f.name] = f.default
        elif f.default_factory is not MISSING:
            out.update(_flat({f.name: asdict(f.default_factory())}))
    return out


def differences(saved: dict, current: TrainConfig, skip: tuple[str, ...] = ()) -> list[str]:
    """``--flag saved -> current`` for every run-defining field that differs."""
    now, before, defaults = _flat(to_dict(current)), _flat(saved), _defaults()
    out = []
    for key in sorted(set(now) | set(before)):
        if key.split(".")[0] in SAFE_ON_RESUME or key in skip:
            continue
        old = before.get(key, defaults.get(key))  # a field newer than the checkpoint: default
        new = now.get(key)
        if key == "capacity" and new == "auto" and isinstance(old, int):
            continue  # a checkpoint holds the capacity auto resolved; resuming keeps it (saved_capacity)
        if old != new and not (isinstance(old, list) and tuple(old) == new):
            flag = "--" + key.split(".")[-1].replace("_", "-")
            out.append(f"{flag} {old!r} -> {new!r}")
    return out


def saved_identity(checkpoint: Path) -> tuple[dict, dict | None]:
    """(config, data fingerprint) a checkpoint was written with (its ``meta.json``; the
    checkpoint's format version is checked first, its config's version here)."""
    CHECKPOINT.check(checkpoint_version(checkpoint), f"checkpoint {checkpoint}")
    try:
        meta = json.loads((checkpoint / "meta.json").read_text())
        config = meta["config"]
    except (OSError, ValueError, KeyError):
        raise ValueError(f"checkpoint {checkpoint / 'meta.json'}: unreadable") from None
    version = meta.get("config_schema_version")
    CONFIG.check(version, f"checkpoint {checkpoint}'s config")
    config, _ = upgrade(config, version)  # an older schema: what it meant, in today's fields
    return config, (meta.get("data") or {}).get("identity")


def check_same_run(checkpoint: Path, cfg: TrainConfig, data: dict | None) -> list[str]:
    """Raise ``ValueError`` listing what differs from the run ``checkpoint`` belongs to; return
    the safe changes (one ``--flag old -> new`` each) to report."""
    saved, saved_data = saved_identity(checkpoint)
    # with a content fingerprint the data's path may change (a moved file), its content not
    diffs = differences(saved, cfg, skip=("data",) if saved_data is not None else ())
    if saved_data is not None and data is not None:  # the data's content identity
        from ..data.batches import check_same_data

        try:
            check_same_data(saved_data, data)
        except ValueError as err:
            diffs.append(f"data content: {err}")
    if diffs:
        raise ValueError(
            f"--resume: {checkpoint} belongs to a different run ({'; '.join(diffs)}); only "
            f"{', '.join('--' + k.replace('_', '-') for k in SAFE_ON_RESUME)} may change. "
            "Start a new run in another --out (or --overwrite this one, which deletes it)"
        )
    return [
        f"--{k.replace('_', '-')} {saved.get(k)!r} -> {v!r}"
        for k, v in to_dict(cfg).items()
        if k in SAFE_ON_RESUME and k not in ("resume", "overwrite") and saved.get(k) != v
    ]


def saved_capacity(checkpoint: Path) -> int | None:
    """The tokens per micro-batch a checkpoint's run planned with (what ``--capacity auto``
    resolved when it started); None: it planned by ``--micro-batches``. A resumed ``--capacity
    auto`` run keeps it, so its plans continue as they were (a fresh fit may differ by a block:
    it starts from this process's resident memory)."""
    capacity = saved_identity(checkpoint)[0].get("capacity")
    return capacity if isinstance(capacity, int) else None


def checkpoint_step(checkpoint: Path) -> int:
    """The step a checkpoint folder (``step-000010``) holds the run at."""
    return int(Path(checkpoint).name.rsplit("-", 1)[-1])


def check_steps(checkpoint: Path, cfg: TrainConfig) -> None:
    """``--steps`` below the step ``checkpoint`` holds is refused in one line: the resumed run
    would train nothing and end with a config that says fewer steps than it has (a run is not
    shortened on resume). Equal is allowed: the run ends there (:func:`is_complete`)."""
    done = checkpoint_step(checkpoint)
    if cfg.steps < done:
        steps = flags.name(cfg, "steps")
        raise ValueError(
            f"--resume with {steps} {cfg.steps}: the run already has {done} steps "
            f"({Path(checkpoint).parent.name}/{Path(checkpoint).name}): pass {steps} > {done} "
            f"to continue it, or {steps} {done} if it is complete"
        )


def saved_world_size(checkpoint: Path) -> int | None:
    """The number of ranks that saved ``checkpoint`` (one RNG state each): ``meta.json``'s
    ``world_size``, or for a checkpoint written before it was recorded the length of
    ``state.pt``'s RNG list (its pickle only: the tensors are memory-mapped, not read). None
    when it holds no RNG state or ``state.pt`` cannot be read (damage rank 0 reports)."""
    try:
        meta = json.loads((Path(checkpoint) / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    if isinstance(meta, dict) and "world_size" in meta:
        return meta["world_size"] if isinstance(meta["world_size"], int) else None
    import torch

    try:
        state = torch.load(Path(checkpoint) / "state.pt", map_location="cpu", weights_only=True, mmap=True)
        return len(state["rng"]) or None
    except Exception:  # a damaged file, whatever torch raises: rank 0 names it
        return None


def check_grid(checkpoint: Path, cfg: TrainConfig, world_size: int) -> str | None:
    """A run may resume on another grid (``--pp``, ``--pp-virtual``, ``--nproc``: the ranks
    read their stages' parameters and optimizer state by name, :mod:`.reshard`): the line saying
    what that changes (RNG states by rank, the stages' time scales, the plans), None on the
    saved grid. A pipeline checkpoint of format 2 on another split is refused in one line."""
    name = f"{Path(checkpoint).parent.name}/{Path(checkpoint).name}"
    config = saved_identity(checkpoint)[0]
    return grid_note(name, config, saved_world_size(checkpoint), checkpoint_version(checkpoint), cfg, world_size)


def is_complete(checkpoint: Path, cfg: TrainConfig) -> bool:
    """Whether ``--resume`` has nothing to do: ``checkpoint`` is the last one of a run that
    ended at ``--steps`` (its own ``--steps`` was its step) and is intact (hashed: a damaged
    one is not the end of the run, an older intact one is resumed from instead)."""
    done = checkpoint_step(checkpoint)
    if cfg.steps != done or saved_identity(checkpoint)[0].get("steps") != done:
        return False
    try:
        verify_checkpoint(checkpoint)
    except ValueError:
        return False
    return True


def choose_checkpoint(run_dir: Path, cfg: TrainConfig, data: dict | None, runtime) -> tuple[Path, list[str]]:
    """The checkpoint ``--resume`` continues from, chosen by rank 0 alone (a collective): rank 0
    finds the newest intact one (hashing its files, :func:`find_checkpoint`) and checks that it
    belongs to this run; every rank receives that choice, or rank 0's refusal as the same
    ``ValueError``. The other ranks never open the checkpoint folder, so ranks that would see
    different files (NFS caching, a node-local folder) still resume from one step. The checks
    are the launcher's (``--steps``, the grid: :func:`check_grid`) plus the data's
    content, so the Python API refuses what the command line does. Returns the path and the
    lines to print (skipped checkpoints, allowed changes, what another grid changes)."""
    choice = None
    if runtime.is_main:
        try:
            path, notes = find_checkpoint(run_dir)
            if path is None:
                where = Path(run_dir) / "checkpoints"
                raise ValueError(f"--resume: no intact checkpoint in {where}")
            changes = check_same_run(path, cfg, data)
            check_steps(path, cfg)
            grid = check_grid(path, cfg, runtime.world_size)
            line = f"resuming from {path.name}" + (f" ({'; '.join(changes)})" if changes else "")
            choice = {"path": str(path), "lines": [*notes, line, *([grid] if grid else [])]}
        except (ValueError, OSError) as err:  # the other ranks raise the same, not hang
            choice = {"error": str(err)}
    choice = runtime.broadcast_object(choice)
    if "error" in choice:
        raise ValueError(choice["error"])
    return Path(choice["path"]), choice["lines"]
