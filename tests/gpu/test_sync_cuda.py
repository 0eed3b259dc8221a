"""gpu tier (issues 26, 36 item 5 and 42): a training step with the flex backend makes no host
sync before the step's one synchronize: the packs' uploads, block selection, DST's layer
decisions, forward and backward of every micro-batch of the rank, checked with
``torch.cuda.set_sync_debug_mode("error")`` (any synchronizing call raises, naming it; a copy
from pageable memory is one). Nothing is exempt (issue 53: gamma budgets decide on the device
too, and ``--loss auto`` never picks Liger, which reads back); not in this test: the ``torch``
backend, whose variable-size gathers size their outputs on the host. The CPU twins (a dispatch
mode counting host reads; the stand-in device): ``tests/engine/test_cuda_defaults.py``,
``tests/standin/``, ``tests/ops/test_host_sync.py``."""

from __future__ import annotations

import functools

import pytest
import torch

from sparsebalance.engine.execute import RankExecutor
from sparsebalance.engine.runtime import Runtime
from sparsebalance.latency import analytic_profile
from sparsebalance.models import load_shapes
from sparsebalance.train import Trainer
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


@pytest.mark.parametrize("kind", ["gamma", "top-k", "dense"])
def test_flex_training_step_has_no_host_sync(tmp_path, monkeypatch, kind):
    """Gamma and top-k: DST's layer controller decides its coverage bound on the device (issues
    38 and 53). Dense: the default budget (8,192 tokens) keeps documents of 1-4K whole: the dense
    kernel, no selection. The loss is ``--loss auto``'s."""
    from sparsebalance.tuning import DSTConfig

    profile = tmp_path / "profile.json"
    analytic_profile(load_shapes("tiny"), "h100", block_size=128).save(profile)
    short = {"data": None, "num_builtin": 16, "min_len": 1024, "max_len": 4096, "capacity": 4096, "global_batch": 4}
    over = {
        "gamma": {"dst": DSTConfig(budget="gamma", gamma0=0.9, gamma_min=0.5, gamma_max=0.99)},
        "top-k": {"dst": DSTConfig(budget="top-k", budget_tokens=256), **short},  # selection
        "dense": {"dst": DSTConfig(), **short},
    }[kind]
    cfg = base_config(
        tmp_path,
        steps=2,
        device="cuda",
        block_size=128,
        backend="flex",
        precision="bf16",
        profile=str(profile),
        loss="auto",
        **over,
    )
    trainer = Trainer(cfg, Runtime(0, 1, torch.device("cuda")))
    trainer.run_step()  # compile first: Inductor's autotuning may sync, once
    monkeypatch.setattr(RankExecutor, "_run", _in_mode("error", RankExecutor._run))
    result = trainer.run_step()  # raises at the first synchronizing call
    assert result.report.mean_density > 0
