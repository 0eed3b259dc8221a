"""What every checkpoint reader and writer shares: the checksums file's name, a file's SHA-256,
and reading a saved tensor file (memory-mapped, a damaged file one line)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

CHECKSUMS = "checksums.json"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def load_file(path: Path, device: torch.device | str = "cpu"):
    """A ``torch.save``'d file of tensors (weights only, memory-mapped); unreadable: one line."""
    try:
        return torch.load(path, map_location=device, weights_only=True, mmap=True)
    except Exception as err:  # pickle / zip errors of a damaged file, whatever their type
        raise ValueError(f"checkpoint {path}: unreadable ({type(err).__name__}: {err})") from None
