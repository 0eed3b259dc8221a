"""Writing a file so that a reader never sees it half-written and concurrent writers never
collide: the text goes to a temporary file of the writer's own (pid + random suffix) beside the
target, then replaces it in one rename. And checking, before any work, that a command's output
(``--out``, ``--save``, ``--results-dir``, ``--plot``) can be written where it is asked to be:
a result is never computed only to be lost to a folder where a file should go, a file where a
folder should go, or a place this user cannot write. And where the caches live
(:func:`cache_folder`: ``$SPARSEBALANCE_CACHE``, else ``~/.cache/sparsebalance``) and whether they
can be written there (:func:`unwritable`)."""

from __future__ import annotations

import os
import secrets
import tempfile
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


CACHE_ENV = "SPARSEBALANCE_CACHE"
"""Environment variable: the folder SparseBalance keeps its caches in (the token stores of raw
``--data`` under ``tokens/``, measured latency profiles under ``profiles/``), instead of
``~/.cache/sparsebalance``: for a read-only or full home folder."""


def cache_folder(kind: str) -> Path:
    """The cache folder of ``kind`` (``tokens``, ``profiles``): ``$SPARSEBALANCE_CACHE/KIND``
    when the variable is set, else ``~/.cache/sparsebalance/KIND``; read at each call."""
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root).expanduser() / kind
    try:
        home = Path.home()
    except RuntimeError:  # no HOME and no password entry to find it in
        raise ValueError(f"no home folder to keep the {kind} cache in: set {CACHE_ENV} to a writable folder") from None
    return home / ".cache" / "sparsebalance" / kind


def unwritable(folder: Path) -> str | None:
    """Why ``folder`` cannot be created or written into, in a few words (``Permission denied:
    /home/u/.cache``), or None when it can. Tried, not inferred from permission bits: the folder
    is created and a file made in it and removed (bits say nothing of a read-only mount, and
    nothing stops root)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        reason = err.strerror or type(err).__name__
        return f"{reason}: {err.filename}" if err.filename else reason
    return None
