"""The three examples run as scripts (one CPU process each, the tiny model, 2 steps) and print
finite, decreasing-or-not losses: they stay runnable as the library changes. Slow tier: each
imports transformers and trains in a fresh interpreter (~20-60 s on a loaded 2-core machine)."""

from __future__ import annotations

import ast
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name: str, tmp_path: Path) -> list[float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_DISABLED": "true"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("losses ")][-1]
    return ast.literal_eval(line.removeprefix("losses "))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf_trainer.py", "trl_sft.py", "accelerate_loop.py"])
def test_example_runs(name, tmp_path):
    if name == "trl_sft.py":
        pytest.importorskip("trl")
    losses = run_example(name, tmp_path)
    assert len(losses) == 2
    assert all(math.isfinite(x) and 0 < x < 20 for x in losses)


@pytest.mark.parametrize("name", ["hf_trainer.py", "trl_sft.py", "accelerate_loop.py"])
def test_example_is_short(name):
    assert len((EXAMPLES / name).read_text().splitlines()) <= 60
