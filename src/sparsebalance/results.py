"""Dated benchmark results files: the command that made them, the machine, the numbers.

Every benchmark writes ``benchmarks/results/<date>-<name>-<device>.{md,json}`` through this module,
so README figures can always be traced to a file and a command. The command line is written
without the machine's absolute paths (``~``, ``$TMPDIR``, relative to the working folder).

Results files are written atomically (a temporary file beside the target, fsync, then one
rename), so a reader or a full disk never leaves a half-written one, and they are never replaced:
a second file of the same name on the same day is ``<date>-<name>-<device>-2.{md,json}`` (then
``-3`` ...), so the first keeps the name the docs link to. :func:`write_file` is the same atomic
write for files that are meant to be replaced (a run's ``report.md`` and its plots).
"""

from __future__ import annotations

import datetime as dt
import errno
import itertools
import json
import os
import platform
import secrets
import shlex
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import torch


def machine_info(device: torch.device) -> dict:
    """What the numbers were measured on."""
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_threads": torch.get_num_threads(),
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def command_line(argv: list[str] | None = None, cwd: str | Path | None = None) -> str:
    """The command as the user typed it (best effort; ``argv``: ``sys.argv``), with no machine's
    absolute paths (:func:`portable_path`): a results file names what ran, not where."""
    argv = sys.argv if argv is None else argv
    prog = os.path.basename(argv[0])
    if prog in ("__main__.py", "-c"):
        prog = "python -m sparsebalance"
    elif prog.endswith(".py"):  # a script: its path as typed (benchmarks/x.py), not its name
        prog = f"python {portable_path(argv[0], cwd)}"
    return " ".join([prog, *(shlex.quote(portable_path(a, cwd)) for a in argv[1:])])


def portable_path(arg: str, cwd: str | Path | None = None) -> str:
    """``arg`` without an absolute path of this machine: one under ``cwd`` (default: the working
    folder) relative to it, one under the home or temporary folder from ``~`` or ``$TMPDIR``,
    any other as ``<abs>/`` and its name; ``--flag=/a/b`` and comma-separated lists
    alike. Other arguments are returned as they are."""
    if arg.startswith("-") and "=" in arg:
        flag, value = arg.split("=", 1)
        return f"{flag}={portable_path(value, cwd)}"
    if "," in arg:
        return ",".join(portable_path(a, cwd) for a in arg.split(","))
    if not os.path.isabs(arg):
        return arg
    path = Path(os.path.normpath(arg))
    for root, shown in ((Path(cwd or os.getcwd()), ""), (Path.home(), "~"), (Path(tempfile.gettempdir()), "$TMPDIR")):
        try:
            rel = path.relative_to(root.resolve() if root.exists() else root)
        except ValueError:
            try:
                rel = path.relative_to(root)
            except ValueError:
                continue
        if not shown:
            return str(rel) if str(rel) != "." else "."
        return f"{shown}/{rel}" if str(rel) != "." else shown
    return f"<abs>/{path.name}"


def write_results(
    out_dir: str | Path,
    name: str,
    device: torch.device,
    table_md: str,
    payload: dict,
    notes: str = "",
) -> tuple[Path, Path]:
    """Write ``<date>-<name>-<device>.md`` (human) and ``.json`` (machine). Returns both paths.

    Never replaces a file: when either name is taken (an earlier run the same day), both get the
    first free suffix ``-2``, ``-3`` ... (print the returned paths: they say which was written).
    Atomic; a full disk raises :class:`DiskFull` with neither file nor a temporary one left.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.date.today().isoformat()
    stem = f"{stamp}-{name}-{device.type}"
    info = machine_info(device)
    cmd = command_line()
    md = [
        f"# {name} — {stamp}",
        "",
        f"Command: `{cmd}`",
        "",
        "Machine: " + ", ".join(f"{k}={v}" for k, v in info.items()),
        "",
        table_md,
    ]
    if notes:
        md += ["", notes]
    md_text = "\n".join(md) + "\n"
    json_text = json.dumps({"command": cmd, "machine": info, **payload}, indent=2) + "\n"
    what = f"results file {out_dir / stem}.md/.json"  # for a full disk's message
    md_tmp = _write_temp(out_dir / f"{stem}.md", _text(md_text), what)
    json_tmp = None
    try:
        json_tmp = _write_temp(out_dir / f"{stem}.json", _text(json_text), what)
        for n in itertools.count(1):
            suffix = "" if n == 1 else f"-{n}"
            md_path, json_path = out_dir / f"{stem}{suffix}.md", out_dir / f"{stem}{suffix}.json"
            if json_path.exists() or not _claim(md_tmp, md_path):
                continue
            try:
                if _claim(json_tmp, json_path):
                    break
            except BaseException:
                md_path.unlink(missing_ok=True)  # ours: no .md without its .json
                raise
            os.replace(md_path, md_tmp)  # the .json name was taken meanwhile: the next pair
    except OSError as err:
        if err.errno in NO_SPACE:
            raise _disk_full(out_dir / f"{stem}.md", what) from None
        raise
    finally:
        md_tmp.unlink(missing_ok=True)
        if json_tmp is not None:
            json_tmp.unlink(missing_ok=True)
    _fsync_dir(out_dir)
    return md_path, json_path


NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class DiskFull(ValueError):
    """The disk filled while writing a results file (nothing of it is left behind)."""


def write_file(path: str | Path, data: str | Callable[[BinaryIO], None]) -> Path:
    """Write ``data`` (text, or a function writing bytes to an open file, e.g. a figure's
    ``savefig``) to ``path`` atomically, replacing any file there; parents are created. A full
    disk raises :class:`DiskFull`, the temporary file removed and an existing ``path`` intact."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _write_temp(path, _text(data) if isinstance(data, str) else data)
    try:
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        if err.errno in NO_SPACE:
            raise _disk_full(path) from None
        raise
    _fsync_dir(path.parent)
    return path


def _text(text: str) -> Callable[[BinaryIO], None]:
    return lambda f: f.write(text.encode())


def _write_temp(path: Path, write: Callable[[BinaryIO], None], what: str = "") -> Path:
    """A temporary file of this writer's own beside ``path``, written and fsync'ed."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError) and err.errno in NO_SPACE:
            raise _disk_full(path, what) from None
        raise
    return tmp


def _claim(tmp: Path, path: Path) -> bool:
    """Give ``tmp``'s content the name ``path`` unless ``path`` exists (False then). A hard
    link fails on an existing name in one step, so two writers cannot both take it."""
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError as err:
        if err.errno in NO_SPACE:
            raise
        # no hard links on this filesystem (FAT, some network mounts): check, then rename
        if path.exists():
            return False
        os.rename(tmp, path)
        return True


def _fsync_dir(folder: Path) -> None:
    """Make the rename itself durable (best effort: not every filesystem lets a folder sync)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _disk_full(path: Path, what: str = "") -> DiskFull:
    """One line: what was not written, the free space, what was removed and what is intact."""
    where = path.parent
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = f", {shutil.disk_usage(where).free / 2**20:,.1f} MiB free in {where}"
    except OSError:
        free = ""
    kept = f"; the earlier {path.name} is intact" if not what and path.exists() else ""
    return DiskFull(
        f"{what or path}: not written, the disk is full (no space left on the device{free}): its "
        f"partial temporary file{'s were' if what else ' was'} removed{kept}; free space and run "
        "it again"
    )


def markdown_table(headers: list[str], rows: list[list]) -> str:
    """A GitHub markdown table; floats are printed with 3 significant decimals."""

    def fmt(x):
        return f"{x:.3f}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)
