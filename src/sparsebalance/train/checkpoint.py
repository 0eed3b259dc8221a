"""Checkpoints: model, optimizer, scheduler, every rank's RNG state, data position, latency-model
calibration and density-estimator state. Atomic: written to a temporary folder, then renamed, and
``latest`` is replaced last, so a crash never leaves a half-written checkpoint.

Every file's SHA-256 is saved in ``checksums.json`` and verified at load (the error names the
file). :func:`find_checkpoint` returns the checkpoint ``latest`` names, or when it is corrupt or
missing the newest *intact* one before it, with a line saying so.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import torch


def _model_optim_state(model, optimizer, fsdp: bool) -> tuple[dict, dict]:
    if fsdp:  # gather full (unsharded) state on every rank; rank 0 writes it
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_state_dict(model, optimizer, options=opts)
    return model.state_dict(), optimizer.state_dict()


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
) -> Path | None:
    """Collective when ``fsdp``; only rank 0 writes. Returns the checkpoint folder on rank 0."""
    model_sd, optim_sd = _model_optim_state(model, optimizer, fsdp)
    if not is_main:
        return None
    root = Path(run_dir) / "checkpoints"
    final = root / f"step-{step:06d}"
    tmp = root / f".step-{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save(model_sd, tmp / "model.pt")
    torch.save(
        {
            "optimizer": optim_sd,
            "scheduler": scheduler.state_dict(),
            "rng": rng_states,
            "trainer": trainer_state,
        },
        tmp / "state.pt",
    )
    config = trainer_state.get("config", {})  # what defines the run: read by --resume
    meta = {"step": step, "model": config.get("model"), "config": config,
            "data": trainer_state.get("data")}  # fmt: skip
    (tmp / "meta.json").write_text(json.dumps(meta, default=str) + "\n")
    if trainer_state.get("vocab_map") is not None:  # tokenizer id -> model id (compact vocab)
        (tmp / "vocab_map.json").write_text(json.dumps(trainer_state["vocab_map"]) + "\n")
    sums = {p.name: sha256(p) for p in sorted(tmp.iterdir())}
    (tmp / CHECKSUMS).write_text(json.dumps(sums, indent=1) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    latest_tmp = root / "latest.tmp"
    latest_tmp.write_text(final.name + "\n")
    os.replace(latest_tmp, root / "latest")
    return final


CHECKSUMS = "checksums.json"
RESUME_FILES = ("model.pt", "state.pt")
_STEP = re.compile(r"step-(\d+)")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def verify_checkpoint(path: Path, needs: tuple[str, ...] = RESUME_FILES) -> None:
    """Raise ``ValueError`` naming the first missing or corrupt file of checkpoint ``path``
    (``needs``: the files it must hold). Checkpoints written before checksums existed are
    accepted when those files are present."""
    missing = [n for n in needs if not (path / n).is_file()]
    if missing:
        raise ValueError(f"checkpoint {path / missing[0]}: missing")
    sums_path = path / CHECKSUMS
    if not sums_path.is_file():
        return
    try:
        sums = json.loads(sums_path.read_text())
    except ValueError:
        raise ValueError(f"checkpoint {sums_path}: unreadable checksum list") from None
    for name, want in sums.items():
        f = path / name
        if not f.is_file():
            raise ValueError(f"checkpoint {f}: missing")
        if sha256(f) != want:
            raise ValueError(f"checkpoint {f}: corrupt (SHA-256 differs from the one saved)")


def find_checkpoint(
    run_dir: Path, needs: tuple[str, ...] = RESUME_FILES
) -> tuple[Path | None, list[str]]:
    """The checkpoint ``latest`` names if intact, else the newest intact one before it (or, with
    no usable pointer, the newest intact one); it must hold the files ``needs``. Returns it (None
    if there is none) and one line per checkpoint skipped (corrupt, incomplete, or missing)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return None, []
    found = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.fullmatch(p.name)))
    notes = []
    pointer = root / "latest"
    if pointer.is_file():
        name = pointer.read_text().strip()
        if not (root / name).is_dir():
            notes.append(f"checkpoints/latest names {name}, which is missing")
        elif m := _STEP.fullmatch(name):  # a run rolled back by hand: nothing after it
            found = [(step, p) for step, p in found if step <= int(m.group(1))]
    for _, path in reversed(found):
        try:
            verify_checkpoint(path, needs)
        except ValueError as err:
            notes.append(str(err))
            continue
        if notes:
            notes[-1] += f"; resuming from {path.name} instead"
        return path, notes
    return None, notes


def latest_checkpoint(run_dir: Path, needs: str = "state.pt") -> Path | None:
    """The checkpoint to resume from (see :func:`find_checkpoint`) holding the file ``needs``."""
    return find_checkpoint(run_dir, (needs,))[0]


def resolve_checkpoint(path: Path) -> Path | None:
    """The checkpoint folder (with ``model.pt``) that ``path`` names: ``path`` itself, or the
    latest checkpoint of the run folder ``path``; None if it names neither."""
    path = Path(path)
    return path if (path / "model.pt").is_file() else latest_checkpoint(path, needs="model.pt")


def load_checkpoint(path: Path, model, optimizer, scheduler, fsdp: bool = False) -> dict:
    """Restore model/optimizer/scheduler in place; return the saved ``state`` dict. ``path`` must
    have passed :func:`verify_checkpoint` (as :func:`find_checkpoint`'s result has)."""
    model_sd, state = (_load(path / name) for name in ("model.pt", "state.pt"))
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(
            model,
            optimizer,
            model_state_dict=model_sd,
            optim_state_dict=state["optimizer"],
            options=StateDictOptions(full_state_dict=True),
        )
    else:
        model.load_state_dict(model_sd)
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return state


def load_state(path: Path) -> dict:
    """The trainer state (``state.pt``) of checkpoint ``path``, verified against its checksums
    first; ``ValueError`` naming the file when it is missing, corrupt or unreadable."""
    verify_checkpoint(Path(path), ("state.pt",))
    return _load(Path(path) / "state.pt")


def _load(path: Path):
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # pickle / zip errors of a damaged file, whatever their type
        raise ValueError(f"checkpoint {path}: unreadable ({type(err).__name__}: {err})") from None
