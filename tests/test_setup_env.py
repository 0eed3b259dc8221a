"""Issue 55: ``scripts/setup_env.sh`` installs the CPU build of torch from the PyTorch CPU index on
a machine without a GPU (a plain ``pip install torch`` takes the default index's CUDA build, several
GB, on Linux x86), falls back to the default index when that index gives none, says which in one
line, and says what each step installs, about how long it takes and how long it took.

The virtual environment's python is a stand-in that records what it is asked and answers as pip
would (``Processing /opt/wheels/torch-...whl`` when pip's configured find-links served the wheel):
nothing is installed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "setup_env.sh"

FAKE_PYTHON = r"""#!/bin/bash
echo "$*" >> "$FAKE_LOG"
case "$*" in
  "-c import torch") exit 1 ;;
  *"--index-url"*)
    [ -n "${FAKE_INDEX_FAILS:-}" ] && { echo "ERROR: No matching distribution found for torch==2.13.0"; exit 1; }
    echo "Looking in indexes: https://download.pytorch.org/whl/cpu"
    echo "$FAKE_FETCHED"
    echo "Successfully installed torch-2.13.0+cpu" ;;
esac
exit 0
"""


def _setup(tmp_path: Path, gpu: bool, **env: str) -> tuple[list[str], list[str]]:
    """Run the script on a stand-in virtualenv: (lines it printed, the python calls made)."""
    venv, tools = tmp_path / "venv", tmp_path / "tools"
    (venv / "bin").mkdir(parents=True)
    tools.mkdir()
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    smi = tools / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nexit {0 if gpu else 1}\n")
    for tool in (python, smi):
        tool.chmod(0o755)
    log = tmp_path / "calls"
    env = {
        "PATH": f"{tools}{os.pathsep}/usr/bin{os.pathsep}/bin",
        "HOME": str(tmp_path),
        "SPARSEBALANCE_VENV": str(venv),
        "FAKE_LOG": str(log),
        "FAKE_FETCHED": "Processing /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",
        **env,
    }
    done = subprocess.run(
        ["bash", "-c", f'source "{SCRIPT}" plot'], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines(), log.read_text().splitlines()


def _torch_installs(calls: list[str]) -> list[str]:
    return [c for c in calls if c.startswith("-m pip install") and "torch==" in c]


def test_a_cpu_machine_asks_the_cpu_index_and_says_where_torch_came_from(tmp_path):
    lines, calls = _setup(tmp_path, gpu=False)
    (install,) = _torch_installs(calls)
    assert "--index-url https://download.pytorch.org/whl/cpu" in install
    assert lines[0] == "[setup] no GPU: installing torch 2.13.0, the CPU build (~200 MB: about a minute on a fast link)"
    assert lines[1] == (
        "[setup] torch: the CPU build from /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl "
        "(pip's configured sources; the CPU index was asked first)"
    )
    assert lines[2].startswith("[setup] torch installed in ") and lines[2].endswith(" s")
    assert lines[3].startswith("[setup] installing sparsebalance[plot] and its dependencies (")
    assert "about 1-3 minutes the first time" in lines[3]
    assert lines[4].startswith("[setup] sparsebalance installed in ")
    assert lines[4].endswith(f"s; in a new shell: source {tmp_path / 'venv'}/bin/activate")


def test_a_wheel_from_the_cpu_index_is_named_so(tmp_path):
    fetched = "Downloading https://download.pytorch.org/whl/cpu/torch-2.13.0%2Bcpu-cp311-cp311-linux_x86_64.whl"
    lines, _ = _setup(tmp_path, gpu=False, FAKE_FETCHED=fetched)
    assert lines[1] == "[setup] torch: the CPU build from the PyTorch CPU index (https://download.pytorch.org/whl/cpu)"


def test_without_the_cpu_index_the_default_index_is_used_and_said(tmp_path):
    lines, calls = _setup(tmp_path, gpu=False, FAKE_INDEX_FAILS="1")
    first, second = _torch_installs(calls)
    assert "--index-url" in first and second == "-m pip install -q torch==2.13.0"
    assert lines[1].startswith(
        "[setup] the PyTorch CPU index (https://download.pytorch.org/whl/cpu) gave no torch 2.13.0: installing from "
        "the default index instead"
    )


def test_a_gpu_machine_takes_the_default_index(tmp_path):
    lines, calls = _setup(tmp_path, gpu=True)
    assert _torch_installs(calls) == ["-m pip install -q torch==2.13.0"]
    assert lines[0].startswith("[setup] GPU found: installing torch 2.13.0, the CUDA build, from the default index")


def test_the_demo_installs_tensorboard():
    """A user's run writes TensorBoard scalars when TensorBoard is installed; the extra the demo
    installs (``plot``) brings it (it was only in ``dev``)."""
    import re

    from sparsebalance.flags import load_file

    extras = load_file(str(ROOT / "pyproject.toml"))["project"]["optional-dependencies"]
    assert any(re.match(r"tensorboard\b", d) for d in extras["plot"])
    assert 'setup_env.sh" "plot"' in (ROOT / "scripts" / "demo.sh").read_text()
