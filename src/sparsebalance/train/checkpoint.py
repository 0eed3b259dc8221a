"""Checkpoints: model, optimizer, scheduler, every rank's RNG state, data position, latency-model
calibration and density-estimator state. Atomic: written to a temporary folder, then renamed, and
``latest`` is replaced last, so a crash never leaves a corrupt latest checkpoint."""

from __future__ import annotations

import json
import os
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
    meta = {"step": step, "model": trainer_state.get("config", {}).get("model")}
    (tmp / "meta.json").write_text(json.dumps(meta) + "\n")
    if trainer_state.get("vocab_map") is not None:  # tokenizer id -> model id (compact vocab)
        (tmp / "vocab_map.json").write_text(json.dumps(trainer_state["vocab_map"]) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    latest_tmp = root / "latest.tmp"
    latest_tmp.write_text(final.name + "\n")
    os.replace(latest_tmp, root / "latest")
    return final


def latest_checkpoint(run_dir: Path, needs: str = "state.pt") -> Path | None:
    """The folder ``checkpoints/latest`` of a run points to, if it holds the file ``needs``."""
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    return path if (path / needs).is_file() else None


def resolve_checkpoint(path: Path) -> Path | None:
    """The checkpoint folder (with ``model.pt``) that ``path`` names: ``path`` itself, or the
    latest checkpoint of the run folder ``path``; None if it names neither."""
    path = Path(path)
    return path if (path / "model.pt").is_file() else latest_checkpoint(path, needs="model.pt")


def load_checkpoint(path: Path, model, optimizer, scheduler, fsdp: bool = False) -> dict:
    """Restore model/optimizer/scheduler in place; return the saved ``state`` dict."""
    model_sd = torch.load(path / "model.pt", map_location="cpu", weights_only=False)
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
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
