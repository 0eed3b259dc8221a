"""The files of a pipeline checkpoint's stages (``--pp P``, :mod:`.pipeline_checkpoint`), and the
one reader that merges them into the whole model for the commands that need it (``eval``,
loading a checkpoint as a model: :func:`.checkpoint.load_weights`).

A pipeline checkpoint holds no ``model.pt``: stage ``s`` of the first pipeline writes its
parameters, under the whole model's names, to ``model-stage-0000s.pt`` and its optimizer state to
``optim-stage-0000s.pt``; ``checksums.json`` lists every file. A checkpoint written before them
(``model.pt``, format 2) reads as before.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

MODEL_SHARD = "model-stage-{:05d}.pt"
"""A stage's parameters, by the whole model's names (a tied weight in every stage using it)."""
OPTIM_SHARD = "optim-stage-{:05d}.pt"
"""A stage's optimizer state, keyed by parameter names."""


def is_sharded(path: Path) -> bool:
    """Whether checkpoint ``path`` holds its model as stage files (stage 0's is there)."""
    return (Path(path) / MODEL_SHARD.format(0)).is_file()


def has_weights(path: Path) -> bool:
    """Whether ``path`` is a checkpoint folder holding a model: ``model.pt`` or stage files."""
    return (Path(path) / "model.pt").is_file() or is_sharded(path)


def model_files(path: Path) -> list[Path]:
    """The files holding checkpoint ``path``'s model: its stage files in stage order, else
    ``model.pt``. The stages are counted up to the first missing one (``checksums.json``, verified
    before, names every file a save wrote)."""
    path = Path(path)
    files = []
    while (f := path / MODEL_SHARD.format(len(files))).is_file():
        files.append(f)
    return files or [path / "model.pt"]


def merged_weights(path: Path, load: Callable[[Path], dict]) -> dict:
    """The whole model's state dict of checkpoint ``path``, each file read with ``load`` in one
    process: the stages' entries in stage order (a tied weight, in two stages with the same
    values, once), which is what ``model.pt`` of a pipeline checkpoint held before."""
    out = {}
    for f in model_files(path):
        out.update(load(f))
    return out
