"""Issue 55: the examples print one summary per run, not one per rank (with ``torchrun
--nproc-per-node 2`` both ranks printed every step's line and the losses), and end cleanly on
every rank (``sparsebalance.shutdown()``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.examples.test_examples import EXAMPLES


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["hf_trainer.py", "trl_sft.py", "accelerate_loop.py"])
def test_two_ranks_print_one_summary(name, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_DISABLED": "true"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.run(
        [*cmd, str(EXAMPLES / name), str(tmp_path)], capture_output=True, text=True, env=env, timeout=840
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert sum(x.startswith("losses ") for x in lines) == 1, proc.stdout
    if name == "hf_trainer.py":
        assert [x.split(":")[0] for x in lines if x.startswith("step ")] == ["step 0", "step 1"], proc.stdout
