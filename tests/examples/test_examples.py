"""The three examples run as scripts (one CPU process each, the tiny model, 2 steps) and print
finite, decreasing-or-not losses and no warning: they stay runnable and quiet as the library
changes. Slow tier: each imports transformers and trains in a fresh interpreter (~20-60 s on a
loaded 2-core machine). Default tier: each example's ``main`` runs one step in this process with
every warning recorded (issue 45: a ProfileMismatchWarning about the profile the example chose,
an OutsideGridWarning, TRL's FutureWarning for ``gradient_checkpointing=False``)."""

from __future__ import annotations

import ast
import importlib.util
import math
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


# what Python's warnings and transformers' logger print: "x.py:1: FutureWarning: ...",
# "[transformers] The tokenizer has new PAD/BOS/EOS tokens ..."
WARNING_LINE = re.compile(r"\w+Warning: |^\[transformers\]", re.MULTILINE)


def run_example(name: str, tmp_path: Path) -> tuple[list[float], str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_DISABLED": "true"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), str(tmp_path)], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("losses ")][-1]
    return ast.literal_eval(line.removeprefix("losses ")), proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf_trainer.py", "trl_sft.py", "accelerate_loop.py"])
def test_example_runs(name, tmp_path):
    if name == "trl_sft.py":
        pytest.importorskip("trl")
    losses, stderr = run_example(name, tmp_path)
    assert len(losses) == 2
    assert all(math.isfinite(x) and 0 < x < 20 for x in losses)
    assert not WARNING_LINE.search(stderr), stderr[-4000:]


@pytest.mark.parametrize("name", ["hf_trainer.py", "trl_sft.py", "accelerate_loop.py"])
def test_example_runs_without_a_warning(name, tmp_path, capfd, monkeypatch):
    if name == "trl_sft.py":
        pytest.importorskip("trl")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    spec = importlib.util.spec_from_file_location(f"example_{name[:-3]}", EXAMPLES / name)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the example adds its folder
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec.loader.exec_module(module)
        losses = module.main(str(tmp_path), steps=1)
    assert len(losses) == 1 and math.isfinite(losses[0])
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []
    stderr = capfd.readouterr().err
    assert not WARNING_LINE.search(stderr), stderr[-4000:]


@pytest.mark.parametrize("name", ["hf_trainer.py", "trl_sft.py", "accelerate_loop.py"])
def test_example_is_short(name):
    assert len((EXAMPLES / name).read_text().splitlines()) <= 60
