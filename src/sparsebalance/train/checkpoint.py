"""Checkpoints: model, optimizer, scheduler, every rank's RNG state, data position, latency-model
calibration and density-estimator state.

Safe to load: every file holds tensors and plain Python values only, so everything is read with
``torch.load(weights_only=True)`` (no pickled object can run code). The format carries a version
(``meta.json``'s ``schema_version``, :data:`sparsebalance.versions.CHECKPOINT`); a checkpoint of
another version is refused in one line that says how to convert it.

Atomic and durable: files are written to a temporary folder, fsynced, renamed into place (a
checkpoint of the same step is moved aside first and deleted only once its replacement is in
place), then ``latest`` is replaced; a full disk is one line, leaving the previous checkpoint and
no temporary behind. Only the newest ``keep_last`` checkpoints are kept. Every file's SHA-256 is
saved in ``checksums.json`` and verified before a resume (a checkpoint without it is refused).
:func:`find_checkpoint` returns the checkpoint ``latest`` names, or when it is corrupt or missing
the newest *intact* one before it, with a line saying so.

Model and optimizer state are full (unsharded) state dicts keyed by parameter name
(``torch.distributed.checkpoint.state_dict``), the same for DDP and FSDP2: a run of either
resumes under the other. Resuming reads the files on rank 0 only (memory-mapped) and broadcasts
them tensor by tensor (:func:`load_checkpoint`); a pipeline's stages write and read their own,
and a run without pipeline resumes a pipeline's checkpoint too (rank 0 merges its stage files by
name, :mod:`.reshard`).
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
from pathlib import Path

import numpy as np
import torch

from ..versions import CHECKPOINT, CONFIG
from .checkpoint_io import CHECKSUMS, sha256
from .checkpoint_io import load_file as _load
from .optimizer_state import load_optimizer_state_dict, optimizer_state_dict
from .shards import has_weights, merged_weights  # a pipeline's stage files (pipeline_checkpoint.py)

RESUME_FILES = ("model.pt", "state.pt")
KEEP_LAST = 3
_STEP = re.compile(r"step-(\d+)")
_TEMPORARY = re.compile(r"\.step-\d+\.(tmp|old)(-.*)?|latest\.tmp(-.*)?")


class AgreedError(ValueError):
    """A one-line error every rank raised alike (rank 0's outcome, broadcast): rank 0 says it."""


class CheckpointFormatError(ValueError):
    """A checkpoint of another format version: refused, never skipped for an older one."""


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def plain(obj):
    """``obj`` with numpy arrays and scalars turned into lists and Python numbers: what
    ``torch.load(weights_only=True)`` reads back (tensors, containers and primitives)."""
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(plain(v) for v in obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, (str, int, float, bool, torch.Tensor)):
        return obj
    raise TypeError(f"checkpoint state holds a {type(obj).__name__}, not loadable weights-only")


def _fsync(path: Path) -> None:
    """Flush a file or folder to the disk (a rename is durable once its folder is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: Path, write) -> None:
    write(path)
    _fsync(path)


def _save(obj, path: Path) -> None:
    with path.open("wb") as f:  # through a Python file: a full disk raises OSError(ENOSPC)
        try:
            torch.save(obj, f)
        except RuntimeError as err:
            # torch's zip writer closes the archive after the file's write failed, which fails
            # again ("unexpected pos ..."): the OSError that started it is the one to report
            cause = _os_error(err)
            if cause is None:
                raise
            raise cause from None


def _os_error(err: BaseException) -> OSError | None:
    """The first ``OSError`` in ``err``'s chain of causes and contexts (``err`` included)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def save_checkpoint(
    run_dir: Path,
    step: int,
    model,
    optimizer,
    scheduler,
    trainer_state: dict,
    rng_states: list,
    is_main: bool,
    fsdp: bool = False,
    keep_last: int = KEEP_LAST,
) -> Path | None:
    """Collective (every rank calls it: FSDP2 gathers the full state); only rank 0 writes.
    ``rng_states``: one per rank (their number is saved as the run's world size).
    ``keep_last``: checkpoints kept (0 = all). Returns the checkpoint folder on rank 0.
    ``fsdp`` is accepted for callers of the earlier signature; the state is gathered the same way
    for every model.

    A write that fails (a full disk, a quota, an I/O error) removes what it wrote, leaves the
    previous checkpoint and ``latest`` as they were, and raises the same one-line ``ValueError``
    on every rank (rank 0's outcome is broadcast when a process group is up), so a run ends
    with one line, not one traceback per rank."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    options = _options(cpu_offload=True)
    model_sd = get_model_state_dict(model, options=options)
    optim_sd = optimizer_state_dict(model, optimizer, options)
    state = None
    if is_main:
        state = {
            "optimizer": optim_sd,
            "scheduler": plain(scheduler.state_dict()),
            "rng": plain(rng_states),
            "trainer": plain(trainer_state),
        }
    return commit_checkpoint(Path(run_dir), step, model_sd, state, is_main, keep_last)


def commit_checkpoint(
    run_dir: Path, step: int, model_sd: dict, state: dict | None, is_main: bool, keep_last: int
) -> Path | None:
    """Collective: rank 0 writes ``model_sd`` and ``state`` as checkpoint ``step`` (atomic), every
    rank raises the same :class:`AgreedError` if it could not, then old checkpoints are pruned."""
    final, error = None, None
    if is_main:
        try:
            final = _write_checkpoint(Path(run_dir) / "checkpoints", step, model_sd, state)
        except ValueError as err:
            error = str(err)
        except BaseException:
            _agree("checkpoint: the save failed on rank 0 (see its traceback)")  # peers stop
            raise
    error = _agree(error)
    if error is not None:
        raise AgreedError(error)
    if final is not None:
        prune_checkpoints(final.parent, step, keep_last)
    return final


def _agree(error: str | None) -> str | None:
    """Rank 0's ``error`` on every rank of the default process group (as it is without one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return error
    box = [error]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _write_checkpoint(root: Path, step: int, model_sd: dict, state: dict) -> Path:
    """Install ``step-{step}`` under ``root`` and point ``latest`` at it; an ``OSError`` becomes
    one line (``ValueError``) once everything this save wrote is removed."""
    final = root / f"step-{step:06d}"
    previous = _pointer(root)
    latest_tmp = root / f"latest.tmp-{secrets.token_hex(4)}"
    try:
        install(final, lambda tmp: write_folder(tmp, step, model_sd, state))
        try:
            _write(latest_tmp, lambda p: p.write_text(final.name + "\n"))
            os.replace(latest_tmp, root / "latest")
            _fsync(root)
        except BaseException:
            latest_tmp.unlink(missing_ok=True)
            if _pointer(root) != final.name:  # not resumable without its pointer: it goes too
                shutil.rmtree(final, ignore_errors=True)
            raise
    except OSError as err:
        if previous and (root / previous).is_dir():
            kept, then = f"{previous} is intact", "continue with --resume"
        else:
            kept, then = "no earlier checkpoint was saved", "start the run again"
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            try:
                free = f", {shutil.disk_usage(root).free / 2**30:.1f} GiB free"
            except OSError:
                free = ""
            raise ValueError(
                f"checkpoint {final.name}: no space left in {root} (disk full{free}); its "
                f"partial files are removed and {kept}: free space (or lower "
                f"--keep-checkpoints) and {then}"
            ) from None
        raise ValueError(
            f"checkpoint {final.name}: could not be written in {root} ({type(err).__name__}: "
            f"{err}); its partial files are removed and {kept}"
        ) from None
    return final


def _pointer(root: Path) -> str | None:
    """The checkpoint name ``root/latest`` holds (None without a readable one)."""
    try:
        return (root / "latest").read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def install(final: Path, write) -> None:
    """Write a checkpoint folder with ``write(tmp)`` into a temporary folder beside ``final``,
    then rename it to ``final``: an existing ``final`` is moved aside first and deleted only once
    the new one is in place. On failure the temporary folder is removed and the previous
    ``final`` is back in place."""
    root = final.parent
    tmp = root / f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    old = None
    try:
        tmp.mkdir(parents=True)
        write(tmp)
        _fsync(tmp)
        if final.exists():
            old = root / f".{final.name}.old-{secrets.token_hex(4)}"
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not final.exists():
            os.replace(old, final)  # the previous checkpoint of this step, back in place
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_folder(tmp: Path, step: int, model_sd, state: dict, config_version=None) -> None:
    """A checkpoint's files in ``tmp``: ``model.pt`` (``model_sd`` a callable: the stage files it
    puts there, giving their SHA-256 by name), ``state.pt`` (optimizer, scheduler, rng, trainer),
    ``meta.json`` (format and config versions, a converted checkpoint's ``config_version`` as it
    was written; ``world_size``: the ranks that saved it, one RNG state each, None when it holds
    none, read before a resume), ``vocab_map.json``, ``checksums.json``; each fsynced."""
    hashed = model_sd(tmp) if callable(model_sd) else _write(tmp / "model.pt", lambda p: _save(model_sd, p)) or {}
    _write(tmp / "state.pt", lambda p: _save(state, p))
    trainer_state = state["trainer"]
    config = trainer_state.get("config", {})  # what defines the run: read by --resume
    meta = {
        "schema_version": CHECKPOINT.version,
        "config_schema_version": config_version or CONFIG.version,
        "step": step,
        "model": config.get("model"),
        "config": config,
        "data": trainer_state.get("data"),
        "world_size": len(state.get("rng") or []) or None,
    }
    _write(tmp / "meta.json", lambda p: p.write_text(json.dumps(meta, default=str) + "\n"))
    if trainer_state.get("vocab_map") is not None:  # tokenizer id -> model id (compact vocab)
        vocab = json.dumps(trainer_state["vocab_map"]) + "\n"
        _write(tmp / "vocab_map.json", lambda p: p.write_text(vocab))
    sums = {p.name: hashed.get(p.name) or sha256(p) for p in sorted(tmp.iterdir())}
    _write(tmp / CHECKSUMS, lambda p: p.write_text(json.dumps(sums, indent=1) + "\n"))


def prune_checkpoints(root: Path, step: int, keep_last: int) -> list[Path]:
    """Delete the checkpoints before ``step`` beyond the newest ``keep_last`` (0 = keep all).
    Checkpoints after ``step`` (a run rolled back by hand) are left alone. Returns the deleted."""
    if keep_last <= 0:
        return []
    mine = sorted(
        (int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.fullmatch(p.name)) and int(m.group(1)) <= step
    )
    gone = [p for _, p in mine[:-keep_last]]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def clean_temporaries(run_dir: Path) -> list[Path]:
    """Remove what an interrupted save left in ``run_dir/checkpoints`` (temporary and moved-aside
    folders, ``latest.tmp``): call it holding the run lock, when no save can be running."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _TEMPORARY.fullmatch(p.name)]
    for path in found:
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    return found


def checkpoint_version(path: Path) -> object:
    """``meta.json``'s ``schema_version`` (1 for a checkpoint written before versions)."""
    meta = path / "meta.json"
    if not meta.is_file():
        return 1
    try:
        return json.loads(meta.read_text()).get("schema_version", 1)
    except (OSError, ValueError, AttributeError):
        raise ValueError(f"checkpoint {meta}: unreadable") from None


def verify_checkpoint(path: Path, needs: tuple[str, ...] = RESUME_FILES, hashed: bool = True) -> None:
    """Raise ``ValueError`` naming the first missing or corrupt file of checkpoint ``path``
    (``needs``: the files it must hold), or :class:`CheckpointFormatError` when its trainer
    state is of another format version. A checkpoint read for ``state.pt`` must hold
    ``checksums.json`` and a readable ``meta.json``; one read only for its weights
    (``model.pt``, weights-only in every version) is verified against it when it has one.
    ``hashed=False``: every check but the files' SHA-256 (the launcher's cheap look)."""
    missing = [n for n in needs if not (path / n).is_file() and not (n == "model.pt" and has_weights(path))]
    if missing:
        raise ValueError(f"checkpoint {path / missing[0]}: missing")
    sums_path = path / CHECKSUMS
    sums = None
    if sums_path.is_file():
        try:
            sums = json.loads(sums_path.read_text())
        except ValueError:
            raise ValueError(f"checkpoint {sums_path}: unreadable checksum list") from None
    if "state.pt" in needs:
        if sums is not None and "meta.json" in sums and not (path / "meta.json").is_file():
            raise ValueError(f"checkpoint {path / 'meta.json'}: missing")
        version = checkpoint_version(path)
        try:
            CHECKPOINT.check(version, f"checkpoint {path}")
        except ValueError as err:
            raise CheckpointFormatError(str(err)) from None
    if sums is None and ("state.pt" in needs or checkpoint_version(path) != 1):
        # every checkpoint since format 2 is written with its checksums: none is damage
        raise ValueError(f"checkpoint {sums_path}: missing (the files cannot be verified)")
    if sums is not None and not isinstance(sums, dict):
        raise ValueError(f"checkpoint {sums_path}: unreadable checksum list")
    for name, want in (sums or {}).items():
        f = path / name
        if not f.is_file():
            raise ValueError(f"checkpoint {f}: missing")
        if hashed and sha256(f) != want:
            raise ValueError(f"checkpoint {f}: corrupt (SHA-256 differs from the one saved)")


def find_checkpoint(
    run_dir: Path, needs: tuple[str, ...] = RESUME_FILES, verify: bool = True
) -> tuple[Path | None, list[str]]:
    """The checkpoint ``latest`` names if intact, else the newest intact one before it (or, with
    no usable pointer, the newest intact one); it must hold the files ``needs``. Returns it (None
    if there is none) and one line per checkpoint skipped (corrupt, incomplete, or missing).
    ``verify=False``: every check but the files' hashes (:func:`verify_checkpoint` with
    ``hashed=False``: the launcher's cheap look; rank 0 hashes). A checkpoint of another format
    raises :class:`CheckpointFormatError`.

    A run still training may save and prune while this looks (``eval`` of a live run): a
    checkpoint whose folder vanished meanwhile was pruned, not damaged, and the look starts
    again from the new ``latest``."""
    root = Path(run_dir) / "checkpoints"
    for _ in range(_RESCANS):
        path, notes, pruned = _find(root, needs, verify)
        if not pruned:
            break
    return path, notes


_RESCANS = 5  # a run saves one checkpoint per step: it cannot prune five looks in a row


def _find(root: Path, needs: tuple[str, ...], verify: bool):
    """One look for :func:`find_checkpoint`: (path, notes, whether a checkpoint was pruned while
    it looked)."""
    if not root.is_dir():
        return None, [], False
    pointer = root / "latest"
    name = _pointer(root) if pointer.is_file() else None  # before the list: a save may follow
    found = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.fullmatch(p.name)))
    notes = []
    if name is not None:
        if not (root / name).is_dir():
            if pointer.is_file() and _pointer(root) != name:
                return None, [], True  # replaced meanwhile: a newer save
            notes.append(f"checkpoints/latest names {name}, which is missing")
        elif m := _STEP.fullmatch(name):  # a run rolled back by hand: nothing after it
            found = [(step, p) for step, p in found if step <= int(m.group(1))]
    for _, path in reversed(found):
        try:
            verify_checkpoint(path, needs, hashed=verify)
        except CheckpointFormatError:
            raise
        except ValueError as err:
            if not path.is_dir():
                return None, [], True
            notes.append(str(err))
            continue
        if notes:
            notes[-1] += f"; resuming from {path.name} instead"
        return path, notes, False
    return None, notes, False


def latest_checkpoint(run_dir: Path, needs: str = "state.pt") -> Path | None:
    """The checkpoint to resume from (see :func:`find_checkpoint`) holding the file ``needs``."""
    return find_checkpoint(run_dir, (needs,))[0]


def resolve_checkpoint(path: Path) -> Path | None:
    """The checkpoint folder (with ``model.pt`` or a pipeline's stage files) that ``path`` names:
    ``path`` itself, or the latest checkpoint of the run folder ``path``; None if it names neither."""
    return Path(path) if has_weights(path) else latest_checkpoint(path, needs="model.pt")


def load_weights(path: Path, device: torch.device | str = "cpu") -> dict:
    """The model state dict (``model.pt``, or a pipeline's stage files merged in this process) of
    checkpoint ``path``, verified against its checksums first (``eval``, a model from it);
    ``ValueError`` naming the file when it is missing, damaged or unreadable (truncated too)."""
    verify_checkpoint(Path(path), ("model.pt",))
    return merged_weights(Path(path), lambda f: _load(f, device))


def load_checkpoint(path: Path, model, optimizer, scheduler, fsdp: bool = False, runtime=None):
    """Restore model/optimizer/scheduler in place; return the saved ``state`` dict (without the
    optimizer's; its RNG states and stages' pricing for this world, :func:`.reshard.adapt_state`).
    A pipeline's checkpoint (stage files) is read by name, the stages merged on rank 0
    (:func:`.reshard.read_whole`). ``path`` must have passed :func:`verify_checkpoint` (as
    :func:`find_checkpoint`'s result has) on rank 0.

    With a distributed ``runtime`` only rank 0 opens the files (memory-mapped, weights-only);
    model and optimizer tensors are broadcast one at a time and each rank keeps its part
    (FSDP2: its shard), the small rest (scheduler, RNG states, trainer state) as one object. A
    rank's extra memory while loading is about its own optimizer state plus one tensor in flight
    (rank 0: plus the mapped file pages, which the kernel can drop)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    from .reshard import adapt_state, read_whole

    distributed = runtime is not None and runtime.distributed
    main = runtime is None or runtime.is_main
    model_sd, optim_sd, state, error = {}, {}, None, None
    if main:
        try:  # a pipeline's checkpoint: its stage files merged, by name (reshard.py)
            model_sd, optim_sd, state = read_whole(Path(path), model, optimizer)
        except ValueError as err:
            error = str(err)
    unstepped = main and error is None and not optim_sd["state"]
    if distributed:  # first: every rank needs to know whether the saved optimizer state is empty
        state, unstepped, error = runtime.broadcast_object((state, unstepped, error))
    if error is not None:
        raise ValueError(error)  # rank 0's line, said by every rank
    # Model and optimizer apart: ``set_state_dict`` with the other ranks' empty dicts would skip
    # the model there (optimizer only) while rank 0 broadcasts it.
    options = _options(broadcast_from_rank0=distributed)
    set_model_state_dict(model, model_sd, options=options)
    load_optimizer_state_dict(model, optimizer, optim_sd, options, unstepped)
    scheduler.load_state_dict(state["scheduler"])
    saved = state.pop("pipeline", None)  # a pipeline's checkpoint: its layers per stage
    world = runtime.world_size if runtime is not None else 1
    return adapt_state(state, None if saved is None else saved.get("layers", ()), None, 1, world)


def load_state(path: Path) -> dict:
    """The trainer state (``state.pt``) of checkpoint ``path``, verified against its checksums
    first; ``ValueError`` naming the file when it is missing, corrupt or unreadable."""
    verify_checkpoint(Path(path), ("state.pt",))
    return _load(Path(path) / "state.pt")
