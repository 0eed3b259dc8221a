"""gpu tier (issue 26, item 5): a training step with the flex backend makes no host sync in its
forward and backward, checked with ``torch.cuda.set_sync_debug_mode("error")`` (any synchronizing
call raises, naming it). Exempt, and switched back to the default mode while they run: block
selection and DST's layer controller (``ops/select.py``, ``tuning/layer.py``; their fixed-shape
top-k rewrite is issue 27) and, not in this test, the ``torch`` backend, whose variable-size
gathers size their outputs on the host."""

from __future__ import annotations

import functools

import pytest
import torch

from sparsebalance.latency import analytic_profile
from sparsebalance.models import attention as attention_module
from sparsebalance.models import load_shapes
from sparsebalance.ops.select import BlockMassEstimate
from sparsebalance.train import Trainer
from sparsebalance.train.execute import RankExecutor
from sparsebalance.train.runtime import Runtime
from sparsebalance.tuning import LayerController
from tests.train.harness import base_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.filterwarnings("ignore::sparsebalance.latency.ProfileMismatchWarning"),
]


def _in_mode(mode, fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(mode)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(before)

    return run


def test_flex_training_step_has_no_host_sync_outside_selection(tmp_path, monkeypatch):
    profile = tmp_path / "profile.json"
    analytic_profile(load_shapes("tiny"), "h100", block_size=128).save(profile)
    cfg = base_config(tmp_path, steps=1, device="cuda", block_size=128, backend="flex",
                      precision="bf16", profile=str(profile), loss="chunked")  # fmt: skip
    trainer = Trainer(cfg, Runtime(0, 1, torch.device("cuda")))
    trainer.run_step()  # compile first: Inductor's autotuning may sync, once
    for owner, name in [(attention_module, "select_blocks"), (attention_module,
                        "estimate_block_mass"), (BlockMassEstimate, "layout"),
                        (LayerController, "choose")]:  # fmt: skip
        monkeypatch.setattr(owner, name, _in_mode("default", getattr(owner, name)))
    monkeypatch.setattr(RankExecutor, "_forward_backward",
                        _in_mode("error", RankExecutor._forward_backward))  # fmt: skip
    result = trainer.run_step()  # raises at the first synchronizing call
    assert result.summary.mean_density > 0
