"""Writing a file so that a reader never sees it half-written and concurrent writers never
collide: the text goes to a temporary file of the writer's own (pid + random suffix) beside the
target, then replaces it in one rename. And checking, before any work, that a command's output
(``--out``, ``--save``, ``--results-dir``, ``--plot``) can be written where it is asked to be:
a result is never computed only to be lost to a folder where a file should go, a file where a
folder should go, or a place this user cannot write."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _writable_parent(path: Path, flag: str) -> None:
    """The nearest existing ancestor of ``path`` must be a folder this user can write into."""
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: {parent} is not writable")


def check_output_file(path: str | Path, flag: str) -> None:
    """``flag PATH`` will be written as a file (replaced if it exists): refused in one line
    before any work when ``PATH`` is a folder, or neither it nor its folder can be written."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a folder; give a file name")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{flag} {path}: exists and is not writable")
    _writable_parent(path, flag)


def check_output_folder(path: str | Path, flag: str) -> None:
    """``flag DIR`` will be a folder that files are written into (created if missing): refused
    in one line before any work when ``DIR`` is a file or cannot be created or written."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path}: exists and is not a folder")
    if path.is_dir():
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"{flag} {path}: is not writable")
        return
    _writable_parent(path, flag)
