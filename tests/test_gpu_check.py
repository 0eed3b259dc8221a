"""scripts/gpu_check.sh without a GPU: a clear one-line skip, exit 0, nothing written; bad flags
refused; the interpreter it picks where python3 is itself a virtualenv's (the lent GPU image,
issue 38: a venv made from it does not see its torch); a failed step's one-line reason. (What it
runs on a GPU is the gpu tier and the commands it prints into its results.) Also the version
floors issue 26 raised (FSDP2's import, Liger's autocast fix)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
IN_VENV = sys.prefix != sys.base_prefix


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_gpu_check_skips_cleanly_without_cuda(tmp_path):
    cmd = ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--results", str(tmp_path / "results")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "gpu_check: skipped: no CUDA GPU here" in res.stderr
    assert not (tmp_path / "results").exists()


def test_gpu_check_refuses_an_unknown_stage():
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--stage", "warmup"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 2
    assert "--stage must be setup, tier, bench, profile, train or hf, got warmup" in res.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="stops at the CUDA check, as on a CPU")
@pytest.mark.skipif(not IN_VENV, reason="needs a virtualenv's python with torch (as the image's)")
def test_python3_of_a_virtualenv_is_used_as_it_is(tmp_path):
    """python3 = this virtualenv's interpreter (which has torch), as on the GPU image; a
    .venv-gpu made from it (what the script used to make) cannot import torch, and is not used."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python3 = bin_dir / "python3"  # a wrapper, not a symlink: sys.prefix stays the venv's
    python3.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python3.chmod(0o755)
    stale = tmp_path / "venv-gpu"
    subprocess.run([str(python3), "-m", "venv", "--system-site-packages", "--without-pip",
                    str(stale)], check=True, timeout=120)  # fmt: skip
    seen = subprocess.run([str(stale / "bin" / "python"), "-c", "import torch"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert seen.returncode != 0 and "No module named 'torch'" in seen.stderr  # the defect
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "GPU_CHECK_VENV": str(stale)}  # fmt: skip
    env.pop("GPU_CHECK_PYTHON", None)
    res = subprocess.run(["bash", str(SCRIPT), "--results", str(tmp_path / "results")], env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    assert lines[0] == (
        f"gpu_check: python: {sys.executable} (python3 is a virtualenv's interpreter with "
        "torch: used as it is, no .venv-gpu (a venv made from it would not see its packages))"
    )
    assert lines[1].startswith("gpu_check: skipped: no CUDA GPU here (torch.cuda.is_available()")
    assert not (tmp_path / "results").exists()


def test_a_failed_step_says_why_in_one_line(tmp_path):
    """run_step (the script sourced: its functions only) records a failure with the line of the
    log that says why, in the report and on stderr."""
    fail = "import sys; print('loading'); sys.exit('ValueError: --block-size 64 cannot compile')"
    script = (f'source "{SCRIPT}"; work="{tmp_path}"; report="{tmp_path}/report.md"; '
              f'run_step "demo stage" 60 "{sys.executable}" -c "{fail}"')  # fmt: skip
    res = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    why = "FAILED (exit 1): ValueError: --block-size 64 cannot compile"
    assert res.stderr.strip() == f"gpu_check: demo stage: {why}"
    assert f"### demo stage: {why}, " in (tmp_path / "report.md").read_text()


def test_version_floors():
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + project["optional-dependencies"]["gpu"]
    assert "torch>=2.6,<2.15" in deps  # 2.6: FSDP2's public fully_shard; 2.11 (lent GPUs) inside
    assert "liger-kernel>=0.5.3" in deps  # Liger-Kernel #501: addmm under autocast
    from torch.distributed.fsdp import fully_shard  # noqa: F401  (what the floor is for)
