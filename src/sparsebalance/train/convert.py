"""``python -m sparsebalance.train.convert PATH...``: convert checkpoints of format 1 to the
current format, in place (PATH: a run folder, its ``checkpoints`` folder, or one checkpoint).

Format 1 (before checkpoints carried a version) pickled numpy's RNG state, so its ``state.pt``
loads only with ``torch.load(weights_only=False)``, which runs whatever code a planted pickle
holds. This tool does that load once, on folders you trust (written by you, writable by nobody
else), and writes the same state as tensors and plain values (numpy's RNG state as a list, the
optimizer state keyed by parameter name), which every later load reads weights-only. Checksums
are verified first (they detect damage, not tampering).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from ..versions import CHECKPOINT
from .checkpoint import (
    _STEP,
    checkpoint_version,
    install,
    plain,
    verify_checkpoint,
    write_folder,
)

FORMAT_1_CONFIG = 1
"""The run-config version every format-1 checkpoint was written under."""


def checkpoints_in(path: Path) -> list[Path]:
    """The checkpoint folders ``path`` names (a checkpoint, a ``checkpoints`` folder or a run
    folder), oldest first."""
    path = Path(path)
    if (path / "state.pt").is_file():
        return [path]
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    found = [(int(m.group(1)), p) for p in root.glob("step-*") if (m := _STEP.fullmatch(p.name))]
    if not found:
        raise ValueError(f"{path}: no checkpoint (step-N folder with state.pt) there")
    return [p for _, p in sorted(found)]


def _numpy_state(state) -> dict:
    """numpy's legacy ``get_state()`` tuple -> its dict form with the key as a list."""
    if isinstance(state, dict):
        return plain(state)
    name, key, pos, has_gauss, gauss = state
    return {
        "bit_generator": str(name),
        "state": {"key": np.asarray(key).tolist(), "pos": int(pos)},
        "has_gauss": int(has_gauss),
        "gauss": float(gauss),
    }


def _named_optimizer(optim: dict, model_sd: dict, where: Path) -> dict:
    """A ``torch.optim`` state dict keyed by parameter index -> keyed by parameter name (what
    ``torch.distributed.checkpoint.state_dict`` loads). Names: the model state dict's entries
    in order, tied ones once (the order ``model.parameters()`` gave the optimizer)."""
    indices = [i for g in optim["param_groups"] for i in g["params"]]
    if all(isinstance(i, str) for i in indices):  # an FSDP2 run's: already by name
        return optim
    names, seen = [], set()
    for name, tensor in model_sd.items():
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            names.append(name)
    shapes = {n: tuple(model_sd[n].shape) for n in names}
    ok = len(names) == len(indices) and all(
        tuple(t.shape) == shapes[names[i]]
        for i, s in optim["state"].items()
        for t in s.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    if not ok:
        raise ValueError(f"{where}: cannot match the optimizer state to the model's parameters")
    by_index = dict(enumerate(names))
    groups = [{**g, "params": [by_index[i] for i in g["params"]]} for g in optim["param_groups"]]
    state = {by_index[i]: s for i, s in optim["state"].items()}
    return {"state": state, "param_groups": groups}


def convert_checkpoint(path: Path) -> bool:
    """Rewrite checkpoint ``path`` in the current format; False if it already is. Loads its old
    ``state.pt`` with ``weights_only=False``: only for checkpoints you trust."""
    version = checkpoint_version(path)
    if version == CHECKPOINT.version or version in CHECKPOINT.readable:  # read as it is
        return False
    if version != 1:
        CHECKPOINT.check(version, f"checkpoint {path}")
    verify_checkpoint(path, ("model.pt",))  # every file against checksums.json, if it has one
    model_sd = torch.load(path / "model.pt", map_location="cpu", weights_only=True)
    old = torch.load(path / "state.pt", map_location="cpu", weights_only=False)  # trusted
    rng = [{**r, "numpy": _numpy_state(r["numpy"])} for r in old["rng"]]
    state = {
        "optimizer": _named_optimizer(old["optimizer"], model_sd, path),
        "scheduler": plain(old["scheduler"]),
        "rng": plain(rng),
        "trainer": plain(old["trainer"]),
    }
    step = old["trainer"].get("step")
    if step is None:
        step = int(_STEP.fullmatch(path.name).group(1)) if _STEP.fullmatch(path.name) else 0
    install(path, lambda tmp: write_folder(tmp, step, model_sd, state, FORMAT_1_CONFIG))
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparsebalance.train.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "paths", nargs="+", metavar="PATH", help="run folder, its checkpoints folder, or one checkpoint"
    )
    args = parser.parse_args(argv)
    try:
        for path in [c for p in args.paths for c in checkpoints_in(Path(p))]:
            done = convert_checkpoint(path)
            print(f"{path}: {'converted' if done else 'already current'}")
    except ValueError as err:
        print(f"sparsebalance convert: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
