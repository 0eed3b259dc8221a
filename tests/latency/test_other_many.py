"""Issue 54: the planner prices the head term of hundreds of micro-batches per step in one call;
``LatencyModel.layer_other_seconds_many`` gives ``layer_other_seconds``'s values exactly."""

import numpy as np
import pytest

from sparsebalance.latency import LatencyModel, analytic_profile
from sparsebalance.models import load_shapes
from sparsebalance.workload import ManyOtherCost


@pytest.mark.filterwarnings("ignore::sparsebalance.latency.OutsideGridWarning")
def test_many_equals_one_at_a_time():
    model = LatencyModel(analytic_profile(load_shapes("qwen2.5-0.5b"), "h100", block_size=128))
    assert isinstance(model, ManyOtherCost)
    tokens = np.array([[1, 100, 4096], [70000, 33333, 8]])  # inside and outside the profiled grid
    many = model.layer_other_seconds_many(tokens)
    assert many.shape == tokens.shape
    assert many.tolist() == [[model.layer_other_seconds(int(t)) for t in row] for row in tokens.tolist()]
