"""Dated benchmark results files: the command that made them, the machine, the numbers.

Every benchmark writes ``benchmarks/results/<date>-<name>-<device>.{md,json}`` through this module,
so README figures can always be traced to a file and a command.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shlex
import sys
from pathlib import Path

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


def command_line() -> str:
    """The command as the user typed it (best effort)."""
    prog = os.path.basename(sys.argv[0])
    if prog in ("__main__.py", "-c"):
        prog = "python -m sparsebalance"
    elif prog.endswith(".py"):  # a script: its path as typed (benchmarks/x.py), not its name
        prog = f"python {sys.argv[0]}"
    return " ".join([prog, *map(shlex.quote, sys.argv[1:])])


def write_results(
    out_dir: str | Path,
    name: str,
    device: torch.device,
    table_md: str,
    payload: dict,
    notes: str = "",
) -> tuple[Path, Path]:
    """Write ``<date>-<name>-<device>.md`` (human) and ``.json`` (machine). Returns both paths."""
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
    md_path, json_path = out_dir / f"{stem}.md", out_dir / f"{stem}.json"
    md_path.write_text("\n".join(md) + "\n")
    json_path.write_text(json.dumps({"command": cmd, "machine": info, **payload}, indent=2) + "\n")
    return md_path, json_path


def markdown_table(headers: list[str], rows: list[list]) -> str:
    """A GitHub markdown table; floats are printed with 3 significant decimals."""

    def fmt(x):
        return f"{x:.3f}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)
