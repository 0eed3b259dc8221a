"""Issue 26, item 3 in the trainer: every time of a step (micro-batch seconds, starts, ready and
done) comes from the run's clock, read once after the step's one synchronize. With fake CUDA
events (tests/test_clock.py) the times are exactly the fake device's, which a host stamp taken
at enqueue time (the review's defect 3) could not produce."""

from __future__ import annotations

import itertools

import pytest
import torch

from sparsebalance.engine.runtime import Runtime
from sparsebalance.train import Trainer
from tests.test_clock import TICK, fake_clock
from tests.train.harness import base_config

pytestmark = [
    pytest.mark.filterwarnings("ignore::sparsebalance.latency.ProfileMismatchWarning"),
    pytest.mark.timeout(600),
]


def test_a_step_reads_device_times_once_after_its_synchronize(tmp_path):
    trainer = Trainer(base_config(tmp_path, steps=1), Runtime(0, 1, torch.device("cpu")))
    clock, dev = fake_clock()
    trainer.par.clock = clock  # what parallelize(...) builds from a CUDA runtime
    result = trainer.run_step()
    assert dev.syncs == 1  # one wait for the device per step, none per micro-batch or layer
    (rec,) = result.records
    assert rec.microbatch_s and all(s == pytest.approx(TICK) for s in rec.microbatch_s)
    starts = [u["start_s"] for u in rec.units]
    assert starts[0] == pytest.approx(TICK)  # one event (the step's origin) before it
    assert all(b - a == pytest.approx(2 * TICK) for a, b in itertools.pairwise(starts))
    assert rec.density > 0  # the layer statistics were read after the synchronize
